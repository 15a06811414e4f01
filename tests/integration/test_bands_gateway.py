"""Priority bands through a real in-process gateway in front of the simulator.

One simulated replica (``sim.server``, a fixed-rate engine: 50 tokens at 250 tokens/s,
about 0.2 s a request) with ``capacity.max_requests: 1``: the second concurrent request
already waits in the gateway's queue, so the order in which a saturated pool serves the
bands is the order in which requests finish. The replica is configured for vLLM's priority
scheduler, so the simulator's ``/sim/priorities`` shows the ``priority`` each band sent.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from gateway.settings import hash_key
from tests.integration.harness import access_lines, in_process_gateway, queued, sim_upstream, until

MODEL = "m"
CHAT_KEY = "sk-band-chat"
BULK_KEY = "sk-band-bulk"


def config(url: str, bands: list[Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "models": [
            {
                "name": MODEL,
                "replicas": [{"url": url, "scheduling_policy": "priority"}],
                "capacity": {"max_requests": 1},
            }
        ],
        "tenants": [
            {"id": "chat", "api_keys": ["sha256:" + hash_key(CHAT_KEY)]},
            {"id": "bulk", "api_keys": ["sha256:" + hash_key(BULK_KEY)], "band": "batch"},
        ],
        # A quantum below one request's cost (50 max_tokens + prompt): one request per visit.
        "routing": {"queue": {"quantum_tokens": 32}},
        **({"bands": bands} if bands is not None else {}),
        **extra,
    }


async def post(client: httpx.AsyncClient, url: str, key: str, band: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    if band is not None:
        headers["x-fleetgate-band"] = band
    return await client.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50},
        headers=headers,
    )


async def test_interactive_requests_overtake_queued_batch_band_requests(tmp_path: Path) -> None:
    async with sim_upstream(MODEL, ttft_ms=5, tokens_per_s=250) as up:
        async with in_process_gateway(config(up), tmp_path) as (url, gw, access):
            finished: list[str] = []

            async def send(key: str, name: str, band: str | None = None) -> httpx.Response:
                reply = await post(client, url, key, band)
                finished.append(name)
                return reply

            async with httpx.AsyncClient(timeout=30) as client:
                # The bulk tenant's band is batch; the chat tenant lowers one request of its own
                # to batch with the header, as the Batch API's runner does.
                tasks = [asyncio.create_task(send(BULK_KEY, "batch0"))]
                await until(lambda: gw.router.pools[MODEL].replicas[0].outstanding_requests == 1)
                tasks += [asyncio.create_task(send(BULK_KEY, f"batch{i}")) for i in range(1, 4)]
                tasks.append(asyncio.create_task(send(CHAT_KEY, "chat-as-batch", "batch")))
                await until(lambda: queued(gw, MODEL) == 4)
                tasks += [asyncio.create_task(send(CHAT_KEY, f"chat{i}")) for i in range(2)]
                await until(lambda: queued(gw, MODEL) == 6)
                replies = await asyncio.gather(*tasks)
                priorities = (await client.get(f"{up}/sim/priorities")).json()
                metrics = (await client.get(f"{url}/metrics")).text
            assert [r.status_code for r in replies] == [200] * 7
            # The one in flight finishes first; then both interactive requests, though they
            # arrived after every queued batch-band one; then the batch band, fairly by tenant.
            assert finished[:3] == ["batch0", "chat0", "chat1"], finished
            assert set(finished[3:]) == {"batch1", "batch2", "batch3", "chat-as-batch"}
            assert finished[3:5] == ["batch1", "chat-as-batch"], finished
            assert [r.headers["x-fleetgate-band"] for r in replies] == ["batch"] * 5 + ["interactive"] * 2
            # The band reached the replica as vLLM's priority: 2 for batch; the interactive
            # band is priority 0, vLLM's default, sent as no field at all.
            assert priorities == {"0": 2, "2": 5}
            lines = access_lines(access)
            assert sorted(line["band"] for line in lines) == ["batch"] * 5 + ["interactive"] * 2
            chat_lines = [line for line in lines if line["tenant"] == "chat" and line["band"] == "interactive"]
            assert all("queued_ms" in line for line in chat_lines)
            registry = gw.metrics.registry
            requests = {"endpoint": "chat", "model": MODEL, "status": "200"}
            assert registry.get_sample_value("fleetgate_requests_total", {**requests, "band": "batch"}) == 5
            assert registry.get_sample_value("fleetgate_requests_total", {**requests, "band": "interactive"}) == 2
            wait = {"model": MODEL, "band": "interactive", "tenant": "chat"}
            assert registry.get_sample_value("fleetgate_queue_wait_seconds_count", wait) == 2
            assert 'fleetgate_queue_depth{band="batch",model="m",tenant="bulk"} 0.0' in metrics


async def test_a_higher_band_asked_is_clamped_and_an_unknown_one_refused(tmp_path: Path) -> None:
    async with sim_upstream(MODEL) as up:
        async with in_process_gateway(config(up), tmp_path) as (url, _gw, access):
            async with httpx.AsyncClient(timeout=30) as client:
                clamped = await post(client, url, BULK_KEY, "interactive")
                assert clamped.status_code == 200
                assert clamped.headers["x-fleetgate-band"] == "batch"
                lowered = await post(client, url, CHAT_KEY, "standard")
                assert lowered.status_code == 200 and lowered.headers["x-fleetgate-band"] == "standard"
                unknown = await post(client, url, CHAT_KEY, "urgent")
                priorities = (await client.get(f"{up}/sim/priorities")).json()
            assert unknown.status_code == 400
            error = unknown.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "invalid_band"
            assert error["param"] == "x-fleetgate-band"
            assert "interactive, standard, batch" in error["message"]
            # The clamped request was sent in its tenant's band; the refused one never left.
            assert priorities == {"1": 1, "2": 1}
            assert [line.get("band") for line in access_lines(access)] == ["batch", "standard", None]


async def test_a_lower_bands_backlog_bound_sheds_it_with_429_first(tmp_path: Path) -> None:
    bands = ["interactive", {"name": "batch", "max_queued": 2}]
    async with sim_upstream(MODEL, ttft_ms=5, tokens_per_s=250) as up:
        async with in_process_gateway(config(up, bands), tmp_path) as (url, gw, _access):
            async with httpx.AsyncClient(timeout=30) as client:
                busy = asyncio.create_task(post(client, url, BULK_KEY))
                await until(lambda: gw.router.pools[MODEL].replicas[0].outstanding_requests == 1)
                waiting = [asyncio.create_task(post(client, url, BULK_KEY)) for _ in range(2)]
                await until(lambda: queued(gw, MODEL) == 2)
                shed = await post(client, url, CHAT_KEY, "batch")
                assert shed.status_code == 429
                assert shed.json()["error"]["code"] == "band_full"
                assert int(shed.headers["Retry-After"]) >= 1
                # The interactive band is not bounded by the batch band's backlog.
                chat = await post(client, url, CHAT_KEY)
                assert chat.status_code == 200
                assert [r.status_code for r in await asyncio.gather(busy, *waiting)] == [200] * 3
            shed_labels = {"model": MODEL, "band": "batch", "tenant": "chat", "reason": "band_full"}
            assert gw.metrics.registry.get_sample_value("fleetgate_shed_total", shed_labels) == 1
