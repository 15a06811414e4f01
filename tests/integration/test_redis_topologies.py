"""Shared state on a Redis Cluster (3 masters, 3 replicas) and on a Sentinel setup (a master,
its replica, 3 sentinels), all real redis-server processes started here; the gateways are
real ``fleetgate serve`` processes.

On each topology:
- four gateways keep a tenant's requests per minute exact (the bounds and the degraded
  bound of tests/integration/test_limits_exact.py);
- the exact and the semantic cache share entries between processes, and a process that
  starts later loads them (the hashing embedder stands in for the model, as in
  tests/integration/test_semantic_cache_redis.py);
- the master holding two busy tenants' keys is killed under ~20 requests/s: the fail_open
  tenant never sees a 5xx, the fail_closed one gets 503s, and both are decided by the
  shared store again within the failover time plus the breaker's cool-down (plus an
  allowance for a loaded machine, ``RECOVERY_SLACK_S``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from gateway.settings import hash_key
from limits.config import TenantLimits
from limits.plan import Subject, build_plan
from limits.redis_store import RedisStore
from tests.integration.harness import CountingUpstream, GatewayProcess, serve_app
from tests.integration.redis_server import REDIS_BINARY
from tests.integration.redis_topology import REDIS_CLI, LocalCluster, LocalSentinel
from tests.integration.test_limits_exact import four_gateways, requests_per_minute_hold, samples
from tests.integration.test_semantic_cache_redis import SETTINGS, ask, entries, gateway_cache, remember, until

pytestmark = pytest.mark.redis

Topology = LocalCluster | LocalSentinel
MODEL = "m"
RATE_PER_S = 20
BREAKER_COOLDOWN_S = 1.0
# Time a loaded two-core machine may add between "the replica is master" and the gateways
# deciding on it again (a probe's round trip, the cluster client's topology refresh,
# requests already in flight).
RECOVERY_SLACK_S = 5.0
# Load after the failover: long enough to see both tenants back on the shared store.
AFTER_S = BREAKER_COOLDOWN_S + RECOVERY_SLACK_S + 2.0
HEARTBEATS = "fleetgate:limits:gateways"


@pytest.fixture(params=["cluster", "sentinel"])
def topology(request: pytest.FixtureRequest) -> Iterator[Topology]:
    for binary in (REDIS_BINARY, REDIS_CLI):
        if not os.access(binary, os.X_OK) and shutil.which(binary) is None:
            pytest.skip(f"no {binary}")
    setup: Topology = LocalCluster() if request.param == "cluster" else LocalSentinel()
    with setup:
        yield setup


# The caches' bounds here: generous for a loaded machine, they only cut a hang. A process's
# first command to a cluster node opens its connection, which under load can pass the
# 100 ms lookup bound the single-node tests use, and an exact hit then falls through to the
# semantic one; this test checks where entries are found, not how fast.
PATIENT = SETTINGS.model_copy(update={"lookup_timeout_ms": 2000, "store_timeout_ms": 5000})


def state_key(tenant: str) -> str:
    return f"fleetgate:limits:{{{tenant}}}:s"


async def until_heartbeats(topology: Topology, count: int) -> None:
    """Wait for ``count`` live gateways in the heartbeat set (one beat every 10 s at most)."""
    home = aioredis.Redis(port=topology.master_of(HEARTBEATS))
    try:
        deadline = time.monotonic() + 30
        while (seen := await home.zcard(HEARTBEATS)) != count:
            assert time.monotonic() < deadline, f"{seen} gateways in {HEARTBEATS}, expected {count}"
            await asyncio.sleep(0.2)
    finally:
        await home.aclose()


async def test_limits_hold_across_four_gateways(tmp_path: Path, topology: Topology) -> None:
    async with four_gateways(tmp_path, topology.url) as (phase, upstream):
        # Warm up: the gateways open their connections (a cold pool under 200 clients can
        # miss the 250 ms deadline on a loaded machine, which makes a phase degraded).
        await phase.hammer("tpm", 1.0)
        await requests_per_minute_hold(phase, upstream)
        # The heartbeats' one key (a deliberate single home) counts the four gateways.
        await until_heartbeats(topology, len(phase.urls))
    # The state lives where the topology puts the tenant's slot, not on some other node.
    owner = aioredis.Redis(port=topology.master_of(state_key("rpm")))
    try:
        assert await owner.exists(state_key("rpm")) == 1
    finally:
        await owner.aclose()


async def test_caches_share_entries_between_processes(topology: Topology) -> None:
    question = "What is the capital of France?"
    async with gateway_cache(topology.url, PATIENT) as a, gateway_cache(topology.url, PATIENT) as b:
        await remember(a, question)
        assert await ask(b, question) == "exact"
        await until(lambda: entries(b) == 1)  # followed from the change stream
        assert await ask(b, "what is the capital of france") == "semantic"
        assert await ask(b, "what is the capital of france", tenant="t2") == "miss"
    async with gateway_cache(topology.url, PATIENT) as c:  # a later process loads what is stored (SCAN)
        assert entries(c) == 1
        assert await ask(c, "WHAT is the capital of France") == "semantic"
    owner = aioredis.Redis(port=topology.master_of("{fg:s}:seq"))
    try:
        assert int(await owner.get("{fg:s}:seq") or 0) >= 1
    finally:
        await owner.aclose()


async def test_a_moved_slot_is_followed_without_a_restart() -> None:
    """A tenant's slot moves to another master (as ``redis-cli --cluster reshard`` does it):
    the same store object follows the MOVED reply and keeps admitting on the tenant's one
    bucket, with no store failure. (While the slot is half-moved, Redis answers a script
    whose keys are split between the two nodes with TRYAGAIN; docs/configuration.md.)"""
    if not os.access(REDIS_BINARY, os.X_OK):
        pytest.skip(f"no {REDIS_BINARY}")
    with LocalCluster() as cluster:
        store = RedisStore.from_url(cluster.url, timeout_s=2.0)
        limits = TenantLimits(requests_per_minute=60, request_burst=10)
        plan = build_plan(Subject("mover"), limits, 0)
        remaining: list[int] = []

        async def admit() -> None:
            outcome = await store.admit(plan, f"lease-{len(remaining)}", 60.0)
            assert outcome.allowed and outcome.requests is not None
            remaining.append(outcome.requests.remaining)

        try:
            key = store.keys("mover")[0]
            await admit()
            source = cluster.master_of(key)
            target = next(p for p in cluster.masters() if p != source)
            slot = await asyncio.to_thread(cluster.begin_moving, key, target)
            await asyncio.to_thread(cluster.finish_moving, slot, target)
            await admit()  # MOVED, then the new owner
            await admit()
            assert cluster.master_of(key) == target
        finally:
            await store.close()
        # One bucket throughout: each admission took one request from the same burst.
        assert remaining == [9, 8, 7], remaining


@dataclass(frozen=True, slots=True)
class Sent:
    tenant: str
    at: float
    status: int
    body: bytes


def neighbours(topology: Topology) -> tuple[str, str]:
    """A fail_open and a fail_closed tenant whose limit keys live on the same master."""
    if isinstance(topology, LocalSentinel):
        return "open", "closed"
    masters = topology.masters()

    def owner(tenant: str) -> int:
        slot = key_slot(state_key(tenant).encode())
        return next(port for port, ranges in masters.items() if any(a <= slot <= b for a, b in ranges))

    first = "open0"
    closed = next(f"closed{i}" for i in range(1000) if owner(f"closed{i}") == owner(first))
    return first, closed


def failover_config(upstream_url: str, tenants: tuple[str, str], redis_url: str) -> dict[str, Any]:
    open_t, closed_t = tenants
    policies = {open_t: "fail_open", closed_t: "fail_closed"}
    return {
        "redis_url": redis_url,
        "server": {"access_log": False},
        "limits": {"breaker_cooldown_s": BREAKER_COOLDOWN_S, "heartbeat_s": 1.0},
        "models": [{"name": MODEL, "replicas": [{"url": upstream_url}]}],
        "tenants": [
            {
                "id": t,
                "api_keys": ["sha256:" + hash_key(f"sk-{t}")],
                "limits": {"requests_per_minute": 100_000, "on_store_failure": policy},
            }
            for t, policy in policies.items()
        ],
    }


async def store_admissions(urls: list[str], tenant: str) -> float:
    """Admissions of ``tenant`` decided by the shared store, summed over the gateways."""
    found = await samples(urls, ("fleetgate_limits_admissions",))
    wanted = {"tenant": tenant, "store": "store"}
    return sum(s.value for s in found if s.name.endswith("_total") and s.labels == wanted)


async def fallback_active(urls: list[str]) -> list[float]:
    return [s.value for s in await samples(urls, ("fleetgate_limits_fallback_active",))]


class Load:
    """Requests at a fixed rate, alternating tenants and gateways; every answer recorded."""

    def __init__(self, urls: list[str], tenants: tuple[str, str]) -> None:
        self.urls, self.tenants = urls, tenants
        self.sent: list[Sent] = []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        tasks: set[asyncio.Task[None]] = set()
        timeout = aiohttp.ClientTimeout(total=20)

        async def one(session: aiohttp.ClientSession, n: int) -> None:
            tenant = self.tenants[n % 2]
            at = time.monotonic()
            headers = {"Authorization": f"Bearer sk-{tenant}"}
            url = self.urls[(n // 2) % len(self.urls)]
            async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                self.sent.append(Sent(tenant, at, r.status, await r.read()))

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            n = 0
            start = time.monotonic()
            while not self._stop.is_set():
                task = asyncio.create_task(one(session, n))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                n += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), max(start + n / RATE_PER_S - time.monotonic(), 0))
            await asyncio.gather(*tasks)

    def stop(self) -> None:
        self._stop.set()


async def test_a_master_failover_under_load(tmp_path: Path, topology: Topology) -> None:
    tenants = neighbours(topology)
    open_t, closed_t = tenants
    victim = topology.master_of(state_key(open_t))
    assert victim == topology.master_of(state_key(closed_t))
    upstream = CountingUpstream(MODEL)
    async with serve_app(upstream.app()) as upstream_url:
        config = failover_config(upstream_url, tenants, topology.url)
        procs: list[GatewayProcess] = []
        try:
            for i in range(2):
                (tmp_path / f"gw{i}").mkdir()
                procs.append(GatewayProcess(config, tmp_path / f"gw{i}"))
                await asyncio.to_thread(procs[-1].start)
            urls = [gw.url for gw in procs]
            load = Load(urls, tenants)
            running = asyncio.create_task(load.run())
            try:
                await asyncio.sleep(2.0)
                killed_at = time.monotonic()
                await asyncio.to_thread(topology.kill, victim)
                await asyncio.to_thread(topology.wait_promoted, victim, state_key(open_t))
                promoted_at = time.monotonic()
                before = {t: await store_admissions(urls, t) for t in tenants}
                await asyncio.sleep(AFTER_S)
            finally:
                load.stop()
                await asyncio.wait_for(running, 60)
            after = {t: await store_admissions(urls, t) for t in tenants}
            degraded = await fallback_active(urls)
        finally:
            for gw in procs:
                await asyncio.to_thread(gw.stop)

    sent = sorted(load.sent, key=lambda s: s.at)
    print(
        f"failover: {promoted_at - killed_at:.2f} s; "
        + ", ".join(f"{t}: {sorted({s.status for s in sent if s.tenant == t})}" for t in tenants)
    )
    assert len(sent) >= RATE_PER_S * (2.0 + AFTER_S) * 0.5, len(sent)  # the load really ran
    # Before the kill, everything went through.
    assert all(s.status == 200 for s in sent if s.at < killed_at)
    # fail_open: never a 5xx (no 429 either: the limit is far above the load).
    opened = [s for s in sent if s.tenant == open_t]
    assert [s.status for s in opened if s.status != 200] == []
    # fail_closed: 503 while the store is unavailable, in OpenAI's error shape.
    closed = [s for s in sent if s.tenant == closed_t]
    refused = [s for s in closed if s.status != 200]
    assert refused, "the fail_closed tenant was never refused: the failover went unnoticed"
    assert {s.status for s in refused} == {503}
    assert b'"error"' in refused[0].body
    # Back within the failover time plus the breaker's cool-down.
    recovered_by = promoted_at + BREAKER_COOLDOWN_S + RECOVERY_SLACK_S
    late = [round(s.at - promoted_at, 2) for s in refused if s.at > recovered_by]
    assert late == [], f"503s after the recovery bound (s after the promotion): {late}"
    # The shared store decides again, for both tenants, and the gateways say so.
    for t in tenants:
        assert after[t] > before[t], (t, before[t], after[t])
    assert degraded == [0.0] * len(urls), degraded
