"""Kubernetes discovery against a stand-in API server (no cluster can run here).

No Kubernetes cluster can run on this machine, so ``k8s_standin`` plays the API server:
the same list and watch requests, the same JSON, the same 410 Gone. First the watcher on
its own (list, readiness changes, deleted slices, 410, dropped connections, errors), then
a real in-process gateway whose replicas are simulator upstreams found through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio.client import ApiClient, Configuration

from gateway.settings import KubernetesSource, hash_key
from replicas.kubernetes import POD_NAMESPACE_FILE, WatchTiming, set_api_client_factory, watch_endpoint_slices
from tests.integration.harness import API_KEY, in_process_gateway, sim_upstream
from tests.integration.k8s_standin import StandInApiServer, endpoint, endpoint_slice, standin_api_server

SOURCE = KubernetesSource(service="vllm", namespace="ns")
# Quick retries so a test waits milliseconds, not the production half-second and up.
FAST = WatchTiming(backoff_initial_s=0.02, backoff_max_s=0.1, watch_timeout_s=30)
WAIT_S = 10.0


def client_for(url: str) -> Callable[[], ApiClient]:
    return lambda: ApiClient(Configuration(host=url))


class Changes:
    """Every desired set the watcher handed over, and a way to wait for one."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        self._changed = asyncio.Event()

    def __call__(self, desired: dict[str, str]) -> None:
        self.seen.append(desired)
        self._changed.set()

    async def until(self, expected: dict[str, str]) -> None:
        async with asyncio.timeout(WAIT_S):
            while not self.seen or self.seen[-1] != expected:
                self._changed.clear()
                await self._changed.wait()


@contextlib.asynccontextmanager
async def watching(
    url: str | None, timing: WatchTiming = FAST, source: KubernetesSource = SOURCE
) -> AsyncIterator[Changes]:
    """The watcher as a task; ``url`` None: the default in-cluster client."""
    changes = Changes()
    factory = client_for(url) if url is not None else None
    task = asyncio.create_task(
        watch_endpoint_slices(source, changes, api_client_factory=factory, timing=timing, rng=random.Random(1))
    )
    try:
        yield changes
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def eventually(check: Callable[[], object], what: str) -> None:
    """Poll ``check`` until true: the stand-in's requests and the log have nothing to await."""
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.01)


async def until_watched(server: StandInApiServer, count: int = 1) -> None:
    """Until the ``count``-th watch is open on the stand-in (a list is handed over before it)."""
    await eventually(lambda: server.open_watches and len(watches(server)) >= count, f"watch #{count} open")


def lists(server: StandInApiServer) -> list[dict[str, str]]:
    return [q for q in server.requests if "watch" not in q]


def watches(server: StandInApiServer) -> list[dict[str, str]]:
    return [q for q in server.requests if "watch" in q]


def two_pods(a_ready: bool = True, b_ready: bool = False) -> dict[str, Any]:
    return endpoint_slice(
        "vllm-x1", "vllm", 8000, [endpoint("10.0.0.1", "a", ready=a_ready), endpoint("10.0.0.2", "b", ready=b_ready)]
    )


A = {"vllm-a": "http://10.0.0.1:8000"}
B = {"vllm-b": "http://10.0.0.2:8000"}


async def test_initial_list_then_watch_from_its_version() -> None:
    async with standin_api_server() as (url, server):
        server.apply(two_pods())
        server.apply(endpoint_slice("other-x1", "other", 9000, [endpoint("10.0.9.9", "z")]))
        version = server.apply(endpoint_slice("vllm-x2", "vllm", 8000, [], namespace="elsewhere"))
        async with watching(url) as changes:
            await changes.until(A)
            assert changes.seen == [A]  # one hand-over for the whole list, not one per slice
            await until_watched(server)
            first, second = server.requests[:2]
            assert first["labelSelector"] == "kubernetes.io/service-name=vllm" and "watch" not in first
            assert second["resourceVersion"] == str(version)
            assert second["timeoutSeconds"] == "30" and second["allowWatchBookmarks"] == "True"


