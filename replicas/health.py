"""Active health checks: probe each replica the way its source says, and scrape ``/metrics``.

A replica is healthy when its probe answers (``/health``, or ``/v1/models`` for upstreams
without it: set so, or found so when ``/health`` answers 404, ``fallback_probe``);
``failures_to_down`` consecutive failed probes take it out of rotation and one good probe
brings it back; each replica keeps its last probe's result, which says why it is down. A
probe that times out while the replica is visibly streaming to this gateway is not counted
(``counts_against``). ``/metrics`` is optional; what vLLM reports there about its own load
(running and waiting requests, KV-cache use, prefix-cache hits, preemptions) is kept on the
replica, since other gateway processes send it work this one cannot see.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterable
from enum import StrEnum

import aiohttp
import orjson

from replicas.lora import served_adapters
from replicas.replica import (
    GAUGE_KV_CAPACITY_TOKENS,
    GAUGE_KV_USAGE,
    GAUGE_RUNNING,
    GAUGE_WAITING,
    PROBE_PATHS,
    ProbeKind,
    ProbeResult,
    Replica,
    ReplicaState,
)

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


# An info series: its labels carry the cache's shape (``num_gpu_blocks`` is "None" until the
# engine has profiled its memory).
CACHE_CONFIG_INFO = "vllm:cache_config_info"
_CACHE_LABELS = re.compile(r'[{,](num_gpu_blocks|block_size)="(\d+)"')


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """Sum each kept metric over its label sets (one series per engine/model).

    ``vllm:cache_config_info`` becomes ``GAUGE_KV_CAPACITY_TOKENS``: the engines' KV caches
    in tokens, where the routing's prefix index expects eviction to start.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        space = line.rfind(" ")
        name = line[: brace if brace != -1 else line.find(" ")]
        if name == CACHE_CONFIG_INFO:
            shape = dict(_CACHE_LABELS.findall(line))
            if len(shape) == 2:
                tokens = float(int(shape["num_gpu_blocks"]) * int(shape["block_size"]))
                out[GAUGE_KV_CAPACITY_TOKENS] = out.get(GAUGE_KV_CAPACITY_TOKENS, 0.0) + tokens
            continue
        if name not in SCRAPED or space == -1:
            continue
        try:
            value = float(line[space + 1 :])
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out


# How late past its deadline a probe's timeout may be seen and still count: later than
# this, the gateway's own event loop was held up (a CPU-starved pod, a long callback), and
# an answer may be sitting unread in the socket. No verdict then; the next probe decides.
LATE_S = 0.5


class Probe(StrEnum):
    """How one probe went."""

    OK = "ok"
    # No answer within the timeout: a dead replica, or one too busy to answer in time.
    TIMEOUT = "timeout"
    # Timed out, but seen more than ``LATE_S`` after the deadline: the gateway was held up.
    LATE = "late"
    # Refused, reset, or answered with an error status: the replica said no.
    FAILED = "failed"


# "Not Found": the server answers, but has no such path.
NOT_FOUND = 404


def outcome_of(result: ProbeResult) -> Probe:
    """The health verdict of one probe: only a 200 is an answer that the replica is up."""
    if result.status is not None:
        return Probe.OK if result.status == 200 else Probe.FAILED
    if result.error == "late":
        return Probe.LATE
    return Probe.TIMEOUT if result.error == "timeout" else Probe.FAILED


def fallback_probe(replica: Replica, result: ProbeResult) -> ProbeKind | None:
    """The probe to use instead, when ``/health`` is not there: ``models``, else None.

    Many OpenAI-compatible servers have no ``/health`` (hosted APIs, keyed proxies, older
    llama.cpp builds) and answer it 404; they do answer ``GET /v1/models``. Only a 404 says
    the path is missing: a timeout, a refusal or a 5xx says nothing about it. A managed
    replica is vLLM or the simulator, which have ``/health``: a 404 there is no reason to
    look elsewhere.
    """
    if replica.probe == "health" and not replica.managed and result.status == NOT_FOUND:
        return "models"
    return None


def counts_against(replica: Replica, outcome: Probe, now: float, progress_window_s: float) -> bool:
    """Whether a failed probe counts towards taking the replica down.

    A timeout seen late (``Probe.LATE``) is never held against a replica: the gateway, not
    the replica, was slow. Any other timeout is held against it only when the passive
    signal agrees: a replica with requests of ours in flight that sent bytes on them within
    ``progress_window_s`` is alive, however slowly its health endpoint answers (vLLM's API
    server answers ``/health`` late while its engine is busy streaming). An explicit
    refusal always counts.
    The same pairing of active and passive checks as Envoy's outlier detection:
    https://www.envoyproxy.io/docs/envoy/latest/intro/arch_overview/upstream/outlier
    """
    if outcome in (Probe.OK, Probe.LATE):
        return False
    if outcome is Probe.FAILED:
        return True
    last = replica.last_progress_at
    working = replica.outstanding_requests > 0 and last is not None and now - last <= progress_window_s
    return not working


# Enough of a connection error's text to say what failed (its address and errno).
_ERROR_CHARS = 200


def _describe(exc: aiohttp.ClientError) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}"[:_ERROR_CHARS] if text else type(exc).__name__


