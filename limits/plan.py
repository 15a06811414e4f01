"""What one admission must check, resolved from a tenant's limits for one subject.

A plan is plain data both stores consume: the buckets to charge (tenant, key and model
scopes; requests and tokens), the concurrency caps, the quotas and the reservation. Each
bucket and cap carries a *field* name, unique within the tenant, under which a store keeps
its state (a hash field in Redis, a dict key in memory). Identifiers are percent-escaped
so a key id or model name can never forge another scope's field.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Literal

from limits.config import ScopeLimits, TenantLimits
from limits.gcra import Rate

BucketKind = Literal["requests", "tokens"]
ScopeKind = Literal["tenant", "key", "model"]

# Characters with a meaning in store fields and lease payloads (and Redis hash tags).
_RESERVED = "%{}:|,;"


def escape(ident: str) -> str:
    """Percent-escape the characters that structure field names."""
    if not any(c in _RESERVED for c in ident):
        return ident
    return "".join(f"%{ord(c):02X}" if c in _RESERVED else c for c in ident)


@dataclass(frozen=True, slots=True)
class Subject:
    """Who is asking: the tenant, and optionally the API key id and the model."""

    tenant: str
    key_id: str | None = None
    model: str | None = None


@dataclass(frozen=True, slots=True)
class Scope:
    """Where a limit comes from, for the field name and the user-facing message."""

    kind: ScopeKind
    name: str = ""

    @property
    def field(self) -> str:
        if self.kind == "tenant":
            return "t"
        return f"{self.kind[0]}:{escape(self.name)}"

    def describe(self) -> str:
        """Words for a message; only ever names the caller's own key or model."""
        if self.kind == "key":
            return " for this API key"
        if self.kind == "model":
            return f" for model '{self.name}'"
        return ""


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """One GCRA bucket to charge: requests (cost 1) or tokens (cost: the plan's reservation)."""

    scope: Scope
    kind: BucketKind
    limit: int
    burst: int
    rate: Rate
    # The store field, computed once: the stores look it up several times per call.
    field: str = dataclass_field(init=False, compare=False)

    def __post_init__(self) -> None:
        suffix = "rpm" if self.kind == "requests" else "tpm"
        object.__setattr__(self, "field", f"{self.scope.field}|{suffix}")


@dataclass(frozen=True, slots=True)
class CapSpec:
    """One concurrency cap: live leases of this scope must stay below ``cap``."""

    scope: Scope
    cap: int
    field: str = dataclass_field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "field", f"{self.scope.field}|c")


@dataclass(frozen=True, slots=True)
class PlanShape:
    """What a tenant's limits require of one subject, whatever the request's size.

    It depends on the limits, the key and the model only, so the limiter builds it once
    and reuses it (``PlanCache``); the reservation is the only per-request part of a plan.
    """

    buckets: tuple[BucketSpec, ...]
    caps: tuple[CapSpec, ...]
    tokens_per_day: int | None
    tokens_per_month: int | None
    token_buckets: tuple[BucketSpec, ...] = dataclass_field(init=False, compare=False)
    # Whether the store records a lease: only caps and quotas have anything to free.
    holds_lease: bool = dataclass_field(init=False, compare=False)
    # Whether anything changes at settle: tokens to true up, slots or quota to free.
    needs_settle: bool = dataclass_field(init=False, compare=False)
    by_field: dict[str, BucketSpec] = dataclass_field(init=False, compare=False)

    def __post_init__(self) -> None:
        token_buckets = tuple(b for b in self.buckets if b.kind == "tokens")
        holds = bool(self.caps) or self.tokens_per_day is not None or self.tokens_per_month is not None
        object.__setattr__(self, "token_buckets", token_buckets)
        object.__setattr__(self, "holds_lease", holds)
        object.__setattr__(self, "needs_settle", holds or bool(token_buckets))
        object.__setattr__(self, "by_field", {b.field: b for b in self.buckets})


@dataclass(frozen=True, slots=True)
class AdmissionPlan:
    """Everything a store checks and records for one admission."""

    tenant: str
    reserve: int
    shape: PlanShape

    @property
    def buckets(self) -> tuple[BucketSpec, ...]:
        return self.shape.buckets

    @property
    def caps(self) -> tuple[CapSpec, ...]:
        return self.shape.caps

    @property
    def tokens_per_day(self) -> int | None:
        return self.shape.tokens_per_day

    @property
    def tokens_per_month(self) -> int | None:
        return self.shape.tokens_per_month

    @property
    def token_buckets(self) -> tuple[BucketSpec, ...]:
        return self.shape.token_buckets

    @property
    def holds_lease(self) -> bool:
        return self.shape.holds_lease

    @property
    def needs_settle(self) -> bool:
        return self.shape.needs_settle

    @property
    def empty(self) -> bool:
        return not (self.shape.buckets or self.shape.holds_lease)

    def cost(self, bucket: BucketSpec) -> int:
        """What this request charges ``bucket``: one request, or the reserved tokens."""
        return 1 if bucket.kind == "requests" else self.reserve

    def find_bucket(self, field: str) -> BucketSpec | None:
        return self.shape.by_field.get(field)

    def find_cap(self, field: str) -> CapSpec | None:
        return next((c for c in self.shape.caps if c.field == field), None)


