"""The shared-core method: two gateways loaded at the same time on core 0, to compare their
CPU cost per request on a noisy shared machine.

Both are saturated, so the scheduler gives each an even share of the core: their requests/s
differ as their CPU cost per request does, and whatever else runs on the machine slows both
alike (sequential runs see it slow one run and not the next, by more than a few-% effect).
Two corrections make the ratio hold to a percent or two:
- every pair runs in both orders: the first of a pair to start gains a little;
- two processes of each kind, every pairing: one process can run a few percent faster than
  another of the same code and configuration, so one process must not stand for its kind.
``geometric_ratios`` folds those runs into one ratio per round. Used by
bench/tracing_overhead.py and bench/allocator.py; the setup (nginx upstream, wrk, the stream
client) is bench/overhead.py's.
"""

from __future__ import annotations

import math
import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.machine import core_busy_idle, spare_share
from bench.overhead import cpu_seconds, stream_rate, wrk


@dataclass
class Shared:
    """Two gateways under load at once on one core: the rate each served (requests or relayed
    events per second), its CPU time per request or event, the share of time cores 0 (the
    gateways: none, if both were saturated) and 1 (the load side) had to spare meanwhile
    (bench/machine.py), and the failed requests of both (wrk's non-2xx and socket errors)."""

    rate: tuple[float, float]
    cpu_us: tuple[float, float]
    spare: tuple[float, float]
    errors: int


def pairings(ons: tuple[str, ...], offs: tuple[str, ...]) -> list[tuple[str, str]]:
    """Every gateway of ``ons`` with every one of ``offs``, in both orders (first started first)."""
    return [m for a in ons for b in offs for m in ((a, b), (b, a))]


def shared_core(urls: tuple[str, str], pids: tuple[int, int], conc: int, duration: int, script: Path) -> Shared:
    """Both gateways saturated on core 0 at once by wrk running ``script``, ``conc``
    connections each."""
    before, cores0 = [cpu_seconds(pid) for pid in pids], _cores()
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda url: wrk(url, conc, duration, script), urls)
    after, cores1 = [cpu_seconds(pid) for pid in pids], _cores()
    cpu = tuple((y - x) / max(1.0, r.rps * duration) * 1e6 for x, y, r in zip(before, after, (a, b), strict=True))
    return Shared((a.rps, b.rps), (cpu[0], cpu[1]), _spare(cores0, cores1), a.errors + b.errors)


def shared_streams(urls: tuple[str, str], pids: tuple[int, int], model: str, conc: int, duration: int) -> Shared:
    """Both gateways relaying ``conc`` streams each at once (bench/overhead.py's stream client,
    which fails on any status but 200): events relayed per second and the gateway's CPU time
    per event."""
    cores0 = _cores()
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda url, pid: stream_rate(url, model, conc, duration, pid), urls, pids)
    cores1 = _cores()
    return Shared((a[0], b[0]), (a[1] or math.nan, b[1] or math.nan), _spare(cores0, cores1), 0)


def _cores() -> tuple[tuple[int, int], tuple[int, int]]:
    return core_busy_idle(0), core_busy_idle(1)


def _spare(
    before: tuple[tuple[int, int], tuple[int, int]], after: tuple[tuple[int, int], tuple[int, int]]
) -> tuple[float, float]:
    return spare_share(before[0], after[0]), spare_share(before[1], after[1])


def geometric_ratios(
    pairs: dict[str, list[Shared]], ons: tuple[str, ...], offs: tuple[str, ...]
) -> dict[str, list[float]]:
    """The gateways ``ons`` against ``offs`` (``pairs["a/b"]``: one ``Shared`` per round, ``a``
    started first), per round the geometric mean of every pairing's ratio, in both orders: what
    the first of a pair gains cancels, and a process of one kind that runs faster than another
    of the same kind is averaged with it instead of standing for its kind. Keys: ``rate`` and
    ``cpu`` (CPU time per request or event)."""
    out = {}
    for what, get in (("rate", _rate), ("cpu", _cpu)):
        per_round: list[list[float]] = [[] for _ in pairs[f"{ons[0]}/{offs[0]}"]]
        for a in ons:
            for b in offs:
                for i, (x, y) in enumerate(zip(pairs[f"{a}/{b}"], pairs[f"{b}/{a}"], strict=True)):
                    per_round[i] += [get(x)[0] / get(x)[1], get(y)[1] / get(y)[0]]
        out[what] = [math.exp(statistics.fmean(map(math.log, r))) for r in per_round]
    return out


def _rate(pair: Shared) -> tuple[float, float]:
    return pair.rate


def _cpu(pair: Shared) -> tuple[float, float]:
    return pair.cpu_us