class HealthChecker:
    """Probes replicas on an interval, each the way its source says (``Replica.probe``).

    The probe (``/health``, or ``/v1/models`` for upstreams without one) decides health;
    ``/metrics`` is optional and only feeds the load gauges. Replicas probed ``none`` are
    left to the passive breaker. ``on_down`` is told of each replica the probes take down
    (the proxy moves the requests waiting on it).
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        interval_s: float,
        timeout_s: float,
        failures_to_down: int,
        progress_window_s: float = 10.0,
        adapters_interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_down: Callable[[Replica], None] | None = None,
    ) -> None:
        self._session = session
        self._on_down = on_down
        self._interval = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        # A timeout seen after this long is late (``Probe.LATE``).
        self._late_after_s = timeout_s + LATE_S
        self._failures_to_down = failures_to_down
        self._progress_window = progress_window_s
        self._clock = clock
        self._adapters_interval = adapters_interval_s

    async def probe(self, replica: Replica) -> bool:
        """One probe; updates the replica's state and gauges. True when it answered."""
        path = PROBE_PATHS.get(replica.probe)
        if path is None:
            return True
        result = await self._get(replica, path)
        fallback = fallback_probe(replica, result)
        if fallback is not None:
            replica.probe = fallback  # for good: logged once per replica
            log.warning(
                "replica has no /health (404): probing it with GET /v1/models instead",
                extra={"replica": replica.id, "url": replica.base_url, "probe": fallback},
            )
            result = await self._get(replica, PROBE_PATHS[fallback])
        outcome = outcome_of(result)
        if outcome is Probe.OK and replica.scrape_metrics:
            await self._scrape(replica)
        if outcome is Probe.OK and self._adapters_due(replica, self._clock()):
            await self._list_adapters(replica)
        replica.last_probe = result
        self._apply(replica, outcome, self._clock())
        return outcome is Probe.OK

    async def _get(self, replica: Replica, path: str) -> ProbeResult:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with self._session.get(
                replica.base_url + path, headers=replica.upstream_headers, timeout=self._timeout
            ) as resp:
                await resp.read()
                return ProbeResult(path, resp.status)
        except TimeoutError:
            return ProbeResult(path, None, "late" if loop.time() - started > self._late_after_s else "timeout")
        except aiohttp.ClientError as exc:
            return ProbeResult(path, None, _describe(exc))

    async def _scrape(self, replica: Replica) -> None:
        """Take the replica's gauges; an upstream without /metrics reports none."""
        try:
            async with self._session.get(
                f"{replica.base_url}/metrics", headers=replica.upstream_headers, timeout=self._timeout
            ) as resp:
                if resp.status != 200:
                    await resp.read()
                    replica.observe({})
                    return
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            return  # keep the last gauges: a slow scrape is no news about the load
        replica.observe(parse_vllm_metrics(text))

    def _adapters_due(self, replica: Replica, now: float) -> bool:
        """Whether this probe reads the replica's adapters: every ``adapters_interval_s``,
        and on every passing probe of a replica out of rotation, so that one (re)started
        with other adapters rejoins with its current list, not the one before."""
        interval = self._adapters_interval
        if interval is None:
            return False
        listed = replica.adapters_listed_at
        return listed is None or replica.state is not ReplicaState.HEALTHY or now - listed >= interval

    async def _list_adapters(self, replica: Replica) -> None:
        """Read the LoRA adapters the replica serves from its ``/v1/models``.

        A failed or slow listing keeps the last list (no news about the adapters). An
        adapter added to the replica while the listing was on its way (the gateway loaded
        it, ``gateway.lora``) is kept even if the listing, older, does not show it.
        """
        before = replica.adapters
        try:
            async with self._session.get(
                f"{replica.base_url}/v1/models", headers=replica.upstream_headers, timeout=self._timeout
            ) as resp:
                data = await resp.read()
                if resp.status != 200:
                    return
            listed = served_adapters(orjson.loads(data))
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
            return
        replica.adapters_listed_at = self._clock()
        adapters = listed | (replica.adapters - before)
        if adapters != replica.adapters:
            log.info(
                "replica's adapters changed",
                extra={
                    "replica": replica.id,
                    "added": sorted(adapters - replica.adapters),
                    "removed": sorted(replica.adapters - adapters),
                },
            )
            replica.adapters = adapters

    def _apply(self, replica: Replica, outcome: Probe, now: float) -> None:
        ok = outcome is Probe.OK
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
        if outcome is Probe.LATE or (
            replica.state is ReplicaState.HEALTHY and not counts_against(replica, outcome, now, self._progress_window)
        ):
            replica.excused_probe_timeouts += 1
            return
        replica.consecutive_probe_failures += 1
        replica.probe_failures += 1
        if replica.state is ReplicaState.HEALTHY and replica.consecutive_probe_failures >= self._failures_to_down:
            log.warning("replica down: probes failing", extra={"replica": replica.id, "probe": outcome.value})
            replica.state = ReplicaState.DOWN
            if self._on_down is not None:
                self._on_down(replica)

    async def run(self, replicas: Callable[[], Iterable[Replica]]) -> None:
        """Probe all replicas (the current set, each round) concurrently, until cancelled;
        after each round, note the stall episodes that began or ended (``watch_stalls``)."""
        while True:
            await asyncio.gather(*(self.probe(r) for r in replicas() if r.probe != "none"))
            watch_stalls(replicas(), self._clock())
            await asyncio.sleep(self._interval)


def watch_stalls(replicas: Iterable[Replica], now: float) -> None:
    """Log each stall episode as it begins and ends (``Replica.track_stall`` counts them):
    what an operator reads beside ``fleetgate_replica_stalled`` to see how long a replica's
    engine went silent while it held streams."""
    for replica in replicas:
        since = replica.stalled_since
        change = replica.track_stall(now)
        if change == "began":
            log.warning(
                "replica stalled: its streams receive nothing",
                extra={"replica": replica.id, "streams": replica.streams, "waiting": replica.gauges.get(GAUGE_WAITING)},
            )
        elif change == "ended":
            assert since is not None
            log.info(
                "replica no longer stalled",
                extra={"replica": replica.id, "stalled_s": round(now - since + replica.stall_after_s, 1)},
            )
