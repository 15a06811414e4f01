"""Weighted deficit round-robin (WDRR) over per-tenant FIFO queues: pure, clock passed in.

When every replica of a pool is at capacity, requests wait here. Each tenant has a FIFO
queue and a weight; each round a backlogged tenant earns ``quantum * weight`` tokens of
credit (its deficit) and is served, in arrival order, while its head request costs no
more than that credit. Served cost therefore tracks the weights whatever the request
sizes (Shreedhar and Varghese, "Efficient fair queuing using deficit round robin", 1995),
and a tenant that floods its own queue only lengthens its own wait: every other tenant is
visited once per round.

Rejections are values: ``push`` returns ``Rejected`` when the tenant's queue is full,
and ``expire`` hands back requests that waited past their deadline, so the caller can
answer 429 / 503 with ``Retry-After``. The asyncio part (parking a request on a future,
waking it when a replica frees up) lives at the edge, not here.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

T = TypeVar("T")

# A quantum of one typical request's tokens keeps pop() O(1) amortised: most tenants
# can send their head request in their first visit of a round.
DEFAULT_QUANTUM_TOKENS = 1024
DEFAULT_MAX_QUEUE_LENGTH = 256
# Retry-After for a full queue: long enough for a round of a busy pool to drain.
DEFAULT_RETRY_AFTER_S = 1.0


class RejectReason(StrEnum):
    """Why a request was not queued or not served; ``status`` is the HTTP answer."""

    QUEUE_FULL = "queue_full"  # this tenant's own backlog: 429, slow down
    BAND_FULL = "band_full"  # its priority band's backlog in this pool (routing.band_queue): 429
    WAIT_EXCEEDED = "wait_exceeded"  # the pool could not serve in time: 503

    @property
    def status(self) -> int:
        return 503 if self is RejectReason.WAIT_EXCEEDED else 429


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: RejectReason
    retry_after_s: float


@dataclass(eq=False, slots=True)
class Ticket(Generic[T]):
    """One queued request; keep it to ``cancel`` (client gone) or to match ``expire``."""

    tenant: str
    item: T
    cost: int
    enqueued_at: float
    deadline: float
    live: bool = True


@dataclass(slots=True)
class _Tenant(Generic[T]):
    name: str
    weight: float
    queue: deque[Ticket[T]] = field(default_factory=deque)
    live: int = 0
    deficit: float = 0.0


@dataclass(frozen=True, slots=True)
class FairQueueConfig:
    """Quantum in tokens per unit of weight per round; per-tenant queue bound; default weight."""

    quantum_tokens: int = DEFAULT_QUANTUM_TOKENS
    max_queue_length: int = DEFAULT_MAX_QUEUE_LENGTH
    default_weight: float = 1.0
    retry_after_s: float = DEFAULT_RETRY_AFTER_S


class FairQueue(Generic[T]):
    """WDRR scheduler. Not thread-safe; one per pool, driven from one event loop."""

    def __init__(self, config: FairQueueConfig | None = None, weights: dict[str, float] | None = None) -> None:
        self._config = config or FairQueueConfig()
        self._weights = dict(weights or {})
        self._tenants: dict[str, _Tenant[T]] = {}
        # Tenants with live work, in round order; the head is the one being served.
        self._active: deque[str] = deque()
        # Whether the head tenant already got its quantum for the current visit.
        self._head_credited = False
        self._deadlines: list[tuple[float, int, Ticket[T]]] = []
        self._seq = itertools.count()
        self._expired: list[Ticket[T]] = []

    def __len__(self) -> int:
        return sum(t.live for t in self._tenants.values())

    def queued(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return state.live if state else 0

    def depths(self) -> dict[str, int]:
        """Live queued requests by tenant (every tenant seen so far, zeros included: for a gauge)."""
        return {name: state.live for name, state in self._tenants.items()}

    def set_weight(self, tenant: str, weight: float) -> None:
        """Change a tenant's weight (config reload); applies from its next visit."""
        if weight <= 0:
            raise ValueError("weight must be positive")
        self._weights[tenant] = weight
        if tenant in self._tenants:
            self._tenants[tenant].weight = weight

    def push(self, tenant: str, item: T, cost: int, now: float, deadline: float) -> Ticket[T] | Rejected:
        """Queue ``item`` for ``tenant``; ``Rejected`` when that tenant's queue is full."""
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant(tenant, self._weights.get(tenant, self._config.default_weight))
        if state.live >= self._config.max_queue_length:
            return Rejected(RejectReason.QUEUE_FULL, self._config.retry_after_s)
        ticket = Ticket(tenant, item, max(1, cost), now, deadline)
        state.queue.append(ticket)
        state.live += 1
        if state.live == 1:
            self._active.append(tenant)
        heapq.heappush(self._deadlines, (deadline, next(self._seq), ticket))
        return ticket

    def cancel(self, ticket: Ticket[T]) -> bool:
        """Drop a queued request (its client went away); False if it already left the queue."""
        if not ticket.live:
            return False
        self._retire(ticket)
        return True

    def weight(self, tenant: str) -> float:
        """``tenant``'s weight (its configured one, or the default)."""
        state = self._tenants.get(tenant)
        return state.weight if state else self._weights.get(tenant, self._config.default_weight)

    def pop(self, now: float, held: Callable[[str], bool] | None = None) -> T | None:
        """The next item in WDRR order, or None when nothing live is queued.

        Items past their deadline are not served; they are set aside for ``expire``.
        ``held``: tenants not to serve now (they keep their place and credit, and earn
        none while held); None when every tenant with something queued is held.
        """
        idle_visits = held_visits = 0
        while self._active:
            name = self._active[0]
            state = self._tenants[name]
            head = self._live_head(state, now)
            if head is None:  # emptied by expiry or cancellation
                self._leave_round(state)
                continue
            if held is not None and held(name):
                held_visits += 1
            else:
                if not self._head_credited:
                    state.deficit += self._config.quantum_tokens * state.weight
                    self._head_credited = True
                if head.cost <= state.deficit:
                    state.deficit -= head.cost
                    state.queue.popleft()
                    head.live = False
                    state.live -= 1
                    if state.live == 0:
                        self._leave_round(state)
                    return head.item
                idle_visits += 1  # not enough credit: its visit is over, it keeps its deficit
            self._active.rotate(-1)
            self._head_credited = False
            if idle_visits + held_visits >= len(self._active):
                if not idle_visits:
                    return None
                self._skip_idle_rounds(held)
                idle_visits = held_visits = 0
        return None

    def expire(self, now: float) -> list[T]:
        """Items whose deadline has passed, removed from the queue (answer them 503)."""
        out = [t.item for t in self._expired]
        self._expired.clear()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, ticket = heapq.heappop(self._deadlines)
            if ticket.live:
                self._retire(ticket)
                out.append(ticket.item)
        return out

    def next_deadline(self) -> float | None:
        """When the earliest queued item expires (for the edge's timer), if any."""
        while self._deadlines and not self._deadlines[0][2].live:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def _live_head(self, state: _Tenant[T], now: float) -> Ticket[T] | None:
        while state.queue:
            head = state.queue[0]
            if not head.live:
                state.queue.popleft()
            elif head.deadline <= now:
                self._retire(head)
                self._expired.append(head)
            else:
                return head
        return None

    def _retire(self, ticket: Ticket[T]) -> None:
        # Lazy removal: the ticket stays in its deque until it reaches the head.
        ticket.live = False
        state = self._tenants[ticket.tenant]
        state.live -= 1
        if state.live == 0:
            state.queue.clear()
            self._leave_round(state)

    def _leave_round(self, state: _Tenant[T]) -> None:
        # An idle tenant keeps no credit (DRR): saving it up would let a burst overrun others.
        state.deficit = 0.0
        name = state.name
        if name not in self._active:
            return
        if self._active[0] == name:
            self._active.popleft()
            self._head_credited = False
        else:
            self._active.remove(name)

    def _skip_idle_rounds(self, held: Callable[[str], bool] | None) -> None:
        """Credit whole rounds at once when no head fits, instead of looping quantum by quantum."""
        serving = [n for n in self._active if held is None or not held(n)]
        rounds = min((_rounds_needed(self._tenants[n], self._config.quantum_tokens) for n in serving), default=1)
        if rounds > 1:
            for name in serving:
                state = self._tenants[name]
                state.deficit += (rounds - 1) * self._config.quantum_tokens * state.weight


def _rounds_needed(state: _Tenant[T], quantum: int) -> int:
    head = next((t for t in state.queue if t.live), None)
    if head is None:
        return 1
    missing = head.cost - state.deficit
    per_round = quantum * state.weight
    return max(1, int(-(-missing // per_round)))
