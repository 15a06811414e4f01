"""deploy/kubernetes: every overlay renders, validates against the Kubernetes schemas, and
hangs together (references resolve, the drain fits the grace period, discovery finds vLLM).

Rendering runs the real kustomize (``kubectl kustomize``); validation uses
kubernetes-validate's bundled OpenAPI schemas (offline), strictly, for the oldest Kubernetes
this targets and the newest it knows. The Prometheus Operator and KEDA kinds have no schema
there: they are checked against what they point at in the same render instead.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.settings import Settings
from tests.integration.manifests import (
    DEPLOY,
    OLDEST_KUBERNETES,
    OVERLAYS,
    ROOT,
    find,
    gateway_config,
    image_command,
    one,
    render,
    validate,
)

GATEWAY = "fleetgate"


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def config_of(objects: list[dict[str, Any]]) -> Settings:
    return Settings(**yaml.safe_load(gateway_config(objects)))


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    first: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return first


def test_every_object_validates_against_the_kubernetes_schemas(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, objects = rendered
    assert len(objects) >= 10
    validate(objects)
    namespaces = {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"}
    assert namespaces == {one(objects, "Namespace", next(iter(namespaces)))["metadata"]["name"]}, overlay


def test_validation_would_catch_a_misspelt_field() -> None:
    deployment = one(render("dev"), "Deployment", GATEWAY)
    container(deployment)["readinesProbe"] = {"httpGet": {"path": "/readyz", "port": "http"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, OLDEST_KUBERNETES, strict=True)


def test_gateway_pod_is_restricted_probed_and_drains_within_its_grace(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    overlay, objects = rendered
    deployment = one(objects, "Deployment", GATEWAY)
    pod = deployment["spec"]["template"]["spec"]
    c = container(deployment)
    settings = config_of(objects)
    # SIGTERM: drain_delay_s of accepting, then shutdown_grace_s for in-flight requests.
    assert pod["terminationGracePeriodSeconds"] > settings.server.drain_delay_s + settings.server.shutdown_grace_s
    readiness = c["readinessProbe"]
    assert settings.server.drain_delay_s > readiness["periodSeconds"] * readiness["failureThreshold"]
    # Restricted Pod Security, with a numeric user matching the image's.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}" == image_command().user
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/etc/fleetgate", "/tmp"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["timeoutSeconds"] >= 1, probe
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # The base's images: tag, which an overlay patch that names the image would undo (latest).
    assert c["image"] == "fleetgate:0.1.0"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    assert pod["topologySpreadConstraints"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": settings.server.port, "admin": settings.server.admin_port}
    expected_replicas = 1 if overlay == "dev" else 3
    assert deployment["spec"]["replicas"] == expected_replicas


def test_references_resolve(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, objects = rendered
    deployment = one(objects, "Deployment", GATEWAY)
    pod = deployment["spec"]["template"]["spec"]
    one(objects, "ServiceAccount", pod["serviceAccountName"])
    for volume in pod["volumes"]:
        if "configMap" in volume:
            one(objects, "ConfigMap", volume["configMap"]["name"])
    # Secrets: generated in dev; in production created by the operator from secret.example.yaml.
    example = yaml.safe_load((DEPLOY / "kubernetes/overlays/production/secret.example.yaml").read_text())
    for env in container(deployment)["env"]:
        ref = env["valueFrom"]["secretKeyRef"]
        secrets = find(objects, "Secret", ref["name"])
        keys = set(secrets[0]["data"]) if secrets else set(example["stringData"])
        assert overlay == "production" or secrets, ref
        assert ref["key"] in keys, ref
    # Every env: key in the config is set by the Deployment.
    names = {e["name"] for e in container(deployment)["env"]}
    assert set(re.findall(r"env:(\w+)", gateway_config(objects))) <= names
    binding = one(objects, "RoleBinding", "fleetgate-endpointslices")
    namespace = deployment["metadata"]["namespace"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "fleetgate", "namespace": namespace}]
    rules = one(objects, "Role", "fleetgate-endpointslices")["rules"]
    assert rules == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_discovered_services_select_ready_probed_pods(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, objects = rendered
    settings = config_of(objects)
    sources = [(m.name, r.kubernetes) for m in settings.models for r in m.replicas if r.kubernetes is not None]
    assert sources
    for model, source in sources:
        service = one(objects, "Service", source.service)
        assert source.port in {p["name"] for p in service["spec"]["ports"]}
        [backend] = [
            d
            for d in find(objects, "Deployment")
            if _selects(service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
        ]
        c = container(backend)
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        args = " ".join(c.get("command", []) + c.get("args", []))
        assert f"--served-model-name={model}" in args or f"--model {model}" in args
        if overlay == "production":
            assert "--enable-prefix-caching" in args
            assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
            assert c["startupProbe"]["httpGet"]["path"] == "/health"


def test_scaled_object_scales_vllm_on_pending_tokens() -> None:
    objects = render("production")
    settings = config_of(objects)
    [scaled] = find(objects, "ScaledObject")
    target = one(objects, "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    model = target["metadata"]["labels"]["fleetgate.io/model"]
    assert model in {m.name for m in settings.models}
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["query"] == f'sum(fleetgate_pending_tokens{{model="{model}"}})'
    assert int(trigger["metadata"]["threshold"]) == settings.autoscaling.target(model)


def test_metrics_port_is_scraped_and_kept_to_monitoring(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, objects = rendered
    policy = one(objects, "NetworkPolicy", GATEWAY)
    by_port = {rule["ports"][0]["port"]: rule.get("from") for rule in policy["spec"]["ingress"]}
    assert by_port["http"] is None  # the API: from anywhere
    assert by_port["admin"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    api = one(objects, "Service", GATEWAY)
    assert [p["targetPort"] for p in api["spec"]["ports"]] == ["http"]  # /metrics is not on the public Service
    monitors = find(objects, "ServiceMonitor")
    if overlay == "dev":
        assert monitors == [] and find(objects, "PrometheusRule") == []
        return
    [monitor] = monitors
    selector = monitor["spec"]["selector"]["matchLabels"]
    [admin] = [s for s in find(objects, "Service") if _selects(selector, s["metadata"]["labels"])]
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [p["name"] for p in admin["spec"]["ports"]] == ["admin"]
    [rules] = find(objects, "PrometheusRule")
    alerts = {r["alert"] for g in rules["spec"]["groups"] for r in g["rules"]}
    assert alerts == {
        "FleetgateNoHealthyReplica",
        "FleetgateQueueWaitHigh",
        "FleetgateHighErrorRatio",
        "FleetgateRedisFallbackActive",
        "FleetgateQuotaNearExhaustion",
    }


def test_image_is_multi_stage_numeric_user_without_bench_results() -> None:
    image = image_command()
    assert image.stages == 2
    assert re.fullmatch(r"\d+:\d+", image.user) and not image.user.startswith("0:")
    assert "scripts/install-image.sh" in (DEPLOY / "Dockerfile").read_text()
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    ignore = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    # Everything is left out, then only the runtime's own files are let back in: never bench/.
    assert ignore[0] == "*"
    let_in = [line[1:] for line in ignore if line.startswith("!")]
    assert "gateway/**" in let_in and not any(path.startswith("bench") for path in let_in)
    assert image.argv[:2] == ["fleetgate", "serve"]


def test_no_manifest_is_left_outside_a_kustomization() -> None:
    listed: set[Path] = set()
    for kustomization in (DEPLOY / "kubernetes").rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        entries = spec.get("resources", []) + [p["path"] for p in spec.get("patches", []) if "path" in p]
        entries += [f for g in spec.get("configMapGenerator", []) for f in g.get("files", [])]
        listed |= {(kustomization.parent / e).resolve() for e in entries} | {kustomization.resolve()}
    files = {p.resolve() for p in (DEPLOY / "kubernetes").rglob("*.yaml")}
    assert files - listed == {(DEPLOY / "kubernetes/overlays/production/secret.example.yaml").resolve()}
