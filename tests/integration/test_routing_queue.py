"""The fair queue in front of a pool, through a real in-process gateway.

One ``CountingUpstream`` replica that takes ``delay`` seconds per request, with
``capacity.max_requests: 1``: the second concurrent request already waits in the
gateway's queue, which makes order and waits observable.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from tests.integration.harness import (
    API_KEY,
    OTHER_KEY,
    CountingUpstream,
    access_lines,
    in_process_gateway,
    queued,
    serve_app,
    tenants,
    until,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def one_slot(url: str, queue: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "models": [{"name": "m", "replicas": [{"url": url}], "capacity": {"max_requests": 1}}],
        "routing": {"queue": queue or {}},
        **extra,
    }


async def post(client: httpx.AsyncClient, url: str, key: str = API_KEY, **headers: str) -> httpx.Response:
    return await client.post(
        f"{url}/v1/chat/completions",
        json={"model": "m", "messages": MESSAGES, "max_tokens": 100},
        headers={"Authorization": f"Bearer {key}", **headers},
    )


async def test_flooding_tenant_does_not_starve_another(tmp_path: Path) -> None:
    upstream = CountingUpstream("m", delay=0.5)
    # Quantum below one request's cost (100 max_tokens + prompt): one request per visit.
    async with serve_app(upstream.app()) as up:
        async with in_process_gateway(one_slot(up, {"quantum_tokens": 64}), tmp_path) as (url, gw, access):
            loop = asyncio.get_running_loop()
            done: list[tuple[str, float]] = []

            async def send(key: str, name: str) -> None:
                reply = await post(client, url, key)
                assert reply.status_code == 200
                done.append((name, loop.time()))

            async with httpx.AsyncClient(timeout=30) as client:
                flood = [asyncio.create_task(send(API_KEY, f"flood{i}")) for i in range(8)]
                await until(lambda: queued(gw, "m") == 7)
                started = loop.time()
                await send(OTHER_KEY, "quiet")
                quiet_wait = loop.time() - started
                await asyncio.gather(*flood)
            order = [name for name, _ in done]
            # FIFO would put the quiet tenant behind all 8; WDRR serves it after at most 2.
            assert order.index("quiet") <= 2, order
            lines = access_lines(access)
            quiet_queued = next(line["queued_ms"] for line in lines if line["tenant"] == "t2")
            flood_queued = [line["queued_ms"] for line in lines if line["tenant"] == "t1" and "queued_ms" in line]
            # It waited about two requests' time, the flood's last one about seven.
            assert quiet_queued < max(flood_queued) / 2
            assert quiet_wait * 1000 >= quiet_queued
            depth = gw.metrics.registry.get_sample_value(
                "fleetgate_queue_depth", {"model": "m", "band": "interactive", "tenant": "t1"}
            )
            assert depth == 0
            assert (
                gw.metrics.registry.get_sample_value(
                    "fleetgate_queue_wait_seconds_count", {"model": "m", "band": "interactive", "tenant": "t1"}
                )
                == 7
            )


async def test_full_queue_is_429_with_retry_after(tmp_path: Path) -> None:
    upstream = CountingUpstream("m", delay=1.5)
    async with serve_app(upstream.app()) as up:
        async with in_process_gateway(one_slot(up, {"max_queue_length": 2}), tmp_path) as (url, gw, _):
            async with httpx.AsyncClient(timeout=30) as client:
                waiting = [asyncio.create_task(post(client, url)) for _ in range(3)]
                await until(lambda: queued(gw, "m") == 2)
                metrics = (await client.get(f"{url}/metrics")).text
                refused = await post(client, url)
                assert refused.status_code == 429
                assert refused.headers["Retry-After"] == "1"
                error = refused.json()["error"]
                assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
                # another tenant's queue is its own
                other = await post(client, url, OTHER_KEY)
                assert other.status_code == 200
                assert [r.status_code for r in await asyncio.gather(*waiting)] == [200] * 3
            assert 'fleetgate_queue_depth{band="interactive",model="m",tenant="t1"} 2.0' in metrics
            assert (
                gw.metrics.registry.get_sample_value(
                    "fleetgate_shed_total",
                    {"model": "m", "band": "interactive", "tenant": "t1", "reason": "queue_full"},
                )
                == 1
            )


async def test_waiting_too_long_is_503_by_priority(tmp_path: Path) -> None:
    upstream = CountingUpstream("m", delay=3.0)
    ts = tenants()
    ts[0]["priority"] = "low"
    async with serve_app(upstream.app()) as up:
        cfg = one_slot(up, {"max_wait_s": {"low": 0.3}}, tenants=ts)
        async with in_process_gateway(cfg, tmp_path) as (url, gw, access):
            loop = asyncio.get_running_loop()
            async with httpx.AsyncClient(timeout=30) as client:
                busy = asyncio.create_task(post(client, url, OTHER_KEY))
                await until(lambda: upstream.in_flight == 1)
                for key, headers in ((API_KEY, {}), (OTHER_KEY, {"x-fleetgate-priority": "low"})):
                    started = loop.time()
                    refused = await post(client, url, key, **headers)
                    assert refused.status_code == 503
                    assert 0.25 < loop.time() - started < 2.5
                    assert refused.headers["Retry-After"] == "1"
                    assert refused.json()["error"]["code"] == "queue_timeout"
                assert (await busy).status_code == 200
            assert access_lines(access)[-2]["queued_ms"] >= 250
            assert queued(gw, "m") == 0 and upstream.requests == 1


async def test_deadline_while_queued_is_504(tmp_path: Path) -> None:
    upstream = CountingUpstream("m", delay=2.0)
    async with serve_app(upstream.app()) as up:
        async with in_process_gateway(one_slot(up), tmp_path) as (url, gw, _):
            async with httpx.AsyncClient(timeout=30) as client:
                busy = asyncio.create_task(post(client, url))
                await until(lambda: upstream.in_flight == 1)
                refused = await post(client, url, OTHER_KEY, **{"x-fleetgate-timeout-ms": "200"})
                assert refused.status_code == 504
                assert refused.json()["error"]["code"] == "deadline_exceeded"
                assert (await busy).status_code == 200
            assert (
                gw.metrics.registry.get_sample_value(
                    "fleetgate_shed_total", {"model": "m", "band": "interactive", "tenant": "t2", "reason": "deadline"}
                )
                == 1
            )


async def test_client_leaving_while_queued_frees_its_slot(tmp_path: Path) -> None:
    upstream = CountingUpstream("m", delay=1.5)
    async with serve_app(upstream.app()) as up:
        async with in_process_gateway(one_slot(up), tmp_path) as (url, gw, access):
            async with httpx.AsyncClient(timeout=30) as client, httpx.AsyncClient(timeout=30) as leaving:
                first = asyncio.create_task(post(client, url))
                await until(lambda: upstream.in_flight == 1)
                gone = asyncio.create_task(post(leaving, url))
                await until(lambda: queued(gw, "m") == 1)
                gone.cancel()
                await leaving.aclose()  # the connection closes: the gateway cancels the handler
                await until(lambda: queued(gw, "m") == 0)
                later = await post(client, url, OTHER_KEY)
                assert later.status_code == 200
                assert (await first).status_code == 200
            admission = gw.router.pools["m"].admission
            assert admission.queued == 0 and admission.waking == 0
            assert upstream.requests == 2  # the one that left never reached the replica
            assert any(line["status"] == 499 for line in access_lines(access))
            # and the pool is open again: the next request takes the fast path
            assert admission.ready(gw.clock())


async def test_degraded_tenant_gets_max_tokens_clamped_under_pressure(tmp_path: Path) -> None:
    upstream = CountingUpstream("m", delay=1.5)
    ts = tenants()
    ts[0]["degrade"] = {"max_tokens": 5}
    async with serve_app(upstream.app()) as up:
        async with in_process_gateway(one_slot(up, tenants=ts), tmp_path) as (url, _, access):
            async with httpx.AsyncClient(timeout=30) as client:
                alone = await post(client, url)  # the pool has room: untouched
                assert alone.json()["usage"]["completion_tokens"] == 100
                busy = asyncio.create_task(post(client, url, OTHER_KEY))
                await until(lambda: upstream.in_flight == 1)
                squeezed = await post(client, url)  # every replica busy: clamped, then queued
                assert squeezed.status_code == 200
                assert squeezed.json()["usage"]["completion_tokens"] == 5
                assert (await busy).json()["usage"]["completion_tokens"] == 100
            line = next(line for line in access_lines(access) if line.get("degraded"))
            assert line["degraded"] == "max_tokens" and line["queued_ms"] > 0
