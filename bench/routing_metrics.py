"""What the routing benchmark reads off a point: goodput, SLO attainment, cache hits, balance.

Pure code over plain data: the client's ``RequestSample``s of one measurement window and
the replicas' gauges sampled during it (``capacity.fleet_probe.FleetWindow.samples``: one dict
of vLLM metrics per replica, per sample).

Definitions (the report repeats them):

- A request is **good** when it completed without error, its time to first token was at most
  ``TTFT_SLO_S`` and the 95th percentile of its own inter-token gaps at most ``ITL_SLO_S``.
- **Goodput** of a point: good requests sent inside the window, per second of window.
- **Prefix-cache hit rate**: prompt tokens found in the replicas' prefix caches over prompt
  tokens looked up, summed over replicas (``vllm:prefix_cache_hits_total`` /
  ``vllm:prefix_cache_queries_total``, deltas across the window).
- **Imbalance**: the busiest replica's time-averaged requests (running + waiting) over the
  fleet's mean; 1.0 is perfectly even.
- **Idle while queued**: the share of the window's fleet samples in which some replica had
  nothing to do (no request running or waiting) while another had requests waiting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from capacity.fleet_probe import Gauges
from capacity.stats import Metrics, RequestSample, maybe_percentile, percentile, point_metrics

TTFT_SLO_S = 1.0
ITL_SLO_S = 0.100
# The per-request inter-token percentile the ITL SLO is read at.
ITL_PERCENTILE = 95.0

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
GENERATED = "vllm:generation_tokens_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREEMPTIONS = "vllm:num_preemptions_total"
KV_USAGE = "vllm:kv_cache_usage_perc"


def request_itl_p95(sample: RequestSample) -> float | None:
    """The 95th percentile of one request's inter-token gaps (None with fewer than two tokens)."""
    return maybe_percentile(sample.gaps, ITL_PERCENTILE)


def is_good(sample: RequestSample) -> bool:
    """Completed, first token within the TTFT SLO, and its own gaps within the ITL SLO."""
    if sample.error is not None or sample.ttft_s is None or sample.ttft_s > TTFT_SLO_S:
        return False
    itl = request_itl_p95(sample)
    return itl is None or itl <= ITL_SLO_S


@dataclass(frozen=True)
class FleetReading:
    """The replicas during one window: counters as deltas, gauges averaged over the samples."""

    generated: tuple[float, ...]  # tokens each replica generated
    queries: float  # prompt tokens looked up in the prefix caches (all replicas)
    hits: float  # of which found cached
    preemptions: float
    mean_load: tuple[float, ...]  # time-averaged running + waiting, per replica
    kv_peak: float | None
    idle_while_queued: float | None  # share of samples
    samples: int

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None

    @property
    def imbalance(self) -> float | None:
        mean = sum(self.mean_load) / len(self.mean_load) if self.mean_load else 0.0
        return max(self.mean_load) / mean if mean > 0 else None

    @property
    def generated_imbalance(self) -> float | None:
        mean = sum(self.generated) / len(self.generated) if self.generated else 0.0
        return max(self.generated) / mean if mean > 0 else None


def read_fleet(samples: Sequence[tuple[float, list[Gauges]]], start: float, end: float) -> FleetReading | None:
    """Summarise the replicas over ``[start, end]`` (clock times of ``samples``).

    Counters are taken from the last sample at or before ``start`` to the first at or after
    ``end`` (falling back to the first and last inside); a counter that went down (a
    restarted replica) counts from zero.
    """
    inside = [reps for t, reps in samples if start <= t <= end]
    before = [reps for t, reps in samples if t <= start]
    after = [reps for t, reps in samples if t >= end]
    first = before[-1] if before else (inside[0] if inside else None)
    last = after[0] if after else (inside[-1] if inside else None)
    if first is None or last is None or len(first) != len(last):
        return None
    n = len(last)

    def delta(name: str, i: int) -> float:
        a, b = first[i].get(name, 0.0), last[i].get(name, 0.0)
        return b - a if b >= a else b

    loads = [[r.get(RUNNING, 0.0) + r.get(WAITING, 0.0) for r in reps] for reps in inside if len(reps) == n]
    mean_load = tuple(sum(row[i] for row in loads) / len(loads) for i in range(n)) if loads else (0.0,) * n
    idle_queued = [_idle_while_queued(reps) for reps in inside if len(reps) == n]
    kv = [max((r.get(KV_USAGE, 0.0) for r in reps), default=0.0) for reps in inside]
    return FleetReading(
        generated=tuple(delta(GENERATED, i) for i in range(n)),
        queries=sum(delta(PREFIX_QUERIES, i) for i in range(n)),
        hits=sum(delta(PREFIX_HITS, i) for i in range(n)),
        preemptions=sum(delta(PREEMPTIONS, i) for i in range(n)),
        mean_load=mean_load,
        kv_peak=max(kv) if kv else None,
        idle_while_queued=sum(idle_queued) / len(idle_queued) if idle_queued else None,
        samples=len(inside),
    )


def _idle_while_queued(replicas: list[Gauges]) -> bool:
    idle = any(r.get(RUNNING, 0.0) + r.get(WAITING, 0.0) == 0 for r in replicas)
    return idle and any(r.get(WAITING, 0.0) > 0 for r in replicas)


