"""Fair admission to one pool: a counter check while there is room, a fair queue when there is not.

The asyncio edge around the pure ``FairQueue``. ``ready(now)`` is the hot path: nothing
waiting, nobody being woken, and some replica of the pool with a free slot (``capacity``),
so the request goes straight on: no future, no task, no timer. Otherwise ``wait`` parks the
request on a future in its tenant's queue until a slot frees up, served in weighted
deficit round-robin order, or until its deadline (503) or a full queue (429) refuses it.

Slots free up when a request of this gateway finishes (``notify``, called once per
finished request) and when the scraped gauges show other gateway pods' work draining; for
the latter, and for deadlines, one timer per pool runs while its queue is not empty.

Prefill share: when the pool's capacity bounds the prefill backlog, each replica holds one
prefill at a time, so the pool has one prefill slot per routable replica. While two or more
tenants are active (a request queued, or one of theirs still before its first token), a
tenant already holding its weighted share of those slots is held back (``FairQueue.pop``'s
``held``): the slots it leaves stay free for the others instead of being refilled with its
backlog at once. Work-conserving refill would keep every replica's steps full of one
tenant's prefill chunks, and every other tenant's prefill and decoding would run in those
long steps. A tenant alone gets every slot.

Priority bands (``routing.band_queue``): the queue holds one WDRR queue per band and
serves them in strict order, so while the pool is saturated a lower band's request waits
until no higher band's does. The prefill share is counted among the tenants of the highest
band with work: a tenant of a lower band still in its prefill holds no share of the slots
a higher band's tenants divide (it frees its slot when its prefill ends, and the lower band
gets the next one only when the higher bands have none waiting). A band may fill only a
share of each replica's capacity (``BandLimits.capacity_share``): its requests see the pool
as full earlier, so room stays free for the bands above it, whose requests then start at
once instead of after a lower band's request ends. A request goes straight on when no
request of its own band or a higher one waits and its band's capacity has room: a lower
band's backlog does not close the fast path to a higher band's requests. A preemptible
band (``routing.preemption``) finds no room on a replica running preempting work: its
queued requests wait for another replica rather than start beside that work.

Accounting: a woken request has a slot promised but has not claimed its replica yet
(``_waking``); those promises count against the free slots, and the fast path stays closed
while any is pending, so a newcomer cannot take the slot a woken request is about to use.
A request that leaves while queued (client gone) is taken out of the queue; one that leaves
after it was woken hands its slot to the next. Nothing is leaked either way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from replicas.replica import Replica
from routing.band_queue import SINGLE_BAND, BandedQueue, BandLimits, BandTicket
from routing.capacity import UNBOUNDED, Capacity, free_slots, has_room
from routing.fair_queue import FairQueueConfig, Rejected, RejectReason
from routing.preemption import preempting_bands

Waiter = asyncio.Future[Rejected | None]
# What waits in the fair queue: the tenant (for the prefill share) and its future.
Waiting = tuple[str, Waiter]
# Who holds a prefill slot or a promised one: (band, tenant).
Holder = tuple[int, str]


@dataclass(frozen=True, slots=True)
class Admitted:
    """The request may go on; it waited this long first."""

    waited_s: float


class Admission:
    """The fair admission queue of one model's pool."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        capacity: Capacity,
        config: FairQueueConfig,
        *,
        weights: dict[str, float] | None = None,
        clock: Callable[[], float],
        poll_interval_s: float = 0.05,
        enabled: bool = True,
        share_prefill: bool = True,
        bands: Sequence[BandLimits] = SINGLE_BAND,
    ) -> None:
        # The fleet's own list (updated in place by discovery): always the current replicas.
        self._replicas = replicas
        self._capacity = capacity
        self._config = config
        self._clock = clock
        self._poll_s = poll_interval_s
        self.enabled = enabled and capacity.bounded
        self._share_prefill = share_prefill and capacity.max_prefill_tokens is not None
        self._queue: BandedQueue[Waiting] = BandedQueue(bands, config, weights)
        # The capacity each band's requests may fill: the pool's, or its share of it.
        self._capacities = tuple(_share(capacity, b.capacity_share, b.preemptible) for b in bands)
        # By band: whether its requests preempt, and whether it gives way (``routing.preemption``).
        self._preemptible = tuple(b.preemptible for b in bands)
        self._preempting = preempting_bands(self._preemptible)
        self._queued = 0
        self._waking = 0
        self._timer: asyncio.TimerHandle | None = None
        # By (band, tenant): streamed requests sent to this pool's replicas and not yet past
        # their first token, and requests woken but not yet back from ``wait`` (about to claim).
        self._prefilling: dict[Holder, int] = {}
        self._woken: dict[Holder, int] = {}

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def waking(self) -> int:
        return self._waking

    def depths(self) -> dict[str, int]:
        return self._queue.depths()

    def band_depths(self) -> dict[str, dict[str, int]]:
        """Requests waiting now by band name, then tenant."""
        return self._queue.band_depths()

    def set_weight(self, tenant: str, weight: float) -> None:
        self._queue.set_weight(tenant, weight)

    def preempting(self, band: int) -> bool:
        """Whether ``band``'s requests preempt a lower, preemptible band's streams."""
        return self._preempting[band]

    def preemptible(self, band: int) -> bool:
        """Whether ``band``'s streams give way to preempting requests."""
        return self._preemptible[band]

    def ready(self, now: float, band: int = 0) -> bool:
        """The fast path: go straight on (nothing queued in ``band`` or above, nothing being
        woken, and a slot free within the band's capacity)."""
        if not self.enabled:
            return True
        if self._waking or (self._queued and self._queue.waiting_through(band)):
            return False
        return has_room(self._replicas, self._capacities[band], now)

    async def wait(self, tenant: str, cost: int, deadline: float, band: int = 0) -> Admitted | Rejected:
        """Queue in ``band`` until a slot is free: ``Admitted``, or ``Rejected`` (the tenant's
        or the band's backlog full / deadline passed).

        The caller must claim its replica without awaiting anything after an ``Admitted``:
        the slot is promised to it until then.
        """
        now = self._clock()
        waiter: Waiter = asyncio.get_running_loop().create_future()
        ticket = self._queue.push(band, tenant, (tenant, waiter), cost, now, deadline)
        if isinstance(ticket, Rejected):
            return ticket
        self._queued += 1
        self._pump(now)  # a slot may be free already (the fast path was closed by others waiting)
        self._arm(now)
        try:
            outcome = await waiter
        except asyncio.CancelledError:
            self._abandon(ticket, waiter)
            raise
        if outcome is not None:
            return outcome
        self._unwake((band, tenant))
        return Admitted(self._clock() - now)

    def notify(self) -> None:
        """A request of this pool finished: its slot may go to the next waiting one."""
        if self._queued:
            self._pump(self._clock())

    def prefill_started(self, tenant: str, band: int = 0) -> None:
        """A streamed request of ``tenant`` (in ``band``) was sent to a replica of this pool."""
        key = (band, tenant)
        self._prefilling[key] = self._prefilling.get(key, 0) + 1

    def prefill_ended(self, tenant: str, band: int = 0) -> None:
        """That request had its first token, or ended without one: its prefill slot is free."""
        key = (band, tenant)
        left = self._prefilling.get(key, 0) - 1
        if left > 0:
            self._prefilling[key] = left
        else:
            self._prefilling.pop(key, None)
        self.notify()

    def poll(self) -> None:
        """Re-check room and deadlines now (the timer does this while requests wait)."""
        self._timer = None
        now = self._clock()
        self._pump(now)
        self._arm(now)

    def close(self) -> None:
        """Stop the timer and refuse everyone still waiting (shutdown)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._expire(float("inf"))

    def _pump(self, now: float) -> None:
        self._expire(now)
        if not self._queued:
            return
        top: int | None = -1
        held: Callable[[str], bool] | None = None
        room = 0
        while self._queued:
            # Room (within the band's capacity) and the prefill share are those of the band
            # now served: counted again when it changes, and when its room runs out.
            band = self._queue.top()
            if band is None:
                break
            if band != top or room <= 0:
                top = band
                held = self._held(now)
                slots = free_slots(self._replicas, self._capacities[band], now)
                # No routable replica is not a capacity matter: let them through to get their
                # 503 (or their fallback model) now rather than after a full wait.
                room = UNBOUNDED if slots is None else slots - self._waking
                if room <= 0:
                    break
            popped = self._queue.pop(now, held)
            if popped is None:
                break
            band, (tenant, waiter) = popped
            self._queued -= 1
            if waiter.done():  # its client left; the future was cancelled with the task
                continue
            waiter.set_result(None)
            self._waking += 1
            key = (band, tenant)
            self._woken[key] = self._woken.get(key, 0) + 1
            room -= 1
        self._expire(now)  # heads that pop() found past their deadline

    def _held(self, now: float) -> Callable[[str], bool] | None:
        """Tenants of the highest band with work at their share of the pool's prefill slots,
        while other tenants of that band are active (None: none held)."""
        if not self._share_prefill:
            return None
        band = self._queue.top()
        if band is None:
            return None
        active = self._queue.tenants_in(band)
        active.update(t for b, t in self._prefilling if b == band)
        active.update(t for b, t in self._woken if b == band)
        if len(active) < 2:
            return None
        slots = sum(1 for r in self._replicas if r.routable(now))
        if not slots:  # nothing routable: let them through to their 503 or fallback
            return None
        total = sum(self._queue.weight(t) for t in active)
        prefilling, woken, weight = self._prefilling, self._woken, self._queue.weight

        def held(tenant: str) -> bool:
            key = (band, tenant)
            taken = prefilling.get(key, 0) + woken.get(key, 0)
            return taken >= max(1, math.ceil(slots * weight(tenant) / total))

        return held

    def _expire(self, now: float) -> None:
        for _, (_, waiter) in self._queue.expire(now):
            self._queued -= 1
            if not waiter.done():
                waiter.set_result(Rejected(RejectReason.WAIT_EXCEEDED, self._config.retry_after_s))

    def _abandon(self, ticket: BandTicket[Waiting], waiter: Waiter) -> None:
        if waiter.cancelled() or not waiter.done():
            if self._queue.cancel(ticket):
                self._queued -= 1
        elif waiter.result() is None:
            # Woken, but gone before claiming: the promised slot goes to the next one.
            self._unwake((ticket.band, ticket.tenant))
            self._pump(self._clock())

    def _unwake(self, key: Holder) -> None:
        self._waking -= 1
        left = self._woken[key] - 1
        if left:
            self._woken[key] = left
        else:
            del self._woken[key]

    def _arm(self, now: float) -> None:
        if self._timer is not None or not self._queued:
            return
        delay = self._poll_s
        deadline = self._queue.next_deadline()
        if deadline is not None:
            delay = max(0.0, min(delay, deadline - now))
        self._timer = asyncio.get_running_loop().call_later(delay, self.poll)


def _share(capacity: Capacity, share: float, yields: bool = False) -> Capacity:
    """``capacity`` scaled to ``share`` of each bound (at least one request, one token);
    ``yields``: a preemptible band's, with no room on a replica running preempting work."""
    if yields:
        capacity = dataclasses.replace(capacity, yields=True)
    if share >= 1.0:
        return capacity

    def scaled(bound: int | None) -> int | None:
        return None if bound is None else max(1, math.floor(bound * share))

    return dataclasses.replace(
        capacity,
        max_requests=scaled(capacity.max_requests),
        max_outstanding_tokens=scaled(capacity.max_outstanding_tokens),
        max_prefill_tokens=scaled(capacity.max_prefill_tokens),
    )
