"""Ready means servable: a client that sends the moment ``/readyz`` first says 200 is served.

``/readyz`` waits at start until the fleet's state is known (``replicas.readiness``): the
first discovery list, the first probe of every external replica, a managed replica of each
model healthy, or ``health.start_timeout_s``. Each kind of fleet is started, ``/readyz``
polled until its first 200, and 20 chat requests sent at once: all 20 must be 200. The
upstreams answer ``/health`` late on purpose (``SLOW_HEALTH_S``), so a gateway that said
ready before its first probes came back would be caught every time, not only on a slow day.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from aiohttp import web
from kubernetes_asyncio.client import ApiClient, Configuration

from gateway.app import Gateway, create_app
from gateway.settings import Settings
from replicas.kubernetes import set_api_client_factory
from replicas.launcher import free_port
from sim.engine import FixedRateConfig, FixedRateEngine
from sim.server import create_app as create_sim_app
from tests.integration.harness import API_KEY, gateway_process, serve_app, sim_upstream, tenants
from tests.integration.k8s_standin import endpoint, endpoint_slice, standin_api_server

MODEL = "m"
BURST = 20
# How late the upstreams answer /health: the first probe round takes at least this long,
# long enough that the test's first look at /readyz comes before it on a loaded machine.
SLOW_HEALTH_S = 1.0
# Generous bounds for a loaded machine: they only cut a hang, they time nothing.
READY_WAIT_S = 60.0
# How often the in-process tests look at /readyz: far more often than any probe runs.
POLL_S = 0.005
HEALTH = {"interval_s": 0.2, "timeout_s": 2.0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@contextlib.asynccontextmanager
async def slow_health_sim(model: str = MODEL) -> AsyncIterator[str]:
    """The simulator, answering ``/health`` only after ``SLOW_HEALTH_S``."""

    @web.middleware
    async def late(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Any:
        if request.path == "/health":
            await asyncio.sleep(SLOW_HEALTH_S)
        return await handler(request)

    app = create_sim_app(FixedRateEngine(FixedRateConfig(ttft_s=0.005, tokens_per_s=2000)), model)
    app.middlewares.append(late)
    async with serve_app(app) as url:
        yield url


async def burst(http: aiohttp.ClientSession, url: str) -> list[int]:
    """``BURST`` chat requests at once; their statuses."""

    async def one() -> int:
        async with http.post(f"{url}/v1/chat/completions", json=CHAT, headers=AUTH) as r:
            await r.read()
            return r.status

    return list(await asyncio.gather(*(one() for _ in range(BURST))))


async def first_ready(http: aiohttp.ClientSession, url: str) -> tuple[list[int], dict[str, Any]]:
    """Poll ``/readyz`` until its first 200: the statuses seen before, and that 200's body."""
    seen: list[int] = []
    deadline = time.monotonic() + READY_WAIT_S
    while time.monotonic() < deadline:
        async with http.get(f"{url}/readyz") as r:
            if r.status == 200:
                return seen, await r.json()
            seen.append(r.status)
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"/readyz never said 200 (saw {sorted(set(seen))})")


@contextlib.asynccontextmanager
async def started(config: dict[str, Any], tmp_path: Path) -> AsyncIterator[tuple[str, Gateway]]:
    """A gateway on this loop, served at once: no waiting for its replicas (unlike
    ``harness.in_process_gateway``), so the test sees ``/readyz`` from its first answer."""
    settings = Settings(**{"tenants": tenants(), "health": HEALTH, **config})
    gateway = Gateway(settings, log_dir=tmp_path / "logs")
    async with serve_app(create_app(gateway)) as url:
        yield url, gateway


def test_managed_simulated_replicas(tmp_path: Path) -> None:
    """``fleetgate serve`` launching two simulators: ready once one answers its probe."""
    config = {
        "models": [{"name": MODEL, "replicas": [{"engine": "sim", "count": 2}]}],
        "health": HEALTH,
    }
    # healthy=0: back at the first 200 of /readyz (polled every 0.1 s), whatever the replicas' state.
    with (
        gateway_process(config, tmp_path, healthy=0) as gw,
        httpx.Client(timeout=30, limits=httpx.Limits(max_connections=BURST)) as http,
        ThreadPoolExecutor(BURST) as threads,
    ):
        sent = [
            threads.submit(http.post, f"{gw.url}/v1/chat/completions", json=CHAT, headers=AUTH) for _ in range(BURST)
        ]
        assert [f.result().status_code for f in sent] == [200] * BURST
        assert "gateway ready" in gw.stderr_path.read_text()


