"""Admission results as values: the store's raw outcome, the lease, and the decision.

A store answers with an ``Outcome`` (which field failed, retry time, header figures); the
limiter turns it into a ``Decision`` that carries everything the gateway needs: whether to
proceed, the OpenAI error (message, code, type, status) and the ``x-ratelimit-*`` headers.
Messages name the limit that was hit and the caller's own figures only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from limits.plan import AdmissionPlan, BucketSpec
from limits.windows import window

LeaseOrigin = Literal["store", "fallback", "none"]


class Reason(StrEnum):
    """Why a request was rejected."""

    REQUESTS_PER_MINUTE = "requests_per_minute"
    TOKENS_PER_MINUTE = "tokens_per_minute"
    CONCURRENCY = "concurrency"
    TOKENS_PER_DAY = "tokens_per_day"
    TOKENS_PER_MONTH = "tokens_per_month"
    STORE_UNAVAILABLE = "store_unavailable"


@dataclass(slots=True)  # not frozen: built per request, and a frozen __init__ is 3x slower
class RateView:
    """A store's figures for the most constraining bucket of one kind."""

    field: str
    remaining: int
    reset_s: float


@dataclass(slots=True)  # not frozen: built per request, and a frozen __init__ is 3x slower
class Outcome:
    """A store's raw answer to one admission."""

    allowed: bool
    # The field of the check that failed: a bucket, a cap (``...|c``), ``q|d`` or ``q|m``.
    failed: str
    # Seconds until a retry can succeed; -1 when the request can never fit the bucket.
    retry_after_s: float
    requests: RateView | None
    tokens: RateView | None
    # The store's clock at the decision (Redis TIME for the Redis store).
    now: float


@dataclass(frozen=True, slots=True)
class Lease:
    """An admitted request's claim: its concurrency slots and token reservation.

    Settle it exactly once when the response ends. A held lease expires in the store one
    lease TTL after admission or its last renewal, so a gateway that dies mid-request does
    not hold slots or quota forever. ``origin`` says which store must settle it ("none":
    nothing to settle).
    """

    id: str
    tenant: str
    reserve: int
    origin: LeaseOrigin
    token_buckets: tuple[BucketSpec, ...] = ()
    day_quota: bool = False
    month_quota: bool = False
    # The store recorded it (caps or quotas), so it expires and can be renewed.
    held: bool = False

    @classmethod
    def from_plan(cls, lease_id: str, plan: AdmissionPlan, origin: LeaseOrigin) -> Lease:
        """The lease of an admitted ``plan`` (origin "none" if settling would change nothing)."""
        return cls(
            id=lease_id,
            tenant=plan.tenant,
            reserve=plan.reserve,
            origin=origin if plan.needs_settle else "none",
            token_buckets=plan.token_buckets,
            day_quota=plan.tokens_per_day is not None,
            month_quota=plan.tokens_per_month is not None,
            held=plan.holds_lease,
        )


