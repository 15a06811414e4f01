"""What the fleet felt during a load point: KV-cache use, queues, preemptions, prefix-cache hits.

The client sees latencies; only the replicas know why. This module samples vLLM's own
gauges while a point runs, from one of two sources (a small ``FleetSource`` protocol):

* ``MetricsSource``: the Prometheus ``/metrics`` of each replica (vLLM, or the simulator);
* ``AdminFleetSource``: fleetgate's ``GET /admin/fleet`` (needs an admin key), which carries
  the gauges the gateway scraped from every replica it routes to.

``FleetWindow`` is the pure part: timestamped samples in, a summary over a time window out
(counters as deltas, gauges as peak and mean). ``FleetProbe`` is the edge: an async context
manager that samples a source on an interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

import aiohttp

from replicas.health import parse_vllm_metrics

log = logging.getLogger("fleetgate.bench")

Gauges = dict[str, float]
KV_USAGE = "vllm:kv_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
PREEMPTIONS = "vllm:num_preemptions_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
FLEET_METRICS = (
    "kv_peak",
    "kv_mean",
    "waiting_peak",
    "waiting_mean",
    "running_peak",
    "preemptions",
    "prefix_hit_rate",
)
# Fast enough to catch a KV peak within a point, slow enough that scraping costs little.
DEFAULT_INTERVAL_S = 0.25
SCRAPE_TIMEOUT_S = 2.0


class FleetSource(Protocol):
    """Where the replicas' gauges come from: one dict of vLLM metric values per replica."""

    async def read(self, session: aiohttp.ClientSession) -> list[Gauges]: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class MetricsSource:
    """The ``/metrics`` endpoints of the replicas (base URLs or full ``.../metrics`` URLs)."""

    urls: tuple[str, ...]

    async def read(self, session: aiohttp.ClientSession) -> list[Gauges]:
        async def one(url: str) -> Gauges:
            full = url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"
            async with session.get(full, timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as resp:
                resp.raise_for_status()
                return parse_vllm_metrics(await resp.text())

        return list(await asyncio.gather(*(one(u) for u in self.urls)))

    def describe(self) -> str:
        return "/metrics of " + ", ".join(self.urls)


@dataclass(frozen=True)
class AdminFleetSource:
    """fleetgate's admin API: every replica's last scraped gauges, in one call."""

    base_url: str
    admin_key: str

    async def read(self, session: aiohttp.ClientSession) -> list[Gauges]:
        url = self.base_url.rstrip("/") + "/admin/fleet"
        headers = {"Authorization": f"Bearer {self.admin_key}"}
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as resp:
            resp.raise_for_status()
            body = await resp.json()
        return [{k: float(v) for k, v in r.get("gauges", {}).items()} for r in body.get("replicas", [])]

    def describe(self) -> str:
        return f"{self.base_url}/admin/fleet"


@dataclass
class FleetWindow:
    """Timestamped fleet samples; summaries over any time window."""

    samples: list[tuple[float, list[Gauges]]] = field(default_factory=list)
    errors: int = 0

    def add(self, now: float, replicas: list[Gauges]) -> None:
        self.samples.append((now, replicas))

    def summary(self, start: float, end: float) -> dict[str, float | None]:
        """Gauges over ``[start, end]``; counters as the change from just before ``start`` to just after ``end``.

        KV use is the fullest replica's (a fleet fails where one replica fills up), queues are
        summed over replicas. A counter that went down (a replica restarted) counts from zero.
        """
        inside = [reps for t, reps in self.samples if start <= t <= end]
        before = [reps for t, reps in self.samples if t <= start]
        after = [reps for t, reps in self.samples if t >= end]
        first = before[-1] if before else (inside[0] if inside else None)
        last = after[0] if after else (inside[-1] if inside else None)
        span = ([first] if first is not None else []) + inside + ([last] if last is not None else [])
        if not span:
            return dict.fromkeys(FLEET_METRICS)
        kv = [max((r.get(KV_USAGE, 0.0) for r in reps), default=0.0) for reps in span]
        kv_mean = [sum(r.get(KV_USAGE, 0.0) for r in reps) / len(reps) for reps in span if reps]
        waiting = [sum(r.get(WAITING, 0.0) for r in reps) for reps in span]
        running = [sum(r.get(RUNNING, 0.0) for r in reps) for reps in span]
        queries = _delta(first, last, PREFIX_QUERIES)
        hits = _delta(first, last, PREFIX_HITS)
        return {
            "kv_peak": max(kv),
            "kv_mean": sum(kv_mean) / len(kv_mean) if kv_mean else None,
            "waiting_peak": max(waiting),
            "waiting_mean": sum(waiting) / len(waiting),
            "running_peak": max(running),
            "preemptions": _delta(first, last, PREEMPTIONS),
            "prefix_hit_rate": hits / queries if queries and hits is not None else None,
        }


def _delta(first: list[Gauges] | None, last: list[Gauges] | None, name: str) -> float | None:
    if first is None or last is None or not any(name in r for r in last):
        return None
    start = sum(r.get(name, 0.0) for r in first)
    end = sum(r.get(name, 0.0) for r in last)
    return end - start if end >= start else end


class FleetProbe:
    """Samples a ``FleetSource`` every ``interval_s`` while open; ``window`` holds the samples."""

    def __init__(
        self,
        source: FleetSource,
        session: aiohttp.ClientSession,
        *,
        clock: Callable[[], float],
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        self.source = source
        self.window = FleetWindow()
        self._session = session
        self._clock = clock
        self._interval = interval_s
        self._task: asyncio.Task[None] | None = None

    async def sample(self) -> None:
        """One reading now; a failed scrape is counted, not raised (the point still counts)."""
        try:
            replicas = await self.source.read(self._session)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.window.errors += 1
            log.debug("fleet scrape failed: %s", exc)
            return
        self.window.add(self._clock(), replicas)

    async def _loop(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self._interval)

    async def __aenter__(self) -> FleetProbe:
        if self._task is not None:
            raise RuntimeError("FleetProbe is already running")
        self._task = asyncio.create_task(self._loop(), name="fleet-probe")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.sample()  # the closing reading: counters after the last request ended
