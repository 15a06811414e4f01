"""One request's picker: ``Route``, and why it may have no replica to offer (``Stop``).

The router hands each request a ``Route`` (the gateway sees it as its ``Picker``). A
``Route`` walks the request's model pool first and then that model's fallback chain
(``models[].fallback``, in order, not followed transitively), asking each pool for a
replica not yet tried. It builds the policy's view of the request (``RouteRequest``, with
prefix keys only when something uses them) once, on the first pick, so a request answered
from the cache or refused by limits never pays for it. Each choice is recorded in the
pool's ``PrefixIndex``, which estimates how much of the prompt the chosen replica still has
cached: the prefill the request's ``Claim`` charges it.

``Route.next_attempt`` is the one retry decision: a replica for the next attempt, or a
``Stop`` saying why there is none (no candidate left, the request's deadline passed, or the
primary pool's ``RetryBudget`` has no credit). Stops are values, not exceptions: the proxy
turns each into its answer.

The route reads the router through ``RouteContext`` so that this module does not import
``routing.router``, which builds routes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from enum import StrEnum
from typing import Any, Protocol

from dialects.base import PromptView
from replicas.replica import Claim, Replica
from routing.metrics import RoutingMetrics
from routing.policies import RouteRequest
from routing.pool import Pool
from routing.preemption import avoiding
from routing.tiers import TierChoice

# Completion tokens assumed owed when a request sets no max_tokens (routing estimate only).
DEFAULT_COMPLETION_ESTIMATE = 256


class Stop(StrEnum):
    """Why a request gets no (further) attempt (``Route.next_attempt``).

    A ``StrEnum``: the values are what the access log and the proxy's answers say, and a
    member compares equal to its value.
    """

    NO_REPLICA = "no_replica"
    EXHAUSTED = "exhausted"
    DEADLINE = "deadline"
    RETRY_BUDGET = "retry_budget"


NO_REPLICA = Stop.NO_REPLICA
EXHAUSTED = Stop.EXHAUSTED
DEADLINE = Stop.DEADLINE
RETRY_BUDGET = Stop.RETRY_BUDGET


class RouteContext(Protocol):
    """What a ``Route`` reads of the router that handed it out."""

    @property
    def pools(self) -> Mapping[str, Pool]: ...

    @property
    def metrics(self) -> RoutingMetrics: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    def chain(self, model: str) -> tuple[Pool, ...]:
        """``model``'s pool, then its fallback models' pools."""
        ...

    def route_request(
        self,
        prompt: PromptView,
        prompt_tokens: int,
        max_tokens: int,
        session: str | None = None,
        token_ids: Sequence[int] | None = None,
        lora_name: str | None = None,
    ) -> RouteRequest:
        """The policy's view of a request."""
        ...


class Route:
    """One request's picker: its way to a replica, attempt by attempt.

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
        "band",
        "budget_denied",
        "choice",
        "degraded",
        "kv_cached",
        "max_tokens",
        "model",
        "prompt",
        "prompt_tokens",
        "queued_s",
        "reason",
        "served",
        "session",
        "tenant",
        "token_ids",
    )

    def __init__(
        self,
        router: RouteContext,
        model: str,
        prompt: PromptView,
        prompt_tokens: int,
        max_tokens: int | None,
        choice: TierChoice | None = None,
        tenant: str = "",
        session: str | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        self._router = router
        # The prompt's token ids, where the model's replicas publish KV events (else None).
        self.token_ids = token_ids
        self.tenant = tenant
        # The request's priority band (index into ``bands``, 0 the highest): where it waits
        # in a saturated pool, and the ``priority`` a priority-scheduling replica gets.
        self.band = 0
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
        # Prompt tokens the chosen replica held, by its KV events (None: not read from events).
        self.kv_cached: int | None = None
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
            self._request = router.route_request(
                self.prompt, self.prompt_tokens, self.max_tokens, self.session, self.token_ids, self.adapter
            )
            chain[0].budget.deposit(now)
        request = self._request
        for position, pool in enumerate(chain):
            decision = None
            if self.band and pool.admission.preemptible(self.band):
                # A preemptible band avoids replicas running preempting work while it can.
                away = avoiding(pool.replicas, exclude)
                if away is not None:
                    decision = pool.pick(request, now, away, self.adapter)
            if decision is None or decision.replica is None:
                decision = pool.pick(request, now, exclude, self.adapter)
            replica = decision.replica
            if replica is None:
                continue
            self.reason = decision.reason
            self.kv_cached = request.exact.cached_tokens(replica.id) if request.exact is not None else None
            self.served = pool.model
            index = pool.index
            if index is not None and request.prefix_keys:
                keys = request.prefix_keys
                self._prefill = request.uncached_on(replica.id, index)
                # A stall spill is a detour: the prefix stays recorded (and homed) where it was.
                if decision.reason != "stall_spill":
                    sizes, rest = request.block_tokens()
                    capacity = pool.capacity.kv_tokens(replica)
                    index.record(keys, sizes, replica.id, rest_tokens=rest, capacity_tokens=capacity)
                    if index.replicas() > len(pool.replicas):  # some left (discovery): their entries go
                        index.retain({r.id for r in pool.replicas})
            elif request.exact is not None:
                self._prefill = request.uncached_on(replica.id, None)
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
        preempting = admission.preempting(self.band)
        if not streamed:
            return Claim(
                replica, self._prefill, self.max_tokens, now, on_prefilled=admission.notify, preempting=preempting
            )
        admission.prefill_started(self.tenant, self.band)
        ended = functools.partial(admission.prefill_ended, self.tenant, self.band)
        return Claim(
            replica, self._prefill, self.max_tokens, now, streamed=True, on_prefilled=ended, preempting=preempting
        )

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
        if self.kv_cached is not None:
            entry["kv_cached_tokens"] = self.kv_cached
        if self.queued_s is not None:
            entry["queued_ms"] = round(self.queued_s * 1000, 2)
        if self.degraded is not None:
            entry["degraded"] = self.degraded
        if self.budget_denied:
            entry["retry_budget"] = "exhausted"