async def test_url_replicas(tmp_path: Path) -> None:
    """Two simulators by URL and one URL where nothing listens: ready once all three have
    had their first probe (down is known too), and the two live ones take the burst."""
    dead = f"http://127.0.0.1:{free_port()}"
    async with slow_health_sim() as a, slow_health_sim() as b:
        replicas = [{"url": a}, {"url": b}, {"url": dead}]
        async with started({"models": [{"name": MODEL, "replicas": replicas}]}, tmp_path) as (url, gateway):
            async with aiohttp.ClientSession() as http:
                before, ready = await first_ready(http, url)
                assert before and set(before) == {503}  # the first probes took SLOW_HEALTH_S
                assert ready["healthy_replicas"] == 2
                assert [r.probed for r in gateway.fleet.all()] == [True, True, True]
                assert await burst(http, url) == [200] * BURST


async def test_kubernetes_discovery(tmp_path: Path) -> None:
    """Replicas found through the stand-in API server: ready after its first list and the
    first probe of every pod it listed."""
    config = {"models": [{"name": MODEL, "replicas": [{"kubernetes": {"service": "vllm", "namespace": "ns"}}]}]}
    async with slow_health_sim() as a, slow_health_sim() as b, standin_api_server() as (k8s, server):
        for name, upstream in (("a", a), ("b", b)):
            port = int(upstream.rsplit(":", 1)[1])
            server.apply(endpoint_slice(f"vllm-{name}", "vllm", port, [endpoint("127.0.0.1", f"pod-{name}")]))
        previous = set_api_client_factory(lambda: ApiClient(Configuration(host=k8s)))
        try:
            async with started(config, tmp_path) as (url, gateway), aiohttp.ClientSession() as http:
                before, ready = await first_ready(http, url)
                assert before and set(before) == {503}
                assert ready["healthy_replicas"] == 2
                assert sorted(r.id for r in gateway.fleet.all()) == ["vllm-pod-a", "vllm-pod-b"]
                assert await burst(http, url) == [200] * BURST
        finally:
            set_api_client_factory(previous)


async def test_a_fleet_never_known_turns_ready_after_the_start_timeout(tmp_path: Path) -> None:
    """Discovery that never lists (its API server is not there): not ready until
    ``health.start_timeout_s``, then ready, answering 503 ``no_healthy_replica``."""
    nowhere = f"http://127.0.0.1:{free_port()}"
    config = {
        "models": [{"name": MODEL, "replicas": [{"kubernetes": {"service": "vllm", "namespace": "ns"}}]}],
        "health": {**HEALTH, "start_timeout_s": 1.0},
    }
    previous = set_api_client_factory(lambda: ApiClient(Configuration(host=nowhere)))
    try:
        async with started(config, tmp_path) as (url, gateway), aiohttp.ClientSession() as http:
            began = time.monotonic()
            async with http.get(f"{url}/readyz") as r:
                assert r.status == 503
                assert "not known yet" in (await r.json())["error"]["message"]
            before, ready = await first_ready(http, url)
            assert time.monotonic() - began >= 0.5 and set(before) == {503}
            assert ready["healthy_replicas"] == 0 and not gateway.fleet.state_known
            async with http.post(f"{url}/v1/chat/completions", json=CHAT, headers=AUTH) as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "no_healthy_replica"
    finally:
        set_api_client_factory(previous)


async def test_readiness_stays_once_known_when_the_fleet_goes_down(tmp_path: Path) -> None:
    """After the start, readiness no longer follows replica health: the only replica goes
    away and the pod stays ready, answering 503 ``no_healthy_replica``."""
    async with contextlib.AsyncExitStack() as stack:
        upstream = await stack.enter_async_context(sim_upstream(MODEL))
        config = {"models": [{"name": MODEL, "replicas": [{"url": upstream}]}], "health": {**HEALTH, "timeout_s": 0.5}}
        async with started(config, tmp_path) as (url, gateway), aiohttp.ClientSession() as http:
            await first_ready(http, url)
            await stack.aclose()  # the replica goes away
            async with asyncio.timeout(READY_WAIT_S):
                while gateway.fleet.healthy_count():  # noqa: ASYNC110 (set by the health loop)
                    await asyncio.sleep(0.05)
            async with http.get(f"{url}/readyz") as r:
                assert r.status == 200 and (await r.json())["healthy_replicas"] == 0
            async with http.post(f"{url}/v1/chat/completions", json=CHAT, headers=AUTH) as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "no_healthy_replica"
