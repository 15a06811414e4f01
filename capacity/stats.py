"""Statistics of one load point: percentiles and the client-side metrics of a capacity sweep.

Pure code over plain data. ``RequestSample`` is what the load generator records per request
(already in real-time-equivalent seconds, see ``capacity.loadgen``); ``point_metrics`` reduces
the samples of one measurement window to the flat dict of named numbers that the planner's
SLOs, the report and the JSON all use.

Percentiles interpolate linearly between closest ranks (numpy's default, "type 7"), so the
figures match what ``numpy.percentile`` or a spreadsheet would give on the JSON samples.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

Metrics = dict[str, float | None]

# The slowest users matter more than the average one: the 5th percentile of per-request
# decode rates is "the rate 1 user in 20 sees or worse".
SLOW_USER_PERCENTILE = 5.0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def maybe_percentile(values: Sequence[float], q: float) -> float | None:
    """Like ``percentile`` but ``None`` for no values (a point where nothing succeeded)."""
    return percentile(values, q) if values else None


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def decode_rate(tokens: int, first_token_s: float, last_token_s: float) -> float | None:
    """Per-user typing speed: tokens after the first over the time they took (as the published probe).

    ``None`` when there is no interval to measure (one token, or all in one event).
    """
    span = last_token_s - first_token_s
    if tokens < 2 or span <= 0:
        return None
    return (tokens - 1) / span


def tokens_in_window(event_times: Sequence[float], tokens: int, start: float, end: float) -> float:
    """How many of a request's ``tokens`` were produced inside ``[start, end)``.

    A server may pack several tokens into one stream event; tokens are spread evenly over the
    events, so a request straddling the window edge counts only its share inside.
    """
    if not event_times or tokens <= 0:
        return 0.0
    inside = sum(1 for t in event_times if start <= t < end)
    return tokens * inside / len(event_times)


@dataclass
class RequestSample:
    """One request as the client saw it. Times in real-time-equivalent seconds."""

    user: int
    user_class: str
    session: int
    turn: int
    start_s: float  # sent, relative to the start of the measurement window
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int | None = None  # from the response's usage
    completion_tokens: int = 0
    events: int = 0  # stream events timed: the first chunk with a choice, then those carrying text
    decode_tps: float | None = None
    itl_p50_s: float | None = None
    max_gap_s: float | None = None  # longest silence inside the stream: a preemption shows here
    prefix: str | None = None  # "cold" / "warm" for first turns that open with a shared part
    error: str | None = None  # error kind; None when the request succeeded
    # Every inter-token gap; kept for the point's ITL percentiles, left out of the JSON.
    gaps: list[float] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["gaps"]
        return out


@dataclass(frozen=True)
class Summary:
    """The usual order statistics of one quantity."""

    count: int
    mean: float | None
    p50: float | None
    p95: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        return cls(
            count=len(values),
            mean=mean(values),
            p50=maybe_percentile(values, 50),
            p95=maybe_percentile(values, 95),
            p99=maybe_percentile(values, 99),
            max=max(values) if values else None,
        )


def errors_by_kind(samples: Iterable[RequestSample]) -> dict[str, int]:
    counts = Counter(s.error for s in samples if s.error is not None)
    return dict(sorted(counts.items()))


def point_metrics(samples: Sequence[RequestSample], window_s: float, window_tokens: float = 0.0) -> Metrics:
    """The client-side metrics of one point, over the requests sent inside its window.

    ``total_tps`` is ``window_tokens`` (the tokens generated inside the window by any request,
    including those sent before it or finishing after it) over the window's length;
    ``per_user_tps`` is the mean decode rate of the successful requests, as the published
    single-GPU table reports it.
    """
    ok = [s for s in samples if s.error is None]
    ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
    gaps = [g for s in ok for g in s.gaps]
    rates = [s.decode_tps for s in ok if s.decode_tps is not None]
    e2e = [s.e2e_s for s in ok if s.e2e_s is not None]
    cold = [s.ttft_s for s in ok if s.prefix == "cold" and s.ttft_s is not None]
    warm = [s.ttft_s for s in ok if s.prefix == "warm" and s.ttft_s is not None]
    prompts = [float(s.prompt_tokens) for s in ok if s.prompt_tokens is not None]
    failed = len(samples) - len(ok)
    tt, it = Summary.of(ttft), Summary.of(gaps)
    return {
        "requests": float(len(samples)),
        "errors": float(failed),
        "error_rate": failed / len(samples) if samples else None,
        "request_rate": len(samples) / window_s if window_s > 0 else None,
        "total_tps": window_tokens / window_s if window_s > 0 else None,
        "per_user_tps": mean(rates),
        "per_user_tps_p50": maybe_percentile(rates, 50),
        "per_user_tps_p5": maybe_percentile(rates, SLOW_USER_PERCENTILE),
        "ttft_p50": tt.p50,
        "ttft_p95": tt.p95,
        "ttft_p99": tt.p99,
        "ttft_max": tt.max,
        "itl_p50": it.p50,
        "itl_p95": it.p95,
        "itl_p99": it.p99,
        "max_gap": it.max,
        "e2e_p50": maybe_percentile(e2e, 50),
        "e2e_p95": maybe_percentile(e2e, 95),
        "prompt_tokens_mean": mean(prompts),
        "prompt_tokens_max": max(prompts) if prompts else None,
        "ttft_cold_p50": maybe_percentile(cold, 50),
        "ttft_warm_p50": maybe_percentile(warm, 50),
        "cold_requests": float(len(cold)),
        "warm_requests": float(len(warm)),
    }


def median_metrics(runs: Sequence[Metrics]) -> Metrics:
    """Each metric's median over repeated runs of one point (``None`` where no run measured it).

    On a shared machine a burst of other work spoils one run; the median of three ignores it,
    where pooling the samples would not.
    """
    keys = dict.fromkeys(k for run in runs for k in run)
    out: Metrics = {}
    for key in keys:
        values = [v for run in runs if (v := run.get(key)) is not None]
        out[key] = percentile(values, 50) if values else None
    return out
