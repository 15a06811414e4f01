"""The router: tier choice for ``auto``, one pool per model, and each request's ``Route``.

Built once from configuration. Per request, the gateway asks ``choose_tier`` (classified
requests only; first ``text_to_embed``, whose embedding it fetches when there is one to
fetch), then ``route`` for a ``Route``: the proxy's picker for that request. A
``Route`` walks the request's model pool first and then that model's fallback chain
(``models[].fallback``, in order, not followed transitively), asking each pool's policy
for a replica not yet tried; it builds the policy's view of the request (``RouteRequest``,
with prefix keys only when something uses them) once, on the first pick, so a request
answered from the cache or refused by limits never pays for it. Each choice is recorded in
the pool's ``PrefixIndex``, which estimates how much of the prompt the chosen replica
still has cached: the prefill the request's ``Claim`` charges it. ``Route.next_attempt`` is
the one retry decision: a replica for the next attempt, or why there is none (no candidate
left, the request's deadline passed, or the primary pool's ``RetryBudget`` has no credit).

Nothing here awaits: the waiting (fair queue) is ``routing.admission``, the sending is
``gateway.proxy``.
"""

from __future__ import annotations

import bisect
import functools
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from dialects.base import PromptView
from replicas.replica import Claim, Replica
from routing.adapters import serving
from routing.admission import Admission
from routing.capacity import Capacity
from routing.classifier import Classification, classify, resolve_tier
from routing.config import AffinitySettings, CapacitySettings, EmbeddingUse, PolicyName, RoutingSettings
from routing.embedding_head import EmbeddingHead, embedding_text
from routing.fair_queue import FairQueueConfig
from routing.metrics import RoutingMetrics
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
    conversation_key,
    opening,
    prefix_keys,
    session_hash,
)
from routing.prefix_index import PrefixIndex
from routing.prefix_placement import AnchorPlacement
from routing.retry_budget import RetryBudget
from routing.static_head import StaticHead, default_static_head
from routing.tier_map import TierMap
from routing.word_frequency import default_word_frequency

# Completion tokens assumed owed when a request sets no max_tokens (routing estimate only).
DEFAULT_COMPLETION_ESTIMATE = 256

# Why a request gets no (further) attempt (``Route.next_attempt``).
Stop = Literal["no_replica", "exhausted", "deadline", "retry_budget"]
NO_REPLICA: Stop = "no_replica"
EXHAUSTED: Stop = "exhausted"
DEADLINE: Stop = "deadline"
RETRY_BUDGET: Stop = "retry_budget"


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What the router needs to know about one configured model."""

    model: str
    tier: str
    fallback: tuple[str, ...] = ()
    capacity: CapacitySettings | None = None


@dataclass(frozen=True, slots=True)
class TierChoice:
    """The tier of a classified request, why (``classified``, ``forced``, ``force_denied``), and its model."""

    model: str
    tier: str
    reason: str
    classification: Classification

    def header(self) -> str:
        """The ``x-fleetgate-route`` debug header: ``score=0.62; reasoning,long_prompt; tier=large; classified``."""
        return f"{self.classification.header()}; tier={self.tier}; {self.reason}"


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
        best full replica's backlog plus the request's own prefill there. Sent anyway, a
        few such diversions in a hundred requests made every cache hold every prefix and
        thrash under KV pressure (``bench/results/routing-vllm.md``); a long queue behind a
        document still sends a short chat turn elsewhere, and a hot prefix spreads to the
        replicas holding it. A replica full under a hard limit (requests, tokens) is no
        option: every replica with room is.
        """
        index, keys = self.index, request.prefix_keys
        if index is None or not keys:
            return roomy
        capacity = self.capacity
        backlog = capacity.prefill_backlog
        uncached = {r.id: request.uncached_tokens(index.depth(keys, r.id)) for r in replicas}
        fewest = min(uncached.values())
        names = {r.id for r in roomy}
        full = [r for r in replicas if r.id not in names and r.routable(now)]
        if not full or any(capacity.slots(r, prefill=False) <= 0 for r in full):
            return roomy
        wait = min(backlog(r) + uncached[r.id] for r in full)
        return [r for r in roomy if backlog(r) + 2 * uncached[r.id] - fewest < wait]