async def test_readiness_changes_add_and_remove_pods() -> None:
    async with standin_api_server() as (url, server):
        server.apply(two_pods(a_ready=True, b_ready=False))
        async with watching(url) as changes:
            await changes.until(A)
            await until_watched(server)
            server.apply(two_pods(a_ready=True, b_ready=True))  # b finished loading its model
            await changes.until({**A, **B})
            server.apply(two_pods(a_ready=False, b_ready=True))  # a failed its readiness probe
            await changes.until(B)
            terminating = two_pods(a_ready=True, b_ready=True)
            terminating["endpoints"][1]["conditions"]["terminating"] = True  # b is being deleted
            server.apply(terminating)
            await changes.until(A)
            assert len(lists(server)) == 1  # all of it through the one watch


async def test_deleted_slice_takes_its_endpoints_along() -> None:
    async with standin_api_server() as (url, server):
        server.apply(two_pods())
        server.apply(endpoint_slice("vllm-x2", "vllm", 8000, [endpoint("10.0.0.3", "c"), endpoint("10.0.0.1", "a")]))
        async with watching(url) as changes:
            await changes.until({**A, "vllm-c": "http://10.0.0.3:8000"})
            server.delete("vllm-x2")
            await changes.until(A)
            server.delete("vllm-x1")
            await changes.until({})


@pytest.mark.parametrize("how", ["error_event", "http_status"])
async def test_410_gone_lists_again(how: str) -> None:
    async with standin_api_server(gone_as_status=how == "http_status") as (url, server):
        server.apply(two_pods())
        async with watching(url) as changes:
            await changes.until(A)
            await until_watched(server)
            if how == "error_event":
                server.gone()  # the open watch is told its version is too old
            else:
                server.gone(notify=False)
                server.expire_watches()  # the 410 comes as the status of the next watch
            server.apply(two_pods(b_ready=True))
            await changes.until({**A, **B})
            assert len(lists(server)) == 2


async def test_dropped_connection_resumes_from_the_last_version() -> None:
    async with standin_api_server() as (url, server):
        last = server.apply(two_pods())
        async with watching(url) as changes:
            await changes.until(A)
            await until_watched(server)
            server.drop_watches()
            server.apply(two_pods(b_ready=True))  # happens while the watcher is away
            await changes.until({**A, **B})
            assert len(lists(server)) == 1  # the change came from the resumed watch
            assert watches(server)[-1]["resourceVersion"] == str(last)


async def test_watch_expiry_watches_again_without_listing() -> None:
    async with standin_api_server() as (url, server):
        version = server.apply(two_pods())
        async with watching(url) as changes:
            await changes.until(A)
            await until_watched(server)
            for n in (2, 3, 4):  # each watch ends as its timeoutSeconds would; the next resumes
                server.expire_watches()
                await until_watched(server, n)
            server.apply(two_pods(a_ready=False, b_ready=True))
            await changes.until(B)
            assert len(lists(server)) == 1
            assert {w["resourceVersion"] for w in watches(server)} == {str(version)}


def retries(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "fleetgate.kubernetes" and "retrying" in r.getMessage()]


async def test_server_errors_and_refused_connections_are_retried(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "fleetgate.kubernetes")
    async with standin_api_server() as (url, server):
        server.apply(two_pods())
        server.fail_next(3)
        async with watching(url) as changes:
            await changes.until(A)
        assert len(lists(server)) == 4
        assert len(retries(caplog)) == 3
    # Nothing listens any more: connection refused, again and again, and no crash.
    caplog.clear()
    async with watching(url) as changes:
        await eventually(lambda: len(retries(caplog)) >= 3, "three retries")
        assert changes.seen == []
        assert "Connect" in retries(caplog)[0].__dict__["error"]


async def test_silent_watch_is_cut_by_the_client_read_timeout(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "fleetgate.kubernetes")
    timing = WatchTiming(backoff_initial_s=0.02, backoff_max_s=0.1, watch_timeout_s=1, read_grace_s=0.2)
    async with standin_api_server() as (url, server):
        server.stall_watches = True  # a half-open connection: the server's timeoutSeconds never fires
        server.apply(two_pods())
        async with watching(url, timing) as changes:
            await changes.until(A)
            await until_watched(server, 2)  # the first watch was given up after 1 + 0.2 s
            assert "Timeout" in retries(caplog)[0].__dict__["error"]
            server.apply(two_pods(b_ready=True))
            await changes.until({**A, **B})
            assert len(lists(server)) == 1


