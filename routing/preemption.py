"""Preemption between priority bands: which requests preempt, and where a preempted stream goes.

A band set ``preemptible`` (``bands[].preemptible``) gives way to the bands above it that
are not preemptible themselves: when a request of such a band (a *preempting* request) is
sent to a replica, this band's streams running there move to another replica, where the
gateway continues each exactly (``gateway.proxy``, ``dialects.continuation``). On a CPU or a
small GPU, any work beside a request slows its first token; moving the lower band's streams
off is what keeps a higher band's time to first token as it is on an idle replica.

Two rules keep it from churning:

- Only a non-preemptible band preempts. A preemptible band above another does not: both
  are throughput work, and moving one for the other would only add prefills.
- Where a preemptible band's request (a new one, or a preempted stream's continuation)
  goes, replicas running preempting work are avoided while another replica can take it
  (``avoiding``); when every other replica runs some, it goes where the routing policy
  says, never back to the replica it left unless nothing else can take it.

Each replica counts the preempting requests running on it (``Replica.preempting``, kept by
``Claim``), so every check here is O(1) per replica and the request path pays nothing
while no band is preemptible. Pure: plain values in, plain values out.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from replicas.replica import Replica


def preempting_bands(preemptible: Sequence[bool]) -> tuple[bool, ...]:
    """For each band (highest first), whether its requests preempt: it is not preemptible
    itself, and a band below it is."""
    out = []
    below = False
    for flag in reversed(preemptible):
        out.append(not flag and below)
        below = below or flag
    return tuple(reversed(out))


def avoiding(replicas: Sequence[Replica], exclude: Collection[str]) -> set[str] | None:
    """``exclude`` plus the replicas running preempting work, for a preemptible band's pick;
    None when none runs any (nothing more to avoid)."""
    busy = [r.id for r in replicas if r.preempting]
    if not busy:
        return None
    return {*exclude, *busy}


def has_refuge(leaving: Replica, peers: Sequence[Replica], now: float) -> bool:
    """Whether a stream moved off ``leaving`` has another routable replica to go to."""
    return any(p is not leaving and p.routable(now) for p in peers)


def has_haven(leaving: Replica, peers: Sequence[Replica], now: float) -> bool:
    """Whether another routable replica runs no preempting work: a stream that just started
    on ``leaving`` beside such work is worth moving only there."""
    return any(p is not leaving and not p.preempting and p.routable(now) for p in peers)


def may_preempt(preempted: int, bound: int | None) -> bool:
    """Whether a stream moved ``preempted`` times already may be moved again (``bound``:
    its band's ``max_preemptions``; None: its band is not preemptible)."""
    return bound is not None and preempted < bound