class Route:
    """One request's way to a replica; the proxy's picker (``route(exclude)``).

    Also what the access log and the debug header say about it: the tier choice, the last
    policy decision, the fallback model used, queueing and degradation.
    """

    __slots__ = (
        "_chain",
        "_counted_fallback",
        "_prefill",
        "_request",
        "_router",
        "adapter",
        "budget_denied",
        "choice",
        "degraded",
        "max_tokens",
        "model",
        "prompt",
        "prompt_tokens",
        "queued_s",
        "reason",
        "served",
        "session",
        "tenant",
    )

    def __init__(
        self,
        router: Router,
        model: str,
        prompt: PromptView,
        prompt_tokens: int,
        max_tokens: int | None,
        choice: TierChoice | None = None,
        tenant: str = "",
        session: str | None = None,
    ) -> None:
        self._router = router
        self.tenant = tenant
        self.session = session
        self.model = model
        self.prompt = prompt
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens or DEFAULT_COMPLETION_ESTIMATE
        self.choice = choice
        self._chain: tuple[Pool, ...] | None = None
        self._request: RouteRequest | None = None
        self._counted_fallback = False
        # Prompt tokens the last chosen replica must compute (its cached prefix excluded).
        self._prefill = prompt_tokens
        self.reason: str | None = None
        self.served: str | None = None
        self.queued_s: float | None = None
        self.degraded: str | None = None
        self.budget_denied = False
        # The LoRA adapter the request names (``routing.adapters``): only the replicas of
        # its pool that serve it are chosen, and no fallback model (none serves it).
        self.adapter: str | None = None

    @property
    def pool(self) -> Pool:
        return self._router.pools[self.model]

    @property
    def cost(self) -> int:
        """Tokens this request asks of a replica (the fair queue's cost)."""
        return self.prompt_tokens + self.max_tokens

    def switch(self, model: str, degraded: str) -> None:
        """Serve from another model's pool (overflow to a smaller tier) before the first pick."""
        self.model = model
        self.degraded = degraded
        self._chain = None

    def clamp(self, max_tokens: int) -> None:
        self.max_tokens = min(self.max_tokens, max_tokens)
        self.degraded = "max_tokens"

    def next_attempt(self, now: float, tried: Collection[str], attempts: int, deadline: float | None) -> Replica | Stop:
        """The replica for the request's next attempt, or why there is none.

        ``tried``: replicas already tried, ``attempts`` made so far. A retry (any attempt
        after the first) starts only before ``deadline`` and while the primary pool's retry
        budget allows; a first attempt with no replica at all is ``NO_REPLICA``, a retry
        with none left ``EXHAUSTED``.
        """
        if attempts and deadline is not None and now >= deadline:
            return DEADLINE
        replica = self._pick(tried, now)
        if replica is None:
            return EXHAUSTED if attempts else NO_REPLICA
        if attempts and not self._may_retry(now):
            return RETRY_BUDGET
        return replica

    def __call__(self, exclude: Collection[str]) -> Replica | None:
        """A replica not in ``exclude``: the request's pool first, then the fallback chain."""
        return self._pick(exclude, self._router.clock())

    def _pick(self, exclude: Collection[str], now: float) -> Replica | None:
        router = self._router
        chain = self._chain
        if chain is None:
            chain = self._chain = router.chain(self.model) if self.adapter is None else (router.pools[self.model],)
        if self._request is None:
            # First pick: the policy's view of the request, built once; the request counts
            # towards its pool's retry budget.
            self._request = router.route_request(self.prompt, self.prompt_tokens, self.max_tokens, self.session)
            chain[0].budget.deposit(now)
        request = self._request
        for position, pool in enumerate(chain):
            decision = pool.pick(request, now, exclude, self.adapter)
            replica = decision.replica
            if replica is None:
                continue
            self.reason = decision.reason
            self.served = pool.model
            index = pool.index
            if index is not None and request.prefix_keys:
                keys = request.prefix_keys
                self._prefill = request.uncached_tokens(index.depth(keys, replica.id))
                # A stall spill is a detour: the prefix stays recorded (and homed) where it was.
                if decision.reason != "stall_spill":
                    sizes, rest = request.block_tokens()
                    capacity = pool.capacity.kv_tokens(replica)
                    index.record(keys, sizes, replica.id, rest_tokens=rest, capacity_tokens=capacity)
                    if index.replicas() > len(pool.replicas):  # some left (discovery): their entries go
                        index.retain({r.id for r in pool.replicas})
            else:
                self._prefill = self.prompt_tokens
            router.metrics.decided(pool.model, decision.reason)
            if position and not self._counted_fallback:
                self._counted_fallback = True
                router.metrics.series(router.metrics.fallbacks, self.model, pool.model).inc()
            return replica
        return None

    def claim(self, replica: Replica, streamed: bool) -> Claim:
        """The load of this attempt on ``replica`` (just chosen): its uncached prompt and ``max_tokens``.

        A streamed attempt holds one of the pool's prefill slots for its tenant until its
        first token (or its end without one), which hands the room on to the next request
        waiting for the pool.
        """
        admission = self._router.pools[self.served or self.model].admission
        now = self._router.clock()
        if not streamed:
            return Claim(replica, self._prefill, self.max_tokens, now, on_prefilled=admission.notify)
        admission.prefill_started(self.tenant)
        ended = functools.partial(admission.prefill_ended, self.tenant)
        return Claim(replica, self._prefill, self.max_tokens, now, streamed=True, on_prefilled=ended)

    def may_retry(self) -> bool:
        """Whether another attempt may follow a failed one (the primary pool's retry budget)."""
        return self._may_retry(self._router.clock())

    def _may_retry(self, now: float) -> bool:
        pool = self.pool
        if pool.budget.withdraw(now):
            return True
        if not self.budget_denied:
            self.budget_denied = True
            self._router.metrics.series(self._router.metrics.retry_budget_exhausted, pool.model).inc()
        return False

    def finished(self) -> None:
        """The request is over: slots it held may go to requests waiting for its pools."""
        pools = self._router.pools
        pools[self.model].admission.notify()
        if self.served is not None and self.served != self.model:
            pools[self.served].admission.notify()

    def annotate(self, entry: dict[str, Any]) -> None:
        """Add the routing fields to an access-log entry (only those that say something)."""
        choice = self.choice
        if choice is not None:
            entry["tier"] = choice.tier
            entry["tier_reason"] = choice.reason
            entry["classifier"] = choice.classification.header()
        if self.reason is not None:
            entry["route"] = self.reason
        if self.served is not None and self.served != self.model:
            entry["fallback"] = self.served
        if self.queued_s is not None:
            entry["queued_ms"] = round(self.queued_s * 1000, 2)
        if self.degraded is not None:
            entry["degraded"] = self.degraded
        if self.budget_denied:
            entry["retry_budget"] = "exhausted"


