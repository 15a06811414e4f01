"""One model's pool: its replicas and what chooses among them.

A ``Pool`` holds the replicas serving one configured model (the fleet's own list, which
discovery updates in place) with the parts that decide for that model alone: its routing
policy, per-replica ``Capacity``, ``RetryBudget``, fair queue (``Admission``), fallback
models and ``PrefixIndex``. ``Pool.pick`` is one decision over plain state: a replica, or
none, with the policy's reason. The router builds one pool per model from ``PoolSpec``s;
``Route`` walks a request's pool and then its fallbacks' pools.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from replicas.replica import Replica
from routing.adapters import serving
from routing.admission import Admission
from routing.capacity import Capacity
from routing.config import AffinitySettings, CapacitySettings, PolicyName
from routing.policies import (
    Decision,
    LeastOutstandingTokens,
    LeastRequests,
    LoadBound,
    LoadModel,
    Policy,
    PrefixAffinity,
    RoundRobin,
    RouteRequest,
)
from routing.prefix_index import PrefixIndex
from routing.prefix_placement import AnchorPlacement
from routing.retry_budget import RetryBudget


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What the router needs to know about one configured model."""

    model: str
    tier: str
    fallback: tuple[str, ...] = ()
    capacity: CapacitySettings | None = None


def make_policy(
    name: PolicyName,
    rng: random.Random,
    load: LoadModel,
    affinity: AffinitySettings,
    members: Sequence[Replica] | None = None,
    index: PrefixIndex | None = None,
) -> Policy:
    """A fresh policy instance (each pool owns its own: round robin keeps a counter).

    ``members`` is the pool's own replica list (updated in place by discovery); ``index``
    its prefix index.
    """
    if name == "prefix_affinity":
        bound = LoadBound(affinity.factor, affinity.margin_requests)
        placement = AnchorPlacement(
            factor=affinity.placement_factor,
            slack=affinity.placement_slack,
            active_after=affinity.active_after,
            window_s=affinity.active_window_s,
            hot_share=affinity.hot_share,
            rate_window_s=affinity.rate_window_s,
        )
        return PrefixAffinity(rng, load, bound, affinity.anchor_blocks, placement, members, index)
    if name == "least_outstanding_tokens":
        return LeastOutstandingTokens(rng, load)
    if name == "least_requests":
        return LeastRequests(rng)
    if name == "round_robin":
        return RoundRobin()
    raise ValueError(f"unknown routing policy {name!r}")


class Pool:
    """One model's replicas with its policy, per-replica capacity, retry budget, fair queue and prefix index."""

    __slots__ = ("admission", "budget", "capacity", "fallback", "index", "model", "policy", "replicas")

    def __init__(
        self,
        model: str,
        replicas: list[Replica],
        policy: Policy,
        capacity: Capacity,
        budget: RetryBudget,
        admission: Admission,
        fallback: tuple[str, ...] = (),
        index: PrefixIndex | None = None,
    ) -> None:
        self.model = model
        # The fleet's own list, updated in place by discovery.
        self.replicas = replicas
        self.policy = policy
        self.capacity = capacity
        self.budget = budget
        self.admission = admission
        self.fallback = fallback
        # Where prefixes were sent (None when nothing hashes prompts: no estimate needed).
        self.index = index

    def pick(self, request: RouteRequest, now: float, exclude: Collection[str], adapter: str | None = None) -> Decision:
        """The policy's choice, among replicas with a free slot when some are full and others not.

        For a policy that keeps prefixes where they are cached (``Policy.keeps_prefixes``),
        among those where the request is worth sending: see ``_worth_diverting``. A request
        for a LoRA ``adapter`` chooses among the replicas that serve it only.
        """
        replicas = self.replicas if adapter is None else serving(self.replicas, adapter)
        if self.capacity.bounded:
            slots = self.capacity.slots
            roomy = [r for r in replicas if slots(r) > 0]
            if roomy and len(roomy) != len(replicas):
                if self.policy.keeps_prefixes:
                    roomy = self._worth_diverting(roomy, request, now, replicas)
                if roomy:
                    decision = self.policy.pick(roomy, request, now, exclude)
                    if decision.replica is not None:
                        return decision
        return self.policy.pick(replicas, request, now, exclude)

    def _worth_diverting(
        self, roomy: list[Replica], request: RouteRequest, now: float, replicas: Sequence[Replica]
    ) -> list[Replica]:
        """The replicas with room whose first token comes sooner than at a full one, caches counted.

        A replica full only for its prefill backlog (``routing.capacity``) would start the
        request's prefill after that backlog; one with room after its own. Elsewhere than
        where its prefix is cached (by the pool's prefix index), the request prefills the
        prefix again, and under KV pressure its copy evicts another prompt's prefix, whose
        next request prefills that again: so the uncached tokens a replica adds count twice.
        A replica with room is worth it when its backlog plus that cost is less than the
        best full replica's backlog plus the request's own prefill there. Diverting to any
        replica with room instead would, request by request, put every prefix in every
        cache, where under KV pressure they evict one another (docs/routing.md, "Replica
        choice"). A long queue behind a document still sends a short chat turn elsewhere,
        and a hot prefix spreads to the replicas holding it. A replica full under a hard
        limit (requests, tokens) is no option: every replica with room is.
        """
        index = self.index
        if (index is None or not request.prefix_keys) and request.exact is None:
            return roomy
        capacity = self.capacity
        backlog = capacity.prefill_backlog
        uncached = {r.id: request.uncached_on(r.id, index) for r in replicas}
        fewest = min(uncached.values())
        names = {r.id for r in roomy}
        full = [r for r in replicas if r.id not in names and r.routable(now)]
        if not full or any(capacity.slots(r, prefill=False) <= 0 for r in full):
            return roomy
        wait = min(backlog(r) + uncached[r.id] for r in full)
        return [r for r in roomy if backlog(r) + 2 * uncached[r.id] - fewest < wait]
