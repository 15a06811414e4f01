"""Priority bands over the weighted fair queue: strict order between bands, WDRR inside each.

Bands are ordered highest first (``bands: [interactive, standard, batch]``). Each band has
its own ``FairQueue``, so tenants share a band by their weights exactly as they share the
whole pool without bands; between bands the order is strict: nothing of a lower band is
served while a higher band has a request waiting that may be served. A higher band whose
waiting tenants are all held back (the prefill share, ``FairQueue.pop``'s ``held``) does
not hand its turn down either: those slots are left free for that band's own tenants, which
is what holding back is for. Strict order can starve a lower band for as long as higher
bands keep the pool saturated; that is the point (the batch band runs on idle capacity),
and each band's longest wait and backlog bound (``BandLimits``) shed it with a 429/503
instead of letting it pile up.

Pure like ``FairQueue``: time comes in as arguments, rejections are values; the asyncio
part lives in ``routing.admission``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from routing.fair_queue import FairQueue, FairQueueConfig, Rejected, RejectReason, Ticket

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class BandLimits:
    """One band: its name; how many of its requests may wait in one pool, all tenants
    together (None: only the per-tenant bound, ``FairQueueConfig.max_queue_length``); and the
    share of each replica's capacity its requests may fill (``routing.admission``: the rest
    is kept free for higher bands); whether its streams give way to higher bands' work
    (``routing.preemption``)."""

    name: str
    max_queued: int | None = None
    capacity_share: float = 1.0
    preemptible: bool = False


# Without a ``bands`` setting a pool has one band: the queue is then exactly ``FairQueue``.
SINGLE_BAND = (BandLimits("default"),)


@dataclass(eq=False, slots=True)
class BandTicket(Generic[T]):
    """A queued request and the band it waits in (for ``cancel``)."""

    band: int
    ticket: Ticket[T]

    @property
    def tenant(self) -> str:
        return self.ticket.tenant


class BandedQueue(Generic[T]):
    """One ``FairQueue`` per band, served in band order. Not thread-safe; one per pool."""

    def __init__(
        self,
        bands: Sequence[BandLimits] = SINGLE_BAND,
        config: FairQueueConfig | None = None,
        weights: dict[str, float] | None = None,
    ) -> None:
        if not bands:
            raise ValueError("at least one band")
        self._config = config or FairQueueConfig()
        self._limits = tuple(bands)
        self._queues: tuple[FairQueue[T], ...] = tuple(FairQueue(self._config, weights) for _ in bands)
        # Live requests by band (``FairQueue.__len__`` sums over tenants; this is read per pop).
        self._live = [0] * len(bands)

    @property
    def bands(self) -> tuple[str, ...]:
        return tuple(b.name for b in self._limits)

    def __len__(self) -> int:
        return sum(self._live)

    def queued(self, band: int) -> int:
        """Live requests waiting in ``band`` (index, highest band 0)."""
        return self._live[band]

    def waiting_through(self, band: int) -> bool:
        """Whether a request waits in ``band`` or any higher one."""
        live = self._live
        return any(live[b] for b in range(band + 1))

    def top(self) -> int | None:
        """The highest band with a request waiting, or None."""
        for band, n in enumerate(self._live):
            if n:
                return band
        return None

    def depths(self) -> dict[str, int]:
        """Live queued requests by tenant, all bands together (every tenant seen: for a gauge)."""
        out: dict[str, int] = {}
        for q in self._queues:
            for tenant, n in q.depths().items():
                out[tenant] = out.get(tenant, 0) + n
        return out

    def band_depths(self) -> dict[str, dict[str, int]]:
        """Live queued requests by band name, then tenant."""
        return {limits.name: q.depths() for limits, q in zip(self._limits, self._queues, strict=True)}

    def tenants_in(self, band: int) -> set[str]:
        """Tenants with a request waiting in ``band``."""
        return {t for t, n in self._queues[band].depths().items() if n}

    def weight(self, tenant: str) -> float:
        return self._queues[0].weight(tenant)

    def set_weight(self, tenant: str, weight: float) -> None:
        """A tenant's weight in every band (its share inside whichever band it asks for)."""
        for q in self._queues:
            q.set_weight(tenant, weight)

    def push(self, band: int, tenant: str, item: T, cost: int, now: float, deadline: float) -> BandTicket[T] | Rejected:
        """Queue ``item`` in ``band``; ``Rejected`` when the band's or the tenant's backlog is full."""
        bound = self._limits[band].max_queued
        if bound is not None and self._live[band] >= bound:
            return Rejected(RejectReason.BAND_FULL, self._config.retry_after_s)
        ticket = self._queues[band].push(tenant, item, cost, now, deadline)
        if isinstance(ticket, Rejected):
            return ticket
        self._live[band] += 1
        return BandTicket(band, ticket)

    def cancel(self, ticket: BandTicket[T]) -> bool:
        """Drop a queued request (its client went away); False if it already left the queue."""
        if self._queues[ticket.band].cancel(ticket.ticket):
            self._live[ticket.band] -= 1
            return True
        return False

    def pop(self, now: float, held: Callable[[str], bool] | None = None) -> tuple[int, T] | None:
        """The next item and its band: the highest band with work, WDRR inside it.

        None when nothing live is queued, or when the highest band with work has only held
        tenants (a lower band does not take its turn). Items found past their deadline are
        set aside for ``expire``, and the next band with work is tried.
        """
        for band, q in enumerate(self._queues):
            if not self._live[band]:
                continue
            item = q.pop(now, held)
            # Recounted: the pop may also have set aside heads past their deadline.
            self._live[band] = len(q)
            if item is not None:
                return band, item
            if self._live[band]:  # work left, all of it held back: the turn stays here
                return None
            # Everything left in this band had expired: the next band's turn.
        return None

    def expire(self, now: float) -> list[tuple[int, T]]:
        """Items whose deadline has passed, with their bands, removed from the queue."""
        out: list[tuple[int, T]] = []
        for band, q in enumerate(self._queues):
            gone = q.expire(now)
            if gone:
                out.extend((band, item) for item in gone)
                self._live[band] = len(q)
        return out

    def next_deadline(self) -> float | None:
        """When the earliest queued item of any band expires, if any."""
        deadlines = [d for q in self._queues if (d := q.next_deadline()) is not None]
        return min(deadlines) if deadlines else None