@pytest.mark.skipif(
    POD_NAMESPACE_FILE.exists() or "KUBERNETES_SERVICE_HOST" in os.environ, reason="running inside a pod"
)
async def test_outside_a_cluster_it_logs_and_keeps_trying(caplog: pytest.LogCaptureFixture) -> None:
    # No service-account mount and no KUBERNETES_SERVICE_HOST here: no namespace, no credentials.
    caplog.set_level(logging.ERROR, "fleetgate.kubernetes")
    for source in (KubernetesSource(service="vllm"), SOURCE):
        caplog.clear()
        async with watching(None, source=source) as changes:
            await eventually(lambda: len(retries(caplog)) >= 2, "two retries")
            assert changes.seen == []
        assert all("in-cluster credentials" in r.getMessage() for r in retries(caplog))


# -- end to end: a gateway whose replicas come from discovery -----------------------------

ADMIN_KEY = "sk-admin-test"
MODEL = "m"


def sim_slice(name: str, upstream: str, pod: str, *, ready: bool = True) -> dict[str, Any]:
    """A slice pointing at a simulator upstream: 127.0.0.1 and the upstream's own port."""
    return endpoint_slice(name, "vllm", int(upstream.rsplit(":", 1)[1]), [endpoint("127.0.0.1", pod, ready=ready)])


async def fleet_states(http: aiohttp.ClientSession, url: str) -> dict[str, str]:
    async with http.get(f"{url}/admin/fleet", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
        return {x["id"]: x["state"] for x in (await r.json())["replicas"]}


async def until_fleet(http: aiohttp.ClientSession, url: str, expected: dict[str, str]) -> None:
    """Until /admin/fleet lists exactly ``expected`` (replica id -> state)."""
    deadline = time.monotonic() + WAIT_S
    while (states := await fleet_states(http, url)) != expected:
        assert time.monotonic() < deadline, f"fleet is {states}, expected {expected}"
        await asyncio.sleep(0.05)


async def served_by(http: aiohttp.ClientSession, url: str, n: int) -> set[str]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    used = set()
    for _ in range(n):
        async with http.post(
            f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as r:
            assert r.status == 200
            used.add(r.headers["x-fleetgate-replica"])
    return used


async def test_gateway_routes_to_discovered_replicas(tmp_path: Path) -> None:
    config = {
        "models": [{"name": MODEL, "replicas": [{"kubernetes": {"service": "vllm", "namespace": "ns"}}]}],
        "admin_api_keys": ["sha256:" + hash_key(ADMIN_KEY)],
    }
    async with (
        sim_upstream(MODEL) as a,
        sim_upstream(MODEL) as b,
        sim_upstream(MODEL) as c,
        standin_api_server() as (k8s, server),
    ):
        server.apply(sim_slice("vllm-a", a, "pod-a"))
        server.apply(sim_slice("vllm-b", b, "pod-b"))
        # The Fleet starts discovery with (source, on_change) only: point it at the stand-in.
        previous = set_api_client_factory(client_for(k8s))
        try:
            async with in_process_gateway(config, tmp_path) as (url, _, _), aiohttp.ClientSession() as http:
                await until_fleet(http, url, {"vllm-pod-a": "healthy", "vllm-pod-b": "healthy"})
                assert await served_by(http, url, 20) == {"vllm-pod-a", "vllm-pod-b"}

                server.apply(sim_slice("vllm-b", b, "pod-b", ready=False))  # pod b fails readiness
                await until_fleet(http, url, {"vllm-pod-a": "healthy"})
                assert await served_by(http, url, 10) == {"vllm-pod-a"}

                server.apply(sim_slice("vllm-c", c, "pod-c"))  # a new pod comes up
                await until_fleet(http, url, {"vllm-pod-a": "healthy", "vllm-pod-c": "healthy"})
                assert await served_by(http, url, 20) == {"vllm-pod-a", "vllm-pod-c"}

                server.delete("vllm-a")  # its slice goes away
                await until_fleet(http, url, {"vllm-pod-c": "healthy"})
                assert await served_by(http, url, 5) == {"vllm-pod-c"}
        finally:
            set_api_client_factory(previous)