class Router:
    """Every pool, the tier map and the policy settings; builds each request's ``Route``."""

    def __init__(
        self,
        pools: Mapping[str, Pool],
        tiers: TierMap,
        *,
        policy: PolicyName,
        affinity: AffinitySettings,
        metrics: RoutingMetrics,
        clock: Callable[[], float],
        head: EmbeddingHead | None = None,
        embedding_use: EmbeddingUse = "never",
        static: StaticHead | None = None,
    ) -> None:
        self.pools = dict(pools)
        self.tiers = tiers
        # The classifier's embedding head (None: the static head only) and when it is asked
        # for; the static head (the shipped one unless given) scores every other classified
        # request, read here, at start, when there are tiers to classify into.
        self.head = head
        self.embedding_use = embedding_use
        self.static = (static or default_static_head()) if tiers.active else None
        if tiers.active:
            default_word_frequency()  # both heads' word-frequency table, read at start too
        self.policy = policy
        self.metrics = metrics
        self.clock = clock
        # Prompts are hashed for prefix affinity, and for the prefill estimate of a pool
        # whose capacity bounds the prefill backlog.
        self._wants_keys = any(p.index is not None for p in self.pools.values())
        self._affinity = affinity
        self._chains: dict[str, tuple[Pool, ...]] = {}
        for model, pool in self.pools.items():
            self._chains[model] = (pool, *(self.pools[m] for m in pool.fallback if m in self.pools and m != model))

    @classmethod
    def build(
        cls,
        settings: RoutingSettings,
        specs: Sequence[PoolSpec],
        replicas: Mapping[str, list[Replica]],
        *,
        rng: random.Random,
        clock: Callable[[], float],
        metrics: RoutingMetrics,
        weights: dict[str, float] | None = None,
        head: EmbeddingHead | None = None,
        static: StaticHead | None = None,
    ) -> Router:
        ls = settings.load
        load = LoadModel(ls.tokens_per_request, ls.kv_knee, ls.kv_full_tokens)
        qs = settings.queue
        queue_config = FairQueueConfig(qs.quantum_tokens, qs.max_queue_length, 1.0, qs.retry_after_s)
        rb = settings.retry_budget
        now = clock()
        pools: dict[str, Pool] = {}
        for spec in specs:
            cs = spec.capacity or settings.capacity
            capacity = Capacity(
                cs.max_requests, cs.max_outstanding_tokens, cs.max_prefill_tokens, load, cs.kv_cache_tokens
            )
            index = None
            if settings.policy == "prefix_affinity" or cs.max_prefill_tokens is not None:
                index = PrefixIndex(settings.affinity.index_keys)
            members = replicas[spec.model]
            admission = Admission(
                members,
                capacity,
                queue_config,
                weights=weights,
                clock=clock,
                poll_interval_s=qs.poll_interval_s,
                enabled=qs.enabled,
                share_prefill=qs.share_prefill,
            )
            pools[spec.model] = Pool(
                spec.model,
                members,
                make_policy(settings.policy, rng, load, settings.affinity, members, index),
                capacity,
                RetryBudget(rb.ratio, rb.min_per_s, rb.burst, now),
                admission,
                spec.fallback,
                index,
            )
        tiers = TierMap(settings.tier_ranges(), [(s.model, s.tier) for s in specs])
        return cls(
            pools,
            tiers,
            policy=settings.policy,
            affinity=settings.affinity,
            metrics=metrics,
            clock=clock,
            head=head,
            embedding_use=settings.classifier.embedding,
            static=static,
        )

    def chain(self, model: str) -> tuple[Pool, ...]:
        return self._chains[model]

    def text_to_embed(
        self, prompt: PromptView, shared: str | None, forced: str | None, allowed: Collection[str]
    ) -> str | None:
        """The text whose embedding the classifier wants for ``prompt``, or None (n-grams only).

        ``shared``: the text the tenant's semantic cache will embed for this request, if it
        will (``ResponseCache.semantic_text``); the same text as ``embedding_text`` gives
        then, so one embedding serves both. ``always`` asks for one anyway; nothing does
        when no tier is active or a forced tier is allowed (the score would not matter).
        """
        use = self.embedding_use
        if use == "never" or self.head is None or not self.tiers.active or (forced and forced in allowed):
            return None
        if shared is not None:
            return shared
        if use == "always":
            return embedding_text(prompt.instruction) or None
        return None

    def choose_tier(
        self,
        prompt: PromptView,
        forced: str | None,
        allowed: Collection[str],
        vector: npt.NDArray[np.floating] | None = None,
        fallback: str = "",
        window: tuple[int, int] | None = None,
    ) -> TierChoice | None:
        """Classify ``prompt`` and pick the tier's model; None when no tier has a model.

        ``vector``: the embedding of ``text_to_embed``'s text, when it was asked for and came
        (the embedding head scores it), and ``window`` the (word pieces, characters) the model
        read of that text; ``fallback``: why the vector did not come.
        """
        tiers = self.tiers
        if not tiers.active:
            return None
        if vector is not None and self.head is not None and window is None and self.head.uses_window:
            # An embedder that did not say what its model read (a tokenizer without offsets):
            # the head cannot score without it.
            vector, fallback = None, "mismatch"
        if vector is not None and self.head is not None:
            classification = classify(prompt, tiers.ranges, vector=vector, window=window, head=self.head)
        else:
            classification = classify(prompt, tiers.ranges, static=self.static, fallback=fallback)
        rm = self.metrics
        rm.series(rm.classifier_heads, classification.head, fallback or "none").inc()
        tier, reason = resolve_tier(classification, forced, allowed)
        model = tiers.model_for(tier)
        if model is None:  # only a forced name outside the tier list gets here
            tier, reason = classification.tier, "force_denied"
            model = tiers.model_for(tier)
            assert model is not None
        self.metrics.series(self.metrics.tiers, tier, reason).inc()
        return TierChoice(model, tier, reason, classification)

    def route(
        self,
        model: str,
        prompt: PromptView,
        prompt_tokens: int,
        max_tokens: int | None,
        choice: TierChoice | None = None,
        tenant: str = "",
        session: str | None = None,
    ) -> Route:
        """``session``: the request's session key, when the client sent one (``AffinitySettings.session_keys``)."""
        return Route(self, model, prompt, prompt_tokens, max_tokens, choice, tenant, session)

    def route_request(
        self, prompt: PromptView, prompt_tokens: int, max_tokens: int, session: str | None = None
    ) -> RouteRequest:
        """The policy's view of a request; prefix keys, and the session's hash, only when something uses them.

        Without a session key, a conversation's opening turn stands for its session
        (``conversation_key``): the same in every later turn of it, on every pod.
        """
        if not self._wants_keys:
            return RouteRequest((), prompt_tokens, max_tokens)
        a = self._affinity
        segments = prompt.segments
        keys, ends, chars = prefix_keys(segments, a.block_chars, a.max_blocks, a.coarse_block_chars, a.max_prefix_chars)
        start = opening(segments)
        return RouteRequest(
            keys,
            prompt_tokens,
            max_tokens,
            ends,
            chars,
            session=session_hash(session) if session else 0,
            conversation=0 if session else conversation_key(segments, first_turn=start.first_turn),
            preamble_blocks=bisect.bisect_right(ends, start.preamble_chars),
            opens=start.opens,
        )

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Tenants' fair-queue weights (start-up and config reload)."""
        for pool in self.pools.values():
            for tenant, weight in weights.items():
                pool.admission.set_weight(tenant, weight)

    def depths(self) -> dict[str, dict[str, int]]:
        return {model: pool.admission.depths() for model, pool in self.pools.items()}

    def close(self) -> None:
        for pool in self.pools.values():
            pool.admission.close()