def _share(value: int, share: int) -> int:
    # Never below 1: a fallback that locks a small tenant out entirely would be fail_closed.
    return max(value // share, 1)


def _scope_specs(scope: Scope, limits: ScopeLimits, reserve: int, share: int) -> tuple[list[BucketSpec], list[CapSpec]]:
    buckets: list[BucketSpec] = []
    caps: list[CapSpec] = []
    rpm, rburst = limits.requests_per_minute, limits.effective_request_burst
    if rpm is not None and rburst is not None:
        rpm, rburst = _share(rpm, share), _share(rburst, share)
        buckets.append(BucketSpec(scope, "requests", rpm, rburst, Rate.per_period(rpm, rburst)))
    tpm, tburst = limits.tokens_per_minute, limits.effective_token_burst
    if tpm is not None and tburst is not None:
        if share > 1:
            # A local share of the burst could be smaller than one request that fits the
            # shared bucket; let such a request through a full local bucket instead.
            tpm, tburst = _share(tpm, share), max(_share(tburst, share), min(reserve, tburst))
        buckets.append(BucketSpec(scope, "tokens", tpm, tburst, Rate.per_period(tpm, tburst)))
    if limits.max_concurrent is not None:
        caps.append(CapSpec(scope, _share(limits.max_concurrent, share)))
    return buckets, caps


def build_shape(
    subject: Subject, limits: TenantLimits, *, reserve: int = 0, fallback_share: int | None = None
) -> PlanShape:
    """Resolve the limits that apply to ``subject``.

    ``fallback_share=n`` builds the shape of one of ``n`` gateway processes deciding alone
    while the shared store is unreachable: rates and caps are divided by ``n``, and quotas
    are left out because a process cannot know what the others used today. Only that
    shape depends on ``reserve`` (a local token burst never refuses a request the shared
    bucket would fit).
    """
    share = max(fallback_share or 1, 1)
    scopes: list[tuple[Scope, ScopeLimits]] = [(Scope("tenant"), limits)]
    if subject.key_id is not None and subject.key_id in limits.per_key:
        scopes.append((Scope("key", subject.key_id), limits.per_key[subject.key_id]))
    if subject.model is not None and subject.model in limits.per_model:
        scopes.append((Scope("model", subject.model), limits.per_model[subject.model]))
    buckets: list[BucketSpec] = []
    caps: list[CapSpec] = []
    for scope, scope_limits in scopes:
        b, c = _scope_specs(scope, scope_limits, max(reserve, 0), share)
        buckets += b
        caps += c
    quotas = fallback_share is None
    return PlanShape(
        buckets=tuple(buckets),
        caps=tuple(caps),
        tokens_per_day=limits.tokens_per_day if quotas else None,
        tokens_per_month=limits.tokens_per_month if quotas else None,
    )


def build_plan(
    subject: Subject, limits: TenantLimits, reserve: int, *, fallback_share: int | None = None
) -> AdmissionPlan:
    """The plan of one admission (``build_shape`` says what ``fallback_share`` means)."""
    reserve = max(reserve, 0)
    shape = build_shape(subject, limits, reserve=reserve, fallback_share=fallback_share)
    return AdmissionPlan(subject.tenant, reserve, shape)


class PlanCache:
    """Shapes of the shared store's plans, built once per (limits, key, model).

    Keyed by the identity of the tenant's ``TenantLimits`` (immutable; a reload brings new
    objects, so stale shapes are never reused and age out when the cache is cleared).
    """

    def __init__(self, max_entries: int = 4096) -> None:
        self._shapes: dict[tuple[int, str | None, str | None], tuple[TenantLimits, PlanShape]] = {}
        self._max = max_entries

    def plan(self, subject: Subject, limits: TenantLimits, reserve: int) -> AdmissionPlan:
        # Only a key or model with limits of its own changes the shape.
        key_id = subject.key_id if subject.key_id in limits.per_key else None
        model = subject.model if subject.model in limits.per_model else None
        key = (id(limits), key_id, model)
        hit = self._shapes.get(key)
        if hit is None or hit[0] is not limits:
            if len(self._shapes) >= self._max:
                self._shapes.clear()
            hit = self._shapes[key] = (limits, build_shape(subject, limits))
        return AdmissionPlan(subject.tenant, max(reserve, 0), hit[1])
