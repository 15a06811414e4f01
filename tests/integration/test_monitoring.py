"""What monitoring reads: every metric the dashboard and the alerts query exists in a
running gateway's /metrics, and /metrics and /admin/* live where the config puts them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.settings import hash_key
from replicas.launcher import free_port
from tests.integration.harness import API_KEY, gateway_process
from tests.integration.manifests import DEPLOY, promql_metrics

MODEL = "m"
ADMIN_KEY = "sk-monitoring-admin"
# Series names a family of each type exposes, whether or not it has samples yet.
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",), "summary": ("",)}


def queried_metrics() -> dict[str, set[str]]:
    """Metric names by where they are queried: each dashboard panel, each alert."""
    queried: dict[str, set[str]] = {}
    dashboard = json.loads((DEPLOY / "grafana" / "fleetgate.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            queried.setdefault(f"panel {panel['title']!r}", set()).update(promql_metrics(target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            queried[f"variable {var['name']}"] = promql_metrics(var["definition"])
    rules = yaml.safe_load((DEPLOY / "kubernetes" / "base" / "prometheusrule.yaml").read_text())
    for group in rules["spec"]["groups"]:
        for rule in group["rules"]:
            queried[f"alert {rule['alert']}"] = promql_metrics(rule["expr"])
    scaled = yaml.safe_load_all((DEPLOY / "kubernetes/overlays/production/vllm-llama-3-1-8b.yaml").read_text())
    for obj in scaled:
        if obj["kind"] == "ScaledObject":
            queried["ScaledObject"] = promql_metrics(obj["spec"]["triggers"][0]["metadata"]["query"])
    return queried


def exposed(text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


def config(admin_port: int, **server: Any) -> dict[str, Any]:
    return {
        "models": [{"name": MODEL, "replicas": [{"engine": "sim", "sim": {"ttft_ms": 5, "tokens_per_s": 500}}]}],
        "server": {"admin_port": admin_port, **server},
        "admin_api_keys": ["sha256:" + hash_key(ADMIN_KEY)],
    }


def traffic(url: str) -> None:
    """A streamed, a repeated (cache hit) and a refused request: the series they create."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    for _ in range(2):
        assert httpx.post(f"{url}/v1/chat/completions", json={**body, "temperature": 0}, headers=headers).is_success
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, headers=headers) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
    assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 401


def test_every_metric_the_dashboard_and_alerts_query_exists(tmp_path: Path) -> None:
    queried = queried_metrics()
    assert len(queried) >= 20 and all(queried.values()), queried
    admin_port = free_port()
    with gateway_process(config(admin_port), tmp_path) as gw:
        traffic(gw.url)
        text = httpx.get(f"http://127.0.0.1:{admin_port}/metrics").text
    available = exposed(text)
    missing = {where: sorted(names - available) for where, names in queried.items() if names - available}
    assert missing == {}
    # The check itself can fail: a name the gateway does not export is caught.
    assert "fleetgate_no_such_metric_total" not in available


def test_metrics_and_admin_live_on_the_admin_port_behind_a_key(tmp_path: Path) -> None:
    admin_port = free_port()
    with gateway_process(config(admin_port, metrics_require_key=True), tmp_path) as gw:
        admin = f"http://127.0.0.1:{admin_port}"
        auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
        # The API port: no /metrics, no /admin/* (OpenAI-shaped 404s).
        for path in ("/metrics", "/admin/fleet"):
            r = httpx.get(f"{gw.url}{path}", headers=auth)
            assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url", path
        # The admin port: /metrics needs the admin key; a tenant key is not one.
        assert httpx.get(f"{admin}/metrics").status_code == 401
        assert httpx.get(f"{admin}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 401
        r = httpx.get(f"{admin}/metrics", headers=auth)
        assert r.status_code == 200 and "fleetgate_pending_tokens" in r.text
        assert httpx.get(f"{admin}/admin/fleet", headers=auth).json()["healthy"] == 1
        assert httpx.get(f"{admin}/readyz").status_code == 200
        # ... and serves no API.
        assert httpx.post(f"{admin}/v1/chat/completions", json={}).status_code in (404, 405)


async def test_no_healthy_replica_keeps_the_pod_ready_and_answers_503(tmp_path: Path) -> None:
    """Once the fleet's state is known, readiness is "this process can answer": a fleet with no
    live replica must not take the gateway out of its Service, or clients get connection
    errors instead of a 503."""
    from aiohttp import ClientSession

    from gateway.app import Gateway, create_app
    from gateway.settings import Settings
    from tests.integration.harness import serve_app, tenants

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    settings = Settings(
        models=[{"name": MODEL, "replicas": [{"url": dead}]}],
        tenants=tenants(),
        health={"interval_s": 0.1, "timeout_s": 0.5},
    )
    gateway = Gateway(settings, log_dir=tmp_path / "logs")
    async with serve_app(create_app(gateway)) as url, ClientSession() as http:
        # Ready once its first probe has come back (refused): known down is known.
        async with asyncio.timeout(30):
            while not gateway.ready:  # noqa: ASYNC110 (set by the gateway's start-up task)
                await asyncio.sleep(0.01)
        async with http.get(f"{url}/readyz") as r:
            assert r.status == 200 and (await r.json())["healthy_replicas"] == 0
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        auth = {"Authorization": f"Bearer {API_KEY}"}
        async with http.post(f"{url}/v1/chat/completions", json=body, headers=auth) as r:
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "no_healthy_replica"
        async with http.get(f"{url}/metrics") as r:
            assert f'fleetgate_model_healthy_replicas{{model="{MODEL}"}} 0.0' in await r.text()
        gateway.draining = True  # what SIGTERM sets: now, and only now, not ready
        async with http.get(f"{url}/readyz") as r:
            assert r.status == 503 and (await r.json())["error"]["type"]


def _gauge(text: str, name: str) -> float:
    [value] = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    return float(value)


async def test_pending_tokens_count_requests_in_flight_and_return_to_zero(tmp_path: Path) -> None:
    """A stream of max_tokens 40 is pending while it runs (prompt estimate + 40 tokens, against a
    target of 30: 2 replicas desired), and nothing is left pending once it has ended."""
    from aiohttp import ClientSession

    from tests.integration.harness import in_process_gateway, sim_upstream

    async with sim_upstream(MODEL, tokens_per_s=20) as upstream:
        config = {
            "models": [{"name": MODEL, "replicas": [{"url": upstream}]}],
            "autoscaling": {"target_pending_tokens": 30},
        }
        async with in_process_gateway(config, tmp_path) as (url, _, _), ClientSession() as http:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True}
            auth = {"Authorization": f"Bearer {API_KEY}"}
            async with http.post(f"{url}/v1/chat/completions", json=body, headers=auth) as r:
                await r.content.readline()  # streaming now
                async with http.get(f"{url}/metrics") as m:
                    during = await m.text()
                await r.read()
            async with http.get(f"{url}/metrics") as m:
                after = await m.text()
    pending = _gauge(during, "fleetgate_pending_tokens")
    assert 40 < pending < 40 + 30  # max_tokens plus a short prompt's estimate
    assert _gauge(during, "fleetgate_desired_replicas") == 2  # ceil(pending / 30)
    assert _gauge(after, "fleetgate_pending_tokens") == 0
    assert _gauge(after, "fleetgate_desired_replicas") == 1