def point_summary(
    samples: Sequence[RequestSample], window_s: float, window_tokens: float, fleet: FleetReading | None
) -> Metrics:
    """The client's metrics of one point (``capacity.stats.point_metrics``) plus the routing ones."""
    metrics = point_metrics(samples, window_s, window_tokens)
    metrics.update(request_metrics(samples, window_s))
    metrics.update(fleet_metrics(fleet))
    return metrics


def request_metrics(samples: Sequence[RequestSample], window_s: float) -> Metrics:
    """Goodput, SLO attainment, completion, why requests missed, and TTFT per user class (``ttft_p99.<class>``).

    ``ttft_miss``: share of requests that completed with a first token later than the TTFT
    SLO; ``itl_miss``: share that met it but whose own inter-token p95 missed the ITL SLO.
    """
    n = len(samples)
    good = sum(1 for s in samples if is_good(s))
    completed = sum(1 for s in samples if s.error is None)
    ok = [s for s in samples if s.error is None]
    late = sum(1 for s in ok if s.ttft_s is None or s.ttft_s > TTFT_SLO_S)
    out: Metrics = {
        "goodput": good / window_s if window_s > 0 else None,
        "throughput": completed / window_s if window_s > 0 else None,
        "attainment": good / n if n else None,
        "completion": completed / n if n else None,
        "ttft_miss": late / n if n else None,
        "itl_miss": (len(ok) - late - good) / n if n else None,
    }
    for name in sorted({s.user_class for s in ok}):
        ttft = [s.ttft_s for s in ok if s.user_class == name and s.ttft_s is not None]
        out[f"ttft_p50.{name}"] = maybe_percentile(ttft, 50)
        out[f"ttft_p99.{name}"] = maybe_percentile(ttft, 99)
    return out


def fleet_metrics(fleet: FleetReading | None) -> Metrics:
    if fleet is None:
        keys = ("hit_rate", "imbalance", "generated_imbalance", "idle_while_queued", "kv_peak", "preemptions")
        return dict.fromkeys(keys)
    return {
        "hit_rate": fleet.hit_rate,
        "imbalance": fleet.imbalance,
        "generated_imbalance": fleet.generated_imbalance,
        "idle_while_queued": fleet.idle_while_queued,
        "kv_peak": fleet.kv_peak,
        "preemptions": fleet.preemptions,
    }


def pooled(points: Sequence[tuple[Sequence[RequestSample], float, FleetReading | None]]) -> Metrics:
    """Several seeds of one (workload, policy, rate) as one: samples and windows pooled.

    Rates are per second of the seeds' windows together; fleet counters are added up,
    imbalance and idle-while-queued averaged over the seeds' samples.
    """
    samples = [s for ss, _, _ in points for s in ss]
    window = sum(w for _, w, _ in points)
    metrics = point_metrics(samples, window)
    metrics.update(request_metrics(samples, window))
    readings = [f for _, _, f in points if f is not None]
    if readings:
        queries = sum(f.queries for f in readings)
        idle = [(f.idle_while_queued, f.samples) for f in readings if f.idle_while_queued is not None]
        imb = [f.imbalance for f in readings if f.imbalance is not None]
        gen_imb = [f.generated_imbalance for f in readings if f.generated_imbalance is not None]
        kv = [f.kv_peak for f in readings if f.kv_peak is not None]
        metrics.update(
            {
                "hit_rate": sum(f.hits for f in readings) / queries if queries > 0 else None,
                "imbalance": sum(imb) / len(imb) if imb else None,
                "generated_imbalance": sum(gen_imb) / len(gen_imb) if gen_imb else None,
                "idle_while_queued": (
                    sum(v * n for v, n in idle) / sum(n for _, n in idle) if idle and sum(n for _, n in idle) else None
                ),
                "kv_peak": max(kv) if kv else None,
                "preemptions": sum(f.preemptions for f in readings),
            }
        )
    else:
        metrics.update(fleet_metrics(None))
    return metrics


@dataclass(frozen=True)
class Spread:
    """One metric over the seeds of a point: median, lowest and highest."""

    median: float | None
    low: float | None
    high: float | None

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Spread:
        known = [v for v in values if v is not None]
        if not known:
            return cls(None, None, None)
        return cls(percentile(known, 50), min(known), max(known))


@dataclass(frozen=True)
class Peak:
    """A policy's best goodput over a rate sweep (the seeds' median at each rate) and where."""

    goodput: float | None
    rate: float | None
    low: float | None  # the seeds' range at that rate
    high: float | None


def peak(by_rate: dict[float, Spread]) -> Peak:
    """The rate with the highest median goodput; ties go to the lower rate."""
    best: tuple[float, float, Spread] | None = None
    for rate in sorted(by_rate):
        spread = by_rate[rate]
        if spread.median is not None and (best is None or spread.median > best[0]):
            best = (spread.median, rate, spread)
    if best is None:
        return Peak(None, None, None, None)
    value, rate, spread = best
    return Peak(value, rate, spread.low, spread.high)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; None when either is unknown or ``b`` is zero."""
    return None if a is None or b is None or b == 0 else a / b
