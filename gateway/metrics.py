"""The gateway's Prometheus metrics, all prefixed ``fleetgate_``, with bounded label sets.

Labels take values from configuration only (model names, tenant ids, replica ids, endpoint
kinds, status codes), never from request content, so their cardinality is bounded by the
config. Each app owns its registry so several gateways can live in one process (tests);
the other packages' metrics live on it too (``common.metrics``).
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from common.metrics import MetricSet

if TYPE_CHECKING:
    from gateway.settings import TenantSettings
    from replicas.replica import Replica

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LocalHistogram(Collector):
    """A histogram without locks, for the request path (one event-loop thread).

    ``prometheus_client.Histogram.observe`` takes a lock per bucket and walks the bounds in
    Python; this one bisects and adds. Inter-token gaps go further: a stream relays up to
    thousands of events a second, so it buckets its gaps locally (``Gaps``) and merges once
    when it ends.
    """

    def __init__(self, name: str, doc: str, bounds: Sequence[float], labels: Sequence[str]) -> None:
        self._name, self._doc, self._bounds, self._labels = name, doc, tuple(bounds), tuple(labels)
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, label_values: tuple[str, ...], value: float) -> None:
        series = self._series.get(label_values)
        if series is None:
            series = self._series[label_values] = ([0] * (len(self._bounds) + 1), [0.0])
        series[0][bisect_left(self._bounds, value)] += 1
        series[1][0] += value

    def new_gaps(self) -> Gaps:
        return Gaps(self._bounds)

    def merge(self, label_values: tuple[str, ...], gaps: Gaps) -> None:
        if not gaps.count:
            return
        counts, total = self._series.setdefault(label_values, ([0] * (len(self._bounds) + 1), [0.0]))
        for i, n in enumerate(gaps.counts):
            counts[i] += n
        total[0] += gaps.total

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labels)
        for values, (counts, total) in self._series.items():
            running, buckets = 0, []
            for bound, n in zip((*self._bounds, float("inf")), counts, strict=True):
                running += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
            family.add_metric(list(values), buckets, total[0])
        yield family

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self._name, self._doc, labels=self._labels)


class Gaps:
    """One stream's inter-token gaps, bucketed locally (no locks, no allocation per gap)."""

    __slots__ = ("_bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.total = 0.0

    def add(self, gap: float, n: int = 1) -> None:
        """Record ``n`` gaps of ``gap`` seconds each."""
        self.counts[bisect_left(self._bounds, gap)] += n
        self.count += n
        self.total += gap * n


class GatewayMetrics(MetricSet):
    """Every metric the gateway core exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.requests = Counter(
            "fleetgate_requests",
            "Requests answered, by endpoint, model, HTTP status and priority band ('-': refused before it had one).",
            ["endpoint", "model", "status", "band"],
            registry=r,
        )
        self.latency = LocalHistogram(
            "fleetgate_request_duration_seconds",
            "Time from request to last byte sent.",
            LATENCY_BUCKETS,
            ["endpoint", "model"],
        )
        self.ttft = LocalHistogram(
            "fleetgate_time_to_first_token_seconds",
            "Time from request to the first token event sent.",
            LATENCY_BUCKETS,
            ["model"],
        )
        self.itl = LocalHistogram(
            "fleetgate_inter_token_latency_seconds",
            "Gap between token events relayed to the client.",
            ITL_BUCKETS,
            ["model"],
        )
        self.tokens = Counter(
            "fleetgate_tokens",
            "Tokens by direction (prompt/completion), as reported by replicas.",
            ["tenant", "model", "direction"],
            registry=r,
        )
        # A plain count the request path bumps without a lock; read at scrape time.
        self.requests_in_flight = 0
        # Every request ever started: a request shorter than the idle check's interval still
        # counts as activity (common/idle_trim.py).
        self.requests_started = 0
        self.in_flight = Gauge("fleetgate_requests_in_flight", "Requests being served now.", registry=r)
        self.in_flight.set_function(lambda: self.requests_in_flight)
        self.overhead = LocalHistogram(
            "fleetgate_overhead_seconds",
            "Gateway's own time per request: total minus time waiting on the upstream.",
            OVERHEAD_BUCKETS,
            ["endpoint"],
        )
        self.loop_lag = LocalHistogram(
            "fleetgate_event_loop_lag_seconds",
            "How late the event loop ran a 0.1 s timer: time in which no request moved.",
            LOOP_LAG_BUCKETS,
            [],
        )
        for histogram in (self.latency, self.ttft, self.itl, self.overhead, self.loop_lag):
            r.register(histogram)
        self.upstream_errors = Counter(
            "fleetgate_upstream_errors",
            "Failed upstream attempts by replica and kind.",
            ["replica", "kind"],
            registry=r,
        )
        self.retries = Counter("fleetgate_retries", "Attempts retried on another replica.", ["model"], registry=r)
        self.stream_errors = Counter(
            "fleetgate_stream_errors",
            "Streams ended with an error event after the first byte.",
            ["model"],
            registry=r,
        )
        self.stream_cuts = Counter(
            "fleetgate_stream_cuts",
            "Streams under way that ended before their replica finished them, by why: chunk_gap, "
            "replica_down, stall_timeout, deadline, upstream_closed, malformed, cancelled, client_gone.",
            ["model", "reason"],
            registry=r,
        )
        self.continuations = Counter(
            "fleetgate_stream_continuations",
            "Streams whose replica failed or drained after the first byte, or that gave way to a higher band's "
            "work, finished on another replica (one count per continuation), by why the first one stopped: "
            "chunk_gap, replica_down, stall_timeout, upstream_closed, drain, preempted.",
            ["model", "reason"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "fleetgate_client_disconnects",
            "Requests whose client left before the end.",
            ["model"],
            registry=r,
        )
        self.responses_store = Counter(
            "fleetgate_responses_store",
            "Stored-response operations (get/put/delete) by outcome (ok, not_found, unavailable, too_large...).",
            ["op", "outcome"],
            registry=r,
        )
        self.config_reloads = Counter(
            "fleetgate_config_reloads",
            "Configuration reloads by result (ok/error).",
            ["result"],
            registry=r,
        )


LOOP_LAG_INTERVAL_S = 0.1


async def watch_loop_lag(histogram: LocalHistogram, clock: Callable[[], float]) -> None:
    """Sleep ``LOOP_LAG_INTERVAL_S`` again and again; how much later than asked each wake-up
    came is the loop's lag (a callback hogging it, or a starved CPU). Runs until cancelled."""
    while True:
        asked = clock() + LOOP_LAG_INTERVAL_S
        await asyncio.sleep(LOOP_LAG_INTERVAL_S)
        histogram.observe((), max(0.0, clock() - asked))


class FleetCollector(Collector):
    """Per-replica state, read from the fleet at scrape time (never stale, no bookkeeping)."""

    def __init__(
        self,
        replicas: Callable[[], Sequence[Replica]],
        clock: Callable[[], float],
        models: Callable[[], Mapping[str, Sequence[Replica]]] | None = None,
    ) -> None:
        self._replicas = replicas
        self._clock = clock
        self._models = models

    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        healthy = GaugeMetricFamily(
            "fleetgate_replica_healthy", "1 when the replica is routable.", labels=["replica", "model"]
        )
        state = GaugeMetricFamily(
            "fleetgate_replica_state", "1 for the replica's current state.", labels=["replica", "state"]
        )
        tokens = GaugeMetricFamily(
            "fleetgate_replica_outstanding_tokens", "Tokens each replica owes this gateway.", labels=["replica"]
        )
        requests = GaugeMetricFamily(
            "fleetgate_replica_outstanding_requests", "Requests in flight on each replica.", labels=["replica"]
        )
        breaker = GaugeMetricFamily(
            "fleetgate_replica_breaker_open",
            "1 while the replica's circuit breaker keeps requests away (open, or its one trial in flight).",
            labels=["replica"],
        )
        restarts = CounterMetricFamily("fleetgate_replica_restarts", "Managed replica restarts.", labels=["replica"])
        probes = CounterMetricFamily(
            "fleetgate_replica_probe_failures", "Failed /health or /metrics probes.", labels=["replica"]
        )
        vllm = GaugeMetricFamily(
            "fleetgate_replica_vllm", "Last value scraped from the replica's /metrics.", labels=["replica", "metric"]
        )
        stalled = GaugeMetricFamily(
            "fleetgate_replica_stalled",
            "1 while the replica holds streams of this gateway none of which received a byte for health.stall_after_s.",
            labels=["replica"],
        )
        stalls = CounterMetricFamily(
            "fleetgate_replica_stall_episodes", "Stall episodes seen begin, per replica.", labels=["replica"]
        )
        last_probe = GaugeMetricFamily(
            "fleetgate_replica_last_probe",
            "1 for how the replica's last probe went (why it is down): ok, http_401, http_403, http_404, "
            "http_4xx, http_5xx, http_other, timeout, late or error.",
            labels=["replica", "reason"],
        )
        for r in self._replicas():
            healthy.add_metric([r.id, r.model], 1.0 if r.routable(now) else 0.0)
            state.add_metric([r.id, r.state.value], 1.0)
            tokens.add_metric([r.id], r.outstanding_tokens)
            requests.add_metric([r.id], r.outstanding_requests)
            breaker.add_metric([r.id], 0.0 if r.breaker.ready(now) else 1.0)
            restarts.add_metric([r.id], r.restarts)
            probes.add_metric([r.id], r.probe_failures)
            stalled.add_metric([r.id], 1.0 if r.stalled(now) else 0.0)
            stalls.add_metric([r.id], r.stall_episodes)
            for name, value in r.gauges.items():
                vllm.add_metric([r.id, name.removeprefix("vllm:")], value)
            if r.last_probe is not None:
                last_probe.add_metric([r.id, r.last_probe.reason], 1.0)
        yield from (healthy, state, tokens, requests, breaker, restarts, probes, vllm, last_probe, stalled, stalls)
        if self._models is not None:
            # Per model, zero included: a model whose discovery found no pod has no replica series.
            routable = GaugeMetricFamily(
                "fleetgate_model_healthy_replicas",
                "Routable replicas of each model (0: its requests get 503 no_healthy_replica).",
                labels=["model"],
            )
            for model, replicas in self._models().items():
                routable.add_metric([model], sum(1 for r in replicas if r.routable(now)))
            yield routable

    def describe(self) -> Iterator[Metric]:
        return iter(())


class QuotaCollector(Collector):
    """Each tenant's configured token quotas, so an alert can compare usage with them
    (``fleetgate_limits_tokens_settled_total`` over a day against the day's quota)."""

    def __init__(self, tenants: Callable[[], Mapping[str, TenantSettings]]) -> None:
        self._tenants = tenants

    def collect(self) -> Iterator[Metric]:
        quota = GaugeMetricFamily(
            "fleetgate_limits_quota_tokens",
            "A tenant's configured token quota, by period (day, month).",
            labels=["tenant", "period"],
        )
        for tenant_id, tenant in self._tenants().items():
            for period, limit in (("day", tenant.limits.tokens_per_day), ("month", tenant.limits.tokens_per_month)):
                if limit is not None:
                    quota.add_metric([tenant_id, period], limit)
        yield quota

    def describe(self) -> Iterator[Metric]:
        return iter(())


class KvEventsCollector(Collector):
    """The replicas' KV-cache event streams (``routing.kv_subscriber``), read at scrape time."""

    def __init__(self, streams: Callable[[], Mapping[str, Mapping[str, object]]]) -> None:
        self._streams = streams

    def collect(self) -> Iterator[Metric]:
        received = CounterMetricFamily(
            "fleetgate_kv_events_batches", "KV event batches received from each replica.", labels=["replica"]
        )
        gaps = CounterMetricFamily(
            "fleetgate_kv_events_gaps", "Gaps in a replica's event sequence (its index cleared).", labels=["replica"]
        )
        restarts = CounterMetricFamily(
            "fleetgate_kv_events_restarts", "Engine restarts seen in the sequence (index cleared).", labels=["replica"]
        )
        resyncs = CounterMetricFamily(
            "fleetgate_kv_events_resyncs", "Rebuilds from the replica's replay buffer.", labels=["replica"]
        )
        errors = CounterMetricFamily(
            "fleetgate_kv_events_decode_errors", "Event batches that did not decode (dropped).", labels=["replica"]
        )
        blocks = GaugeMetricFamily(
            "fleetgate_kv_events_blocks", "KV blocks the index holds per replica.", labels=["replica"]
        )
        exact = GaugeMetricFamily(
            "fleetgate_kv_events_exact",
            "1 while routing reads the replica's cached prefixes from its events (0: the estimate).",
            labels=["replica"],
        )
        for rid, s in self._streams().items():
            received.add_metric([rid], _number(s.get("received")))
            gaps.add_metric([rid], _number(s.get("gaps")))
            restarts.add_metric([rid], _number(s.get("restarts")))
            resyncs.add_metric([rid], _number(s.get("resyncs")))
            errors.add_metric([rid], _number(s.get("decode_errors")))
            blocks.add_metric([rid], _number(s.get("blocks")))
            exact.add_metric([rid], 1.0 if s.get("exact") else 0.0)
        yield from (received, gaps, restarts, resyncs, errors, blocks, exact)

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0
