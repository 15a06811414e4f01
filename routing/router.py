"""The router: one pool per configured model, and each request's ``Route``.

Built once from configuration (``Router.build``): a ``Pool`` per model (``routing.pool``)
with its policy, capacity, retry budget, fair queue and prefix index, each model's fallback
chain, and the tier choice for ``auto`` (``routing.tiers``). Per request, the gateway asks
``text_to_embed`` and ``choose_tier`` (classified requests only), then ``route`` for the
request's ``Route`` (``routing.route``): the picker the proxy asks attempt by attempt.
Start-up and reload set the tenants' queue weights; ``depths`` reports the queues; ``close``
refuses what still waits.

Nothing here awaits: the waiting (fair queue) is ``routing.admission``, the sending is
``gateway.proxy``.

The gateway imports ``PoolSpec``, ``Route``, ``TierChoice`` and the ``Stop`` values from
here, and ``bench/route_cost.py --base`` imports ``PoolSpec`` and ``Router`` from here on
earlier commits too, so they stay importable from this module (``__all__``).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Mapping, Sequence

from dialects.base import PromptView
from replicas.replica import Replica
from routing.admission import Admission
from routing.band_queue import SINGLE_BAND, BandLimits
from routing.capacity import Capacity
from routing.config import AffinitySettings, EmbeddingUse, PolicyName, RoutingSettings
from routing.embedding_head import EmbeddingHead
from routing.fair_queue import FairQueueConfig
from routing.kv_index import KvIndex
from routing.metrics import RoutingMetrics
from routing.policies import LoadModel, RouteRequest, conversation_key, opening, prefix_keys, session_hash
from routing.pool import Pool, PoolSpec, make_policy
from routing.prefix_index import PrefixIndex
from routing.retry_budget import RetryBudget
from routing.route import DEADLINE, EXHAUSTED, NO_REPLICA, RETRY_BUDGET, Route, Stop
from routing.static_head import StaticHead
from routing.tier_map import TierMap
from routing.tiers import TierChoice, TierChooser

__all__ = [
    "DEADLINE",
    "EXHAUSTED",
    "NO_REPLICA",
    "RETRY_BUDGET",
    "Pool",
    "PoolSpec",
    "Route",
    "Router",
    "Stop",
    "TierChoice",
    "make_policy",
]


class Router:
    """Every pool, the tier choice and the policy settings; builds each request's ``Route``."""

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
        # Tier choice for classified requests (``routing.tiers``); its two steps are asked of
        # the router, and its embedding head (None: the static head only) read by the gateway.
        self.chooser = TierChooser(tiers, metrics, head, embedding_use, static)
        self.head = head
        self.text_to_embed = self.chooser.text_to_embed
        self.choose_tier = self.chooser.choose_tier
        self.policy = policy
        self.metrics = metrics
        self.clock = clock
        # Prompts are hashed for prefix affinity, and for the prefill estimate of a pool
        # whose capacity bounds the prefill backlog.
        self._wants_keys = any(p.index is not None for p in self.pools.values())
        self._affinity = affinity
        # The replicas' KV-cache events (``routing.kv_index``), set by the gateway when some
        # model's replicas publish them, and those models: their prompts' token ids are kept.
        self.kv: KvIndex | None = None
        self.kv_models: frozenset[str] = frozenset()
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
        bands: Sequence[BandLimits] = SINGLE_BAND,
    ) -> Router:
        """``bands``: the priority bands each pool's queue serves in order (``routing.band_queue``)."""
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
                bands=bands,
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
        """``model``'s pool, then its fallback models' pools that are configured (itself excluded)."""
        return self._chains[model]

    def route(
        self,
        model: str,
        prompt: PromptView,
        prompt_tokens: int,
        max_tokens: int | None,
        choice: TierChoice | None = None,
        tenant: str = "",
        session: str | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> Route:
        """The request's ``Route``, its picker; ``choice``: the tier choice of a classified request.

        ``session``: the request's session key, when the client sent one (``AffinitySettings.session_keys``).
        ``token_ids``: the prompt's, for a model in ``kv_models``.
        """
        return Route(self, model, prompt, prompt_tokens, max_tokens, choice, tenant, session, token_ids)

    def wants_token_ids(self, model: str) -> bool:
        """Whether ``model``'s replicas publish KV events, so its prompts' token ids are read."""
        return model in self.kv_models

    def route_request(
        self,
        prompt: PromptView,
        prompt_tokens: int,
        max_tokens: int,
        session: str | None = None,
        token_ids: Sequence[int] | None = None,
        lora_name: str | None = None,
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
            exact=self.kv.request(token_ids, lora_name) if self.kv is not None and token_ids else None,
        )

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Tenants' fair-queue weights (start-up and config reload)."""
        for pool in self.pools.values():
            for tenant, weight in weights.items():
                pool.admission.set_weight(tenant, weight)

    def depths(self) -> dict[str, dict[str, int]]:
        """Requests waiting now, by model and tenant."""
        return {model: pool.admission.depths() for model, pool in self.pools.items()}

    def band_depths(self) -> dict[str, dict[str, dict[str, int]]]:
        """Requests waiting now, by model, band and tenant (the queue-depth gauge, read at scrape)."""
        return {model: pool.admission.band_depths() for model, pool in self.pools.items()}

    def close(self) -> None:
        """Refuse the requests still queued now (at shutdown), not at their deadlines."""
        for pool in self.pools.values():
            pool.admission.close()
