"""Fallback chains, the retry budget and per-request deadlines, through a real in-process gateway.

Failing replicas are ``FaultyUpstream`` (a real vLLM cannot fail on cue); healthy ones the
simulator. Breakers are set never to open, so the failing replicas stay in rotation and
what stops the retries is the budget or the deadline under test.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from replicas.replica import ReplicaState
from tests.integration.harness import (
    API_KEY,
    FaultyUpstream,
    access_lines,
    in_process_gateway,
    serve_app,
    sim_upstream,
)

MESSAGES = [{"role": "user", "content": "hi"}]
HEALTH = {"interval_s": 0.1, "breaker_failures": 1000}


async def post(url: str, model: str, stream: bool = False, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=20) as client:
        return await client.post(
            f"{url}/v1/chat/completions",
            json={"model": model, "messages": MESSAGES, "max_tokens": 3, "stream": stream},
            headers={"Authorization": f"Bearer {API_KEY}", **headers},
        )


def with_fallback(big_urls: list[str], small_url: str, **extra: Any) -> dict[str, Any]:
    return {
        "models": [
            {"name": "big", "tier": "large", "replicas": [{"url": u} for u in big_urls], "fallback": ["small"]},
            {"name": "small", "tier": "small", "replicas": [{"url": small_url}]},
        ],
        "health": HEALTH,
        **extra,
    }


async def test_fallback_model_answers_when_every_replica_of_the_pool_fails(tmp_path: Path) -> None:
    bad = FaultyUpstream("big", "500")
    async with serve_app(bad.app()) as bad_url, sim_upstream("small") as small:
        async with in_process_gateway(with_fallback([bad_url], small), tmp_path) as (url, gw, access):
            reply = await post(url, "big")
            assert reply.status_code == 200 and reply.json()["model"] == "small"
            assert reply.headers["x-fleetgate-tier"] == "small"
            assert reply.headers["x-fleetgate-replica"] == "small-0"
            assert bad.hits == 1
            line = access_lines(access)[-1]
            assert line["fallback"] == "small" and line["attempts"] == 2
            metrics = gw.metrics.registry.get_sample_value(
                "fleetgate_routing_fallbacks_total", {"model": "big", "fallback": "small"}
            )
            assert metrics == 1


async def test_fallback_first_when_the_pool_is_not_routable(tmp_path: Path) -> None:
    bad = FaultyUpstream("big", "500")
    async with serve_app(bad.app()) as bad_url, sim_upstream("small") as small:
        cfg = with_fallback([bad_url], small)
        async with in_process_gateway(cfg, tmp_path) as (url, gw, access):
            # Draining (the health loop leaves that state alone): never routed to.
            gw.fleet.by_model["big"][0].state = ReplicaState.DRAINING
            reply = await post(url, "big", stream=True)
            assert reply.status_code == 200 and b"data: [DONE]" in reply.content
            assert bad.hits == 0
            assert access_lines(access)[-1]["attempts"] == 1


async def test_retry_budget_stops_a_storm(tmp_path: Path) -> None:
    a, b = FaultyUpstream("m", "500"), FaultyUpstream("m", "500")
    async with serve_app(a.app()) as ua, serve_app(b.app()) as ub:
        cfg = {
            "models": [{"name": "m", "replicas": [{"url": ua}, {"url": ub}]}],
            "health": HEALTH,
            "routing": {"retry_budget": {"ratio": 0.0, "min_per_s": 0.0, "burst": 2}},
        }
        async with in_process_gateway(cfg, tmp_path) as (url, gw, access):
            statuses = [(await post(url, "m")).status_code for _ in range(6)]
            assert statuses == [502] * 6
            # 6 first attempts + the budget's 2 retries; without the budget: 12.
            assert a.hits + b.hits == 8
            assert access_lines(access)[-1]["retry_budget"] == "exhausted"
            assert gw.metrics.registry.get_sample_value("fleetgate_retries_total", {"model": "m"}) == 2
            assert gw.metrics.registry.get_sample_value("fleetgate_retry_budget_exhausted_total", {"model": "m"}) == 4


async def test_deadline_header_cuts_the_attempt_and_stops_retries(tmp_path: Path) -> None:
    a, b = FaultyUpstream("m", "stall_first", delay=5.0), FaultyUpstream("m", "stall_first", delay=5.0)
    async with serve_app(a.app()) as ua, serve_app(b.app()) as ub:
        cfg = {"models": [{"name": "m", "replicas": [{"url": ua}, {"url": ub}]}], "health": HEALTH}
        async with in_process_gateway(cfg, tmp_path) as (url, gw, access):
            loop = asyncio.get_running_loop()
            for stream in (False, True):
                started = loop.time()
                reply = await post(url, "m", stream=stream, **{"x-fleetgate-timeout-ms": "300"})
                assert loop.time() - started < 2.0
                assert reply.status_code == 504
                assert reply.json()["error"]["code"] == "deadline_exceeded"
            assert a.hits + b.hits == 2  # one attempt each time: no retry past the deadline
            # the client's deadline is no fault of the replicas: breakers untouched
            assert all(r.breaker.failures == 0 for r in gw.fleet.by_model["m"])
            assert access_lines(access)[-1]["error"] == "deadline_exceeded"


async def test_bad_deadline_header_is_400(tmp_path: Path) -> None:
    async with sim_upstream("m") as u:
        async with in_process_gateway({"models": [{"name": "m", "replicas": [{"url": u}]}]}, tmp_path) as (url, _, _):
            reply = await post(url, "m", **{"x-fleetgate-timeout-ms": "soon"})
            assert reply.status_code == 400
            assert reply.json()["error"]["type"] == "invalid_request_error"
