"""How much more work a replica takes before new requests should wait at the gateway.

A vLLM replica past ``max_num_seqs`` running sequences, or with its KV cache full, queues
new requests itself, first come first served, whoever sent them: one tenant's flood then
delays everyone. The gateway holds requests back instead, in its fair queue, once every
replica of a pool is at capacity. Capacity is counted in request slots:

- requests: ``max_requests - (own + foreign)``. ``own`` is this gateway's in-flight
  requests on the replica; ``foreign`` what the last scrape showed beyond our own at that
  moment, i.e. what other gateway pods sent (``Replica.observe``).
- prefill, when ``max_prefill_tokens`` is set: a replica whose prefill backlog is at or
  past it is full, otherwise it has one slot. The backlog is this gateway's streamed
  requests still waiting for their first token (their uncached prompt tokens) plus a
  typical request's tokens for each request the replica reported waiting that is not ours.
  vLLM prefills first come first served, so a request sent to a replica behind a backlog
  of B tokens gets its first token no sooner than B tokens of prefill later: bounding B
  (by default to half a step of vLLM's 8,192-token chunked prefill) bounds that wait,
  while the replica always has its next prompt queued. One slot, not several: the size of
  the next waiting request is not known here, so room is handed out one request per
  replica and counted again once it has been claimed.
- tokens, when ``max_outstanding_tokens`` is set: the room left under it, measured with
  ``LoadModel.effective_load`` (own outstanding tokens, foreign work, KV pressure), divided
  by a typical request's tokens and rounded up.

The smallest is the replica's free slots. Pure: the caller passes the fleet's state and the
time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from replicas.replica import GAUGE_KV_CAPACITY_TOKENS, Replica
from routing.policies import LoadModel

# "No bound": more slots than any pool will ever be asked for.
UNBOUNDED = 1 << 30


@dataclass(frozen=True, slots=True)
class Capacity:
    """Per-replica limits of one pool (None: that dimension is unbounded)."""

    max_requests: int | None = 256
    max_outstanding_tokens: int | None = None
    max_prefill_tokens: int | None = None
    load: LoadModel = field(default_factory=LoadModel)
    # The replicas' KV cache in tokens, when configured (else each replica's scraped figure).
    kv_cache_tokens: int | None = None
    # A preemptible band's capacity: a replica running preempting work has no room for it
    # (``routing.preemption``), so its queued requests wait for another replica instead.
    yields: bool = False

    def kv_tokens(self, replica: Replica) -> int | None:
        """How many tokens ``replica``'s prefix cache holds: configured, scraped, or unknown."""
        if self.kv_cache_tokens is not None:
            return self.kv_cache_tokens
        scraped = replica.gauges.get(GAUGE_KV_CAPACITY_TOKENS)
        return int(scraped) if scraped else None

    @property
    def bounded(self) -> bool:
        return (
            self.max_requests is not None
            or self.max_outstanding_tokens is not None
            or self.max_prefill_tokens is not None
        )

    def prefill_backlog(self, replica: Replica) -> float:
        """Prompt tokens ``replica`` must compute before a request sent now starts its own prefill."""
        return replica.prefill_tokens + self.load.tokens_per_request * replica.foreign_waiting

    def slots(self, replica: Replica, prefill: bool = True) -> int:
        """Requests ``replica`` can still take before it is at capacity (0: full).

        ``prefill=False``: under the hard limits alone, the prefill bound left out.
        """
        if self.yields and replica.preempting:
            return 0
        free = UNBOUNDED
        if self.max_requests is not None:
            free = self.max_requests - int(self.load.requests(replica))
            if free <= 0:
                return 0
        if self.max_outstanding_tokens is not None:
            room = self.max_outstanding_tokens - self.load.effective_load(replica)
            if room <= 0:
                return 0
            per_request = max(1, self.load.tokens_per_request)
            free = min(free, math.ceil(room / per_request))
        if prefill and self.max_prefill_tokens is not None:
            if self.prefill_backlog(replica) >= self.max_prefill_tokens:
                return 0
            free = min(free, 1)
        return free


def free_slots(replicas: Sequence[Replica], capacity: Capacity, now: float) -> int | None:
    """Free slots over the routable replicas; None when none is routable (not a capacity matter)."""
    total = 0
    routable = False
    for replica in replicas:
        if replica.routable(now):
            routable = True
            total += capacity.slots(replica)
    return min(total, UNBOUNDED) if routable else None


def has_room(replicas: Sequence[Replica], capacity: Capacity, now: float) -> bool:
    """Whether some routable replica has a free slot, or none is routable (the proxy answers that).

    Stops at the first replica with room: on an unsaturated pool this is one or two checks.
    """
    routable = False
    for replica in replicas:
        if replica.routable(now):
            if capacity.slots(replica) > 0:
                return True
            routable = True
    return not routable
