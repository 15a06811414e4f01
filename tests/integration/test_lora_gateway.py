"""LoRA adapters through a real in-process gateway, on simulated vLLM replicas.

Two replicas of one base model: the first serves the adapter ``sql-lora`` (and ``listed-lora``,
which no configuration names), the second none. Both allow run-time loading, as vLLM with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, and take 0.2 s per load, so concurrent requests
for an unloaded adapter overlap its load. The simulator answers a model it does not serve
with vLLM's 404, so a request sent to the wrong replica would fail, not pass unnoticed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from gateway.app import Gateway
from gateway.settings import hash_key
from replicas.replica import Replica, ReplicaState
from sim.engine import FixedRateConfig, FixedRateEngine
from sim.lora_api import LORA_KEY, LoraState
from sim.server import create_app as create_sim_app
from tests.integration.harness import API_KEY, OTHER_KEY, access_lines, in_process_gateway, serve_app

BASE = "base"
ADMIN_KEY = "sk-admin-lora"
MESSAGES = [{"role": "user", "content": "Write a query for the ten largest orders."}]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Health probes every 0.1 s (harness); adapters read on every other one at most.
HEALTH = {"interval_s": 0.1, "timeout_s": 1.0, "adapters_interval_s": 0.2}


@contextlib.asynccontextmanager
async def sim_with_adapters(modules: dict[str, str]) -> AsyncIterator[tuple[str, LoraState]]:
    engine = FixedRateEngine(FixedRateConfig(ttft_s=0.005, tokens_per_s=2000))
    lora = LoraState(enabled=True, modules=dict(modules), load_s=0.2)
    app = create_sim_app(engine, BASE, lora=lora, runtime_lora=True)
    async with serve_app(app) as url:
        assert app[LORA_KEY] is lora
        yield url, lora


def config(a: str, b: str, adapter_dir: Path, **extra: Any) -> dict[str, Any]:
    return {
        "models": [
            {
                "name": BASE,
                "replicas": [{"url": a}, {"url": b}],
                "adapters": [
                    {"name": "sql-lora"},
                    {"name": "chat-lora", "path": str(adapter_dir)},
                    {"name": "broken-lora", "path": str(adapter_dir / "missing")},
                ],
            }
        ],
        "admin_api_keys": ["sha256:" + hash_key(ADMIN_KEY)],
        "health": HEALTH,
        **extra,
    }


async def chat(http: httpx.AsyncClient, url: str, model: str, stream: bool = False) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4, "stream": stream}
    return await http.post(f"{url}/v1/chat/completions", json=body, headers=AUTH)


def replica_of(gw: Gateway, replica_id: str) -> Replica:
    replica = gw.fleet.get(replica_id)
    assert replica is not None
    return replica


async def wait_listed(gw: Gateway, replica_id: str, adapter: str) -> None:
    replica = replica_of(gw, replica_id)
    for _ in range(100):
        if adapter in replica.adapters:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{replica_id} never listed {adapter}: {sorted(replica.adapters)}")


async def test_an_adapter_is_served_only_where_it_is_loaded(tmp_path: Path) -> None:
    modules = {"sql-lora": "/adapters/sql", "listed-lora": "/adapters/listed"}
    async with sim_with_adapters(modules) as (a, _), sim_with_adapters({}) as (b, _):
        async with in_process_gateway(config(a, b, tmp_path), tmp_path) as (url, gw, access):
            await wait_listed(gw, "base-0", "sql-lora")
            async with httpx.AsyncClient(timeout=20) as http:
                for stream in (False, True):
                    replies = await asyncio.gather(*(chat(http, url, "sql-lora", stream) for _ in range(12)))
                    assert {r.status_code for r in replies} == {200}
                    assert {r.headers["x-fleetgate-replica"] for r in replies} == {"base-0"}
                    if not stream:  # the replica answered as the adapter: it was sent the adapter's name
                        assert {r.json()["model"] for r in replies} == {"sql-lora"}
                    else:
                        assert all(b'"model":"sql-lora"' in r.content for r in replies)
                # An adapter no configuration names is served where a replica lists it.
                listed = await chat(http, url, "listed-lora")
                assert listed.status_code == 200 and listed.headers["x-fleetgate-replica"] == "base-0"
                # The base model still uses both replicas.
                plain = await asyncio.gather(*(chat(http, url, BASE) for _ in range(12)))
                assert {r.headers["x-fleetgate-replica"] for r in plain} == {"base-0", "base-1"}

                # Requests are counted and logged under the adapter's name.
                value = gw.metrics.registry.get_sample_value(
                    "fleetgate_requests_total",
                    {"endpoint": "chat", "model": "sql-lora", "status": "200", "band": "interactive"},
                )
                assert value == 24
                lines = [x for x in access_lines(access) if x.get("model") == "sql-lora"]
                assert len(lines) == 24 and {x["replica"] for x in lines} == {"base-0"}

                # /admin/fleet shows what each replica serves.
                admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
                fleet = (await http.get(f"{url}/admin/fleet", headers=admin)).json()
                adapters = {r["id"]: r["adapters"] for r in fleet["replicas"]}
                assert adapters == {"base-0": ["listed-lora", "sql-lora"], "base-1": []}

                # The only replica serving it goes down: 503, not the other replica.
                replica_of(gw, "base-0").state = ReplicaState.DRAINING
                refused = await chat(http, url, "sql-lora")
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "no_healthy_replica"


async def test_an_unloaded_adapter_is_loaded_once_for_concurrent_requests(tmp_path: Path) -> None:
    async with sim_with_adapters({"sql-lora": "/adapters/sql"}) as (a, lora_a), sim_with_adapters({}) as (b, lora_b):
        async with in_process_gateway(config(a, b, tmp_path), tmp_path) as (url, gw, _):
            # base-0 is busy (as if 50 requests of this gateway were in flight there; a count
            # the scrapes leave alone): the load goes to the least loaded replica, base-1.
            replica_of(gw, "base-0").outstanding_requests = 50
            async with httpx.AsyncClient(timeout=20) as http:
                replies = await asyncio.gather(*(chat(http, url, "chat-lora", stream=i % 2 == 1) for i in range(10)))
                assert [r.status_code for r in replies] == [200] * 10, [r.text for r in replies]
                assert (lora_a.loads, lora_b.loads) == (0, 1)
                assert {r.headers["x-fleetgate-replica"] for r in replies} == {"base-1"}
                assert "chat-lora" in lora_b.modules
                # Later requests find it loaded; the next listing agrees.
                replica_of(gw, "base-0").outstanding_requests = 0
                await asyncio.sleep(0.5)
                again = await asyncio.gather(*(chat(http, url, "chat-lora") for _ in range(6)))
                assert {r.headers["x-fleetgate-replica"] for r in again} == {"base-1"}
                assert lora_b.loads == 1
                assert replica_of(gw, "base-1").adapters == {"chat-lora"}


async def test_a_failed_load_is_a_clear_error_held_briefly(tmp_path: Path) -> None:
    async with sim_with_adapters({}) as (a, lora_a), sim_with_adapters({}) as (b, lora_b):
        async with in_process_gateway(config(a, b, tmp_path), tmp_path) as (url, _, _):
            async with httpx.AsyncClient(timeout=20) as http:
                replies = await asyncio.gather(*(chat(http, url, "broken-lora") for _ in range(5)))
                assert {r.status_code for r in replies} == {404}
                error = replies[0].json()["error"]
                assert error["code"] == "adapter_not_found" and "No adapter found" in error["message"]
                assert lora_a.loads + lora_b.loads == 1
                # Within the hold, the same answer without another load.
                again = await chat(http, url, "broken-lora")
                assert again.status_code == 404 and lora_a.loads + lora_b.loads == 1
                # A configured adapter with no path that no replica lists: nothing to load it from.
                none = await chat(http, url, "sql-lora")
                assert none.status_code == 503 and none.json()["error"]["code"] == "no_healthy_replica"


async def test_a_replica_without_runtime_loading_is_a_503(tmp_path: Path) -> None:
    engine = FixedRateEngine(FixedRateConfig(ttft_s=0.005, tokens_per_s=2000))
    app = create_sim_app(engine, BASE, lora=LoraState(enabled=True), runtime_lora=False)
    async with serve_app(app) as a, serve_app(create_sim_app(engine, BASE)) as b:
        cfg = config(a, b, tmp_path)
        cfg["models"][0]["replicas"] = [{"url": a}]
        async with in_process_gateway(cfg, tmp_path) as (url, _, _), httpx.AsyncClient(timeout=20) as http:
            reply = await chat(http, url, "chat-lora")
            assert reply.status_code == 503
            error = reply.json()["error"]
            assert error["code"] == "adapter_load_failed" and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in error["message"]
            assert reply.headers["Retry-After"] == "5"


async def test_unknown_adapters_are_unknown_models_and_models_lists_adapters(tmp_path: Path) -> None:
    async with sim_with_adapters({"sql-lora": "/adapters/sql", "listed-lora": "/x"}) as (a, lora_a):
        async with (
            sim_with_adapters({}) as (b, lora_b),
            in_process_gateway(config(a, b, tmp_path), tmp_path) as (
                url,
                gw,
                _,
            ),
        ):
            await wait_listed(gw, "base-0", "listed-lora")
            async with httpx.AsyncClient(timeout=20) as http:
                unknown = await chat(http, url, "nobody-lora")
                assert unknown.status_code == 404
                assert unknown.json()["error"]["code"] == "model_not_found"
                assert lora_a.loads + lora_b.loads == 0

                # Every tenant may call every fleet model (there are no per-tenant model
                # lists), so every tenant sees the adapters, each with its base model as parent.
                for key in (API_KEY, OTHER_KEY):
                    listing = (await http.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})).json()
                    parents = {m["id"]: m.get("parent") for m in listing["data"]}
                    assert parents == {
                        "auto": None,
                        BASE: None,
                        "sql-lora": BASE,
                        "chat-lora": BASE,
                        "broken-lora": BASE,
                        "listed-lora": BASE,
                    }
                one = await http.get(f"{url}/v1/models/listed-lora", headers=AUTH)
                assert one.status_code == 200 and one.json()["parent"] == BASE
                missing = await http.get(f"{url}/v1/models/nobody-lora", headers=AUTH)
                assert missing.status_code == 404


async def test_limits_key_on_the_adapters_name(tmp_path: Path) -> None:
    tenants = [
        {
            "id": "t1",
            "api_keys": ["sha256:" + hash_key(API_KEY)],
            "limits": {"per_model": {"sql-lora": {"requests_per_minute": 2}}},
        }
    ]
    async with sim_with_adapters({"sql-lora": "/adapters/sql"}) as (a, _), sim_with_adapters({}) as (b, _):
        async with in_process_gateway(config(a, b, tmp_path, tenants=tenants), tmp_path) as (url, gw, _):
            await wait_listed(gw, "base-0", "sql-lora")
            async with httpx.AsyncClient(timeout=20) as http:
                statuses = [(await chat(http, url, "sql-lora")).status_code for _ in range(3)]
                assert statuses == [200, 200, 429]
                # The base model is another model for the limits: not limited by the adapter's.
                assert [(await chat(http, url, BASE)).status_code for _ in range(3)] == [200, 200, 200]


async def test_a_managed_simulator_takes_vllms_lora_flags(tmp_path: Path) -> None:
    adapter = tmp_path / "runtime-adapter"
    adapter.mkdir()
    replica = {
        "engine": "sim",
        "args": ["--enable-lora", "--lora-modules", f"boot-lora={tmp_path}", "--lora-load-ms", "50"],
        "env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    }
    cfg = {
        "models": [{"name": BASE, "replicas": [replica], "adapters": [{"name": "late-lora", "path": str(adapter)}]}],
        "health": HEALTH,
    }
    async with in_process_gateway(cfg, tmp_path) as (url, gw, _), httpx.AsyncClient(timeout=20) as http:
        await wait_listed(gw, "base-0", "boot-lora")
        assert (await chat(http, url, "boot-lora")).json()["model"] == "boot-lora"
        late = await chat(http, url, "late-lora")
        assert late.status_code == 200 and late.json()["model"] == "late-lora"
        await asyncio.sleep(0.5)
        replica_models = (await http.get(f"{replica_of(gw, 'base-0').base_url}/v1/models")).json()["data"]
        assert {m["id"]: m["parent"] for m in replica_models} == {BASE: None, "boot-lora": BASE, "late-lora": BASE}
