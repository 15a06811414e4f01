#!/usr/bin/env bash
# Install the gateway image's contents into one virtual environment: fleetgate (not
# editable) with the extras its configuration can use. deploy/Dockerfile runs it, and so does
# tests/integration/test_image.py, so the image and its test install the same thing.
#
#   scripts/install-image.sh --venv DIR [--extras semantic,kubernetes] [--python python3] [SRC]
#
# --extras   the optional extras (pyproject.toml); default: every one a config can use,
#            "semantic" (the semantic cache) and "kubernetes" (EndpointSlice discovery).
#            "" installs the gateway alone. `fleetgate check-config` refuses a config that
#            needs an extra the environment lacks.
# --venv     created if missing; an existing one is reused (dependencies already there are
#            kept, fleetgate itself is always reinstalled from SRC).
# SRC        the source tree (default: this script's repository).
#
# With "semantic", the CPU build of torch is installed first, so sentence-transformers never
# pulls a CUDA build (several GB). TORCH_INDEX_URL, when set, is the index to take it from
# (the image build sets PyTorch's CPU index); unset, pip's configured index is used.
# PIP_NO_CACHE_DIR=1 keeps pip's cache out of an image layer.
set -euo pipefail

TORCH_VERSION="2.13.0"
venv="" extras="semantic,kubernetes" python="python3"
src="$(cd "$(dirname "$0")/.." && pwd)"
while [ $# -gt 0 ]; do
    case "$1" in
        --venv) venv="$2"; shift 2 ;;
        --extras) extras="$2"; shift 2 ;;
        --python) python="$2"; shift 2 ;;
        -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
        -*) echo "install-image: unknown option $1" >&2; exit 2 ;;
        *) src="$1"; shift ;;
    esac
done
[ -n "$venv" ] || { echo "install-image: --venv DIR is required" >&2; exit 2; }

for extra in ${extras//,/ }; do
    case "$extra" in
        semantic|kubernetes) ;;
        *) echo "install-image: unknown extra '$extra' (semantic, kubernetes)" >&2; exit 2 ;;
    esac
done

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet)
"${pip[@]}" install --upgrade pip

if [[ ",$extras," == *",semantic,"* ]]; then
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        "${pip[@]}" install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
    else
        "${pip[@]}" install "torch==$TORCH_VERSION"
    fi
fi

# Build from a copy: an in-tree build leaves build/ and *.egg-info in SRC (a read-only
# mount in an image build, the developer's checkout in a test).
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tar -C "$src" --exclude=.git --exclude=.venv --exclude=.venv-vllm --exclude=.cache --exclude=bench/results \
    --exclude=tests --exclude=build --exclude='*.egg-info' -cf - . | tar -C "$work" -xf -
spec="$work"
[ -z "$extras" ] || spec="$work[$extras]"
"${pip[@]}" install "$spec"
# A reused environment may hold an older build of the same version: always take this one.
"${pip[@]}" install --force-reinstall --no-deps "$work"
"$venv/bin/fleetgate" --help >/dev/null
echo "install-image: fleetgate${extras:+[$extras]} in $venv"
