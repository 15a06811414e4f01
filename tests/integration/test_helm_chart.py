"""deploy/helm/fleetgate: the chart lints, renders objects that validate like the overlays',
and, given the values that stand for an overlay, renders that overlay's gateway objects.

Rendering and linting run Helm's own engine (Helm v4's Go SDK, through helm-python-sdk), as
``helm template`` and ``helm lint`` would; validation is the overlays' (``manifests.validate``).
"""

from __future__ import annotations

import base64
import copy
import json
import re
from typing import Any

import helm_python
import pytest
import yaml

from gateway.settings import Settings
from tests.integration.manifests import (
    CHART,
    DEPLOY,
    NAMESPACES,
    OLDEST_KUBERNETES,
    OVERLAYS,
    chart_values,
    find,
    gateway_config,
    one,
    render,
    render_chart,
    validate,
)

# What an overlay deploys beside the gateway and the chart leaves to the operator: the
# namespace (helm install --create-namespace), the model servers and the dev Redis.
OVERLAY_ONLY = {
    "dev": {
        ("Namespace", "fleetgate-dev"),
        ("Deployment", "fleetgate-sim"),
        ("Service", "fleetgate-sim"),
        ("Deployment", "redis"),
        ("Service", "redis"),
    },
    "production": {
        ("Namespace", "inference"),
        ("Deployment", "vllm-llama-3-1-8b"),
        ("Service", "vllm-llama-3-1-8b"),
    },
}
# Every optional part switched on at once, under another release name.
EVERYTHING: dict[str, Any] = {
    "config": {
        "models": [
            {"name": "llama-3.1-8b", "replicas": [{"kubernetes": {"service": "vllm-8b", "port": "http"}}]},
            {
                "name": "qwen-72b",
                "replicas": [
                    {"kubernetes": {"service": "vllm-72b", "namespace": "gpu-pool", "port": 8000}},
                    {"url": "http://vllm-72b-spare.example.internal:8000"},
                ],
            },
        ],
        "autoscaling": {"target_pending_tokens": 32768, "per_model": {"qwen-72b": 65536}},
    },
    "redis": {
        "cluster": {"nodes": ["redis-0.redis:6379", "redis-1.redis:6379"], "tls": True},
        "passwordSecretKey": "redis-password",
    },
    "keys": {"create": True, "data": {"acme": "sk-a", "admin": "sk-b", "redis-password": "p"}},
    "extraEnv": [{"name": "OTEL_SERVICE_NAME", "value": "fleetgate"}],
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "grafanaDashboard": {"enabled": True},
    "metrics": {"serviceMonitor": {"labels": {"release": "kube-prometheus-stack"}}},
    "keda": {
        "scaledObjects": [
            {"name": "vllm-8b", "model": "llama-3.1-8b"},
            {"name": "vllm-72b", "model": "qwen-72b", "maxReplicaCount": 4},
        ]
    },
}
CASES: dict[str, tuple[dict[str, Any] | None, str, str]] = {
    "defaults": (None, "inference", "fleetgate"),
    "dev": (chart_values("dev"), NAMESPACES["dev"], "fleetgate"),
    "production": (chart_values("production"), NAMESPACES["production"], "fleetgate"),
    "everything": (EVERYTHING, "llm", "edge"),
}
# kustomize's secretGenerator appends a hash of the content to the Secret's name.
_GENERATED_SUFFIX = re.compile(r"-[a-z0-9]{10}$")


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]], str, str]:
    values, namespace, release = CASES[request.param]
    return request.param, render_chart(values, namespace=namespace, release=release), namespace, release


def config_of(objects: list[dict[str, Any]], configmap: str = "fleetgate-config") -> Settings:
    text = one(objects, "ConfigMap", configmap)["data"]["config.yaml"]
    return Settings(**yaml.safe_load(text))


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    first: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return first


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("name", list(CASES))
def test_chart_lints_without_warnings(name: str) -> None:
    values, namespace, _ = CASES[name]
    report = helm_python.lint(CHART, values, strict=True, namespace=namespace, kube_version=f"v{OLDEST_KUBERNETES}.0")
    assert report["errors"] == []
    # Severity 1 is information ("icon is recommended"); 2 a warning, 3 an error.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_every_chart_object_validates_against_the_kubernetes_schemas(
    case: tuple[str, list[dict[str, Any]], str, str],
) -> None:
    name, objects, namespace, _ = case
    assert len(objects) >= 7, name
    validate(objects)
    # Everything in the release's namespace, but a discovery Role for vLLM's own namespace.
    elsewhere = {(o["kind"], o["metadata"]["namespace"]) for o in objects if o["metadata"]["namespace"] != namespace}
    assert elsewhere <= {("Role", "gpu-pool"), ("RoleBinding", "gpu-pool")}, name


