"""What a request gets when its model's pool is saturated: pure decisions over plain values.

The gateway's queue stage (``gateway.stages``) asks, in order: the request's deadline
(``deadline``), then, when no replica has room, the tenant's graceful degradation
(``overflow_model``, then ``clamp``), then how long it may wait by priority (``priority``),
and, when the fair queue refuses it, why (``shed_reason``): the reason names the metric's
label and the client's answer (429 ``queue_full``, 504 ``deadline``, 503 ``wait_exceeded``).
Nothing here awaits or reads a clock: time comes in as arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from routing.config import PRIORITIES, Priority
from routing.fair_queue import RejectReason

QUEUE_FULL = "queue_full"
BAND_FULL = "band_full"
DEADLINE = "deadline"
WAIT_EXCEEDED = "wait_exceeded"


def deadline(started: float, limit_s: float, sent_ms: str | None) -> tuple[float, bool] | None:
    """When the request must be answered, and whether attempts are cut there.

    ``limit_s`` after it started, or sooner if the client asks (``sent_ms``, milliseconds;
    True: the client's own bound, which also cuts an attempt in flight). None: ``sent_ms``
    is not a positive integer.
    """
    if sent_ms is None:
        return started + limit_s, False
    try:
        ms = int(sent_ms)
    except ValueError:
        return None
    if ms <= 0:
        return None
    return started + min(ms / 1000, limit_s), True


def priority(tenant: Priority, asked: str | None) -> Priority:
    """The tenant's priority, or a lower one the request asks for (never a higher one)."""
    for level in PRIORITIES:
        if level == tenant:
            return level
        if level == asked:
            return level
    return tenant


def overflow_model(smaller: Iterable[str], has_room: Callable[[str], bool]) -> str | None:
    """The nearest smaller tier's model with room (``smaller`` nearest first), or None."""
    for model in smaller:
        if has_room(model):
            return model
    return None


def clamp(max_tokens: int | None, limit: int | None) -> int | None:
    """The ``max_tokens`` to send under the tenant's degradation limit; None: unchanged.

    A request without ``max_tokens`` gets the limit too (the replica's default may be the
    whole context).
    """
    if limit is None or (max_tokens is not None and max_tokens <= limit):
        return None
    return limit


def shed_reason(rejected: RejectReason, wait_until: float, deadline: float) -> str:
    """Why a queued request was refused: its tenant's queue or its band's was full, its own
    deadline passed (it bounded the wait), or it waited its band's or priority's longest wait."""
    if rejected is RejectReason.QUEUE_FULL:
        return QUEUE_FULL
    if rejected is RejectReason.BAND_FULL:
        return BAND_FULL
    if wait_until >= deadline:
        return DEADLINE
    return WAIT_EXCEEDED
