"""Active health checks: probe ``/health`` and scrape ``/metrics`` of every replica.

A replica is healthy when both answer; ``failures_to_down`` consecutive failed probes take
it out of rotation and one good probe brings it back. What vLLM reports about its own
load (running and waiting requests, KV-cache use, prefix-cache hits, preemptions) is kept
on the replica, since other gateway processes send it work this one cannot see.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import aiohttp

from replicas.replica import GAUGE_KV_USAGE, GAUGE_RUNNING, GAUGE_WAITING, Replica, ReplicaState

log = logging.getLogger("fleetgate.health")

# vLLM metric names kept from each scrape (current vLLM; `gpu_cache_usage_perc` is gone).
SCRAPED = frozenset(
    {
        GAUGE_RUNNING,
        GAUGE_WAITING,
        GAUGE_KV_USAGE,
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    }
)


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """Sum each kept metric over its label sets (one series per engine/model)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        space = line.rfind(" ")
        name = line[: brace if brace != -1 else line.find(" ")]
        if name not in SCRAPED or space == -1:
            continue
        try:
            value = float(line[space + 1 :])
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out


class HealthChecker:
    """Probes replicas on an interval; a probe either fully answers or counts as a failure."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        interval_s: float,
        timeout_s: float,
        failures_to_down: int,
    ) -> None:
        self._session = session
        self._interval = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._failures_to_down = failures_to_down

    async def probe(self, replica: Replica) -> bool:
        """One probe; updates the replica's state and gauges. True when it answered."""
        try:
            async with self._session.get(f"{replica.base_url}/health", timeout=self._timeout) as resp:
                ok = resp.status == 200
                await resp.read()
            if ok:
                async with self._session.get(f"{replica.base_url}/metrics", timeout=self._timeout) as resp:
                    ok = resp.status == 200
                    text = await resp.text()
                if ok:
                    replica.observe(parse_vllm_metrics(text))
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            ok = False
        self._apply(replica, ok)
        return ok

    def _apply(self, replica: Replica, ok: bool) -> None:
        if replica.state in (ReplicaState.FAILED, ReplicaState.DRAINING):
            # Draining stays draining until an operator (or shutdown) says otherwise.
            if not ok:
                replica.consecutive_probe_failures += 1
            return
        if ok:
            replica.consecutive_probe_failures = 0
            if replica.state is not ReplicaState.HEALTHY:
                log.info("replica healthy", extra={"replica": replica.id})
                replica.state = ReplicaState.HEALTHY
            return
        replica.consecutive_probe_failures += 1
        replica.probe_failures += 1
        if replica.state is ReplicaState.HEALTHY and replica.consecutive_probe_failures >= self._failures_to_down:
            log.warning("replica down: probes failing", extra={"replica": replica.id})
            replica.state = ReplicaState.DOWN

    async def run(self, replicas: Callable[[], Iterable[Replica]]) -> None:
        """Probe all replicas (the current set, each round) concurrently, until cancelled."""
        while True:
            await asyncio.gather(*(self.probe(r) for r in replicas()))
            await asyncio.sleep(self._interval)