def test_chart_references_resolve(case: tuple[str, list[dict[str, Any]], str, str]) -> None:
    name, objects, namespace, release = case
    [deployment] = find(objects, "Deployment")
    # helm install fleetgate ... keeps the base's names; another release name is prefixed.
    assert deployment["metadata"]["name"] == (release if release == "fleetgate" else f"{release}-fleetgate")
    pod = deployment["spec"]["template"]["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert _selects(deployment["spec"]["selector"]["matchLabels"], labels)
    for kind in ("Service", "PodDisruptionBudget"):
        for obj in find(objects, kind):
            assert _selects(obj["spec"]["selector"].get("matchLabels", obj["spec"]["selector"]), labels), obj
    for policy in find(objects, "NetworkPolicy"):
        assert _selects(policy["spec"]["podSelector"]["matchLabels"], labels)
    for monitor in find(objects, "ServiceMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"]
        [admin] = [s for s in find(objects, "Service") if _selects(selector, s["metadata"]["labels"])]
        assert [p["name"] for p in admin["spec"]["ports"]] == ["admin"]
    for hpa in find(objects, "HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    one(objects, "ServiceAccount", pod["serviceAccountName"])
    [configmap] = [v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v]
    settings = config_of(objects, configmap)
    c = container(deployment)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": settings.server.port, "admin": settings.server.admin_port}
    assert pod["terminationGracePeriodSeconds"] > settings.server.drain_delay_s + settings.server.shutdown_grace_s
    # Every env: reference in the config is set, from a Secret the chart made or one the
    # operator makes (the production overlay's secret.example.yaml names its keys).
    env = {e["name"]: e for e in c["env"]}
    text = one(objects, "ConfigMap", configmap)["data"]["config.yaml"]
    assert set(re.findall(r"env:(\w+)", text)) <= set(env)
    if settings.redis.password_env:
        assert settings.redis.password_env in env
    example = yaml.safe_load((DEPLOY / "kubernetes/overlays/production/secret.example.yaml").read_text())
    for variable in env.values():
        ref = variable.get("valueFrom", {}).get("secretKeyRef")
        if ref is None:
            continue
        secrets = find(objects, "Secret", ref["name"])
        keys = set(secrets[0]["stringData"]) if secrets else set(example["stringData"])
        assert ref["key"] in keys, (name, ref)
    # Discovery: list and watch EndpointSlices in every namespace a kubernetes source names.
    sources = {(r.kubernetes.namespace or namespace) for m in settings.models for r in m.replicas if r.kubernetes}
    assert {b["metadata"]["namespace"] for b in find(objects, "RoleBinding")} == sources
    for binding in find(objects, "RoleBinding"):
        subject = {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": namespace}
        assert binding["subjects"] == [subject]
        role = [
            r
            for r in find(objects, "Role", binding["roleRef"]["name"])
            if r["metadata"]["namespace"] == binding["metadata"]["namespace"]
        ]
        assert role[0]["rules"] == [
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}
        ]
    # KEDA scales each model's vLLM on its pending tokens, against the config's target.
    for scaled in find(objects, "ScaledObject"):
        [trigger] = scaled["spec"]["triggers"]
        model = re.fullmatch(r'sum\(fleetgate_pending_tokens\{model="([^"]+)"\}\)', trigger["metadata"]["query"])
        assert model is not None and int(trigger["metadata"]["threshold"]) == settings.autoscaling.target(model[1])


def _core(obj: dict[str, Any]) -> dict[str, Any]:
    """An object less what differs by the tool that made it: labels and annotations (Helm's
    release labels), the selectors built from them (checked apart), kustomize's generated
    Secret name and its data encoding, the config's key order and an explicit default."""
    obj = copy.deepcopy(obj)
    obj["metadata"].pop("labels", None)
    obj["metadata"].pop("annotations", None)
    spec = obj.get("spec", {})
    kind = obj["kind"]
    if kind in {"Deployment", "PodDisruptionBudget", "Service", "ServiceMonitor"}:
        spec.pop("selector", None)
    if kind == "NetworkPolicy":
        spec.pop("podSelector")
    if kind == "Service":
        spec.setdefault("type", "ClusterIP")
    if kind == "Deployment":
        pod = spec["template"]
        pod.pop("metadata")
        for constraint in pod["spec"].get("topologySpreadConstraints", []):
            constraint.pop("labelSelector")
        for c in pod["spec"]["containers"]:
            for variable in c.get("env", []):
                ref = variable.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    ref["name"] = _GENERATED_SUFFIX.sub("", ref["name"])
            c["env"] = sorted(c.get("env", []), key=lambda e: e["name"])
    if kind == "Secret":
        obj["metadata"]["name"] = _GENERATED_SUFFIX.sub("", obj["metadata"]["name"])
        data = obj.pop("data", {})
        obj["stringData"] = {k: base64.b64decode(v).decode() for k, v in data.items()} | obj.get("stringData", {})
    if kind == "ConfigMap":
        obj["data"] = {k: yaml.safe_load(v) for k, v in obj["data"].items()}
    return obj


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    name = obj["metadata"]["name"]
    return obj["kind"], _GENERATED_SUFFIX.sub("", name) if obj["kind"] == "Secret" else name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_chart_renders_the_overlays_gateway_objects(overlay: str) -> None:
    kustomized = {_key(o): o for o in render(overlay)}
    charted = {_key(o): o for o in render_chart(chart_values(overlay), namespace=NAMESPACES[overlay])}
    assert set(kustomized) - OVERLAY_ONLY[overlay] == set(charted)
    for key, obj in charted.items():
        assert _core(obj) == _core(kustomized[key]), key
    # The config, read by the gateway: the same settings.
    assert config_of(list(charted.values())) == Settings(**yaml.safe_load(gateway_config(list(kustomized.values()))))


def test_chart_writes_redis_url_for_one_node_or_a_cluster() -> None:
    def redis_of(redis: dict[str, Any]) -> tuple[Settings, dict[str, Any]]:
        objects = render_chart({"redis": redis})
        return config_of(objects), {e["name"]: e for e in container(one(objects, "Deployment", "fleetgate"))["env"]}

    assert redis_of({})[0].redis_url is None
    assert redis_of({"url": "redis://redis:6379/0"})[0].redis_url == "redis://redis:6379/0"
    nodes = {"nodes": ["r-0:6379", "r-1:6379"]}
    assert redis_of({"cluster": nodes})[0].redis_url == "redis+cluster://r-0:6379,r-1:6379"
    assert redis_of({"cluster": nodes | {"tls": True}})[0].redis_url == "rediss+cluster://r-0:6379,r-1:6379"
    settings, env = redis_of({"url": "redis://redis:6379/0", "passwordSecretKey": "redis-password"})
    assert settings.redis.password_env == "FLEETGATE_REDIS_PASSWORD"
    ref = env["FLEETGATE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "fleetgate-keys", "key": "redis-password"}
    _, env = redis_of({"urlSecretKey": "redis-url"})
    assert env["FLEETGATE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "fleetgate-keys", "key": "redis-url"}


def test_replicas_by_url_need_no_discovery_rbac() -> None:
    models = [{"name": "llama-3.1-8b", "replicas": [{"url": "http://vllm-0.example.internal:8000"}]}]
    objects = render_chart({"config": {"models": models}})
    assert find(objects, "Role") == [] and find(objects, "RoleBinding") == []
    one(objects, "ServiceAccount", "fleetgate")
    assert config_of(objects).models[0].replicas[0].url == "http://vllm-0.example.internal:8000"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"terminationGracePeriodSeconds": 300}, "terminationGracePeriodSeconds must exceed"),
        ({"redis": {"url": "redis://a:6379", "cluster": {"nodes": ["b:6379"]}}}, "not both"),
        ({"config": {"redis_url": "redis://a:6379"}, "redis": {"url": "redis://b:6379"}}, "config.redis_url"),
        ({"config": {"server": {"port": 8080, "admin_port": None}}}, "config.server.admin_port"),
        ({"keda": {"scaledObjects": [{"name": "vllm", "model": "nope"}]}}, '"nope" is not in config.models'),
    ],
)
def test_chart_refuses_settings_that_cannot_work(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=re.escape(message)):
        render_chart(values)


def test_dashboard_and_alerts_are_the_deploy_files() -> None:
    objects = render_chart({"grafanaDashboard": {"enabled": True}})
    dashboard = one(objects, "ConfigMap", "fleetgate-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    expected = json.loads((DEPLOY / "grafana/fleetgate.json").read_text())
    assert json.loads(dashboard["data"]["fleetgate.json"]) == expected
    rules = yaml.safe_load((DEPLOY / "kubernetes/base/prometheusrule.yaml").read_text())
    assert one(objects, "PrometheusRule", "fleetgate")["spec"] == rules["spec"]


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"replicas": 3}, "additional properties 'replicas' not allowed"),
        ({"replicaCount": "three"}, "/replicaCount"),
        ({"redis": {"url": "http://redis:6379"}}, "/redis/url"),
        ({"keda": {"scaledObjects": [{"name": "vllm"}]}}, "model"),
    ],
)
def test_schema_refuses_misspelt_or_mistyped_values(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=re.escape(where)):
        render_chart(values)
    # helm lint says so too: the lint test above would see it.
    report = helm_python.lint(CHART, values)
    assert any(where in m["error"] for m in report["messages"] if m["severity"] == 3)
