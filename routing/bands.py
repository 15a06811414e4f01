"""Priority bands: which band a request waits in, from its tenant's band and what it asks.

A tenant has a band (``tenants[].band``, default the first, highest band); a request may
ask for a lower one with the ``x-fleetgate-band`` header (a batch job sent by an
interactive tenant), never a higher one: asking higher is clamped to the tenant's own band,
and the answer's ``x-fleetgate-band`` header and the access log say which band it got. An
unknown name is the client's mistake, answered 400 with the valid names. Bands are indexed
from 0 (highest); the index is also the ``priority`` sent to replicas that run vLLM's
priority scheduler, where a lower value is served earlier
(``vllm/v1/core/sched/request_queue.py``: ``PriorityRequestQueue`` orders by
``(priority, arrival_time)``, and preemption takes the largest).

Pure: plain values in, plain values out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from routing.band_queue import BandLimits
from routing.config import BandSettings


@dataclass(frozen=True, slots=True)
class Bands:
    """The configured bands, highest first, with each one's longest queue wait (None: by
    priority) and how often one of its streams may be preempted (None: never)."""

    names: tuple[str, ...]
    max_wait_s: tuple[float | None, ...]
    limits: tuple[BandLimits, ...]
    _index: dict[str, int] = field(repr=False, compare=False)
    max_preemptions: tuple[int | None, ...] = ()

    @classmethod
    def from_settings(cls, bands: Sequence[BandSettings]) -> Bands:
        names = tuple(b.name for b in bands)
        return cls(
            names,
            tuple(b.max_wait_s for b in bands),
            tuple(BandLimits(b.name, b.max_queued, b.capacity_share, b.preemptible) for b in bands),
            {n: i for i, n in enumerate(names)},
            tuple(b.max_preemptions if b.preemptible else None for b in bands),
        )

    @property
    def lowest(self) -> str:
        """The last, lowest band: the one bulk work (the Batch API's items) is sent in."""
        return self.names[-1]

    def index(self, name: str | None) -> int:
        """A configured band's index; None (unset): the first band. Raises KeyError when unknown."""
        return 0 if name is None else self._index[name]

    def resolve(self, tenant_band: int, asked: str | None) -> int | None:
        """The band a request waits in: its tenant's, or a lower one it asks for; a higher
        one asked is clamped to the tenant's. None: ``asked`` names no configured band."""
        if asked is None:
            return tenant_band
        band = self._index.get(asked)
        if band is None:
            band = self._index.get(asked.strip().lower())
            if band is None:
                return None
        return max(band, tenant_band)