@dataclass(slots=True)  # not frozen: built per request, and a frozen __init__ is 3x slower
class RateInfo:
    """One kind's header figures: limit per minute, remaining now, seconds to full."""

    limit: int
    remaining: int
    reset_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    """Admit or reject, with the error to send and the headers to attach."""

    allowed: bool
    reason: Reason | None = None
    retry_after_s: float = 0.0
    message: str = ""
    # "rate_limit_exceeded", "insufficient_quota" or "service_unavailable"; None if allowed.
    error_code: str | None = None
    lease: Lease | None = None
    requests: RateInfo | None = None
    tokens: RateInfo | None = None
    # Decided by this process alone because the shared store was unreachable.
    degraded: bool = False

    @property
    def status(self) -> int:
        if self.allowed:
            return 200
        return 503 if self.reason is Reason.STORE_UNAVAILABLE else 429

    @property
    def error_type(self) -> str | None:
        """OpenAI's ``error.type`` for this rejection."""
        if self.allowed:
            return None
        if self.reason is Reason.STORE_UNAVAILABLE:
            return "server_error"
        if self.error_code == "insufficient_quota":
            return "insufficient_quota"
        return "tokens" if self.reason is Reason.TOKENS_PER_MINUTE else "requests"

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers, plus ``retry-after`` on a rejection."""
        out: dict[str, str] = {}
        for kind, info in (("requests", self.requests), ("tokens", self.tokens)):
            if info is not None:
                out[f"x-ratelimit-limit-{kind}"] = str(info.limit)
                out[f"x-ratelimit-remaining-{kind}"] = str(info.remaining)
                out[f"x-ratelimit-reset-{kind}"] = format_duration(info.reset_s)
        if not self.allowed and self.retry_after_s > 0:
            # Retry-After takes whole seconds (RFC 9110 section 10.2.3); round up so a client
            # that honours it is not rejected again. OpenAI adds the precise value in ms.
            out["retry-after"] = str(math.ceil(self.retry_after_s))
            out["retry-after-ms"] = str(math.ceil(self.retry_after_s * 1000))
        return out


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: ``20ms``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{_secs(seconds)}s"
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    head = f"{hours}h{minutes}m" if hours else f"{minutes}m"
    return f"{head}{_secs(secs)}s"


def _secs(seconds: float) -> str:
    return f"{seconds:.3f}".rstrip("0").rstrip(".")


def _retry_words(seconds: float) -> str:
    return f"Retry after {_secs(max(seconds, 0.001))} s."


def _rate_info(plan: AdmissionPlan, view: RateView | None) -> RateInfo | None:
    spec = plan.find_bucket(view.field) if view is not None else None
    if view is None or spec is None:
        return None
    return RateInfo(limit=spec.limit, remaining=view.remaining, reset_s=view.reset_s)


def decide(
    plan: AdmissionPlan,
    outcome: Outcome,
    lease: Lease | None,
    *,
    degraded: bool = False,
    concurrency_retry_s: float = 1.0,
) -> Decision:
    """Turn a store's outcome into the decision the gateway acts on."""
    requests = _rate_info(plan, outcome.requests)
    tokens = _rate_info(plan, outcome.tokens)
    if outcome.allowed:
        return Decision(True, lease=lease, requests=requests, tokens=tokens, degraded=degraded)

    def reject(reason: Reason, retry: float, message: str, code: str) -> Decision:
        return Decision(False, reason, retry, message, code, None, requests, tokens, degraded=degraded)

    failed = outcome.failed
    if failed in ("q|d", "q|m"):
        kind: Literal["day", "month"] = "day" if failed == "q|d" else "month"
        limit = plan.tokens_per_day if kind == "day" else plan.tokens_per_month
        resets = window(kind, outcome.now).resets_at_iso
        adjective = "daily" if kind == "day" else "monthly"
        message = (
            f"You exceeded your {adjective} token quota (limit {limit} tokens; this request "
            f"reserves {plan.reserve}). The quota resets at {resets}."
        )
        reason = Reason.TOKENS_PER_DAY if kind == "day" else Reason.TOKENS_PER_MONTH
        return reject(reason, outcome.retry_after_s, message, "insufficient_quota")
    cap = plan.find_cap(failed)
    if cap is not None:
        message = (
            f"Too many concurrent requests{cap.scope.describe()} (limit {cap.cap}). {_retry_words(concurrency_retry_s)}"
        )
        return reject(Reason.CONCURRENCY, concurrency_retry_s, message, "rate_limit_exceeded")
    bucket = plan.find_bucket(failed)
    if bucket is None:
        raise ValueError(f"store reported an unknown failed check {failed!r}")
    return reject(*_bucket_rejection(bucket, plan.cost(bucket), outcome.retry_after_s), "rate_limit_exceeded")


def _bucket_rejection(bucket: BucketSpec, cost: int, retry: float) -> tuple[Reason, float, str]:
    where = bucket.scope.describe()
    if bucket.kind == "requests":
        message = f"Rate limit reached for requests per minute{where} (limit {bucket.limit}). {_retry_words(retry)}"
        return Reason.REQUESTS_PER_MINUTE, retry, message
    if retry < 0:
        # Larger than the bucket can ever hold: waiting will not help (OpenAI's wording).
        message = (
            f"Request too large for tokens per minute{where} (limit {bucket.limit}, "
            f"burst {bucket.burst}, requested {cost}). Reduce the prompt or max_tokens."
        )
        return Reason.TOKENS_PER_MINUTE, 0.0, message
    message = (
        f"Rate limit reached for tokens per minute{where} (limit {bucket.limit}, "
        f"requested {cost}). {_retry_words(retry)}"
    )
    return Reason.TOKENS_PER_MINUTE, retry, message


def unavailable(degraded: bool = True) -> Decision:
    """The fail_closed answer while the shared store is unreachable (HTTP 503)."""
    return Decision(
        False,
        Reason.STORE_UNAVAILABLE,
        1.0,
        "Rate limiting is temporarily unavailable. Please retry shortly.",
        "service_unavailable",
        degraded=degraded,
    )
