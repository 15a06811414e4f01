"""The request path as a declared list of stages, run in order by ``Gateway.handle``.

    authenticate   API key -> tenant                                  401
    parse          read the body, validate it -> Call                 400 / 408 / 413
    recall         (Responses) previous_response_id expanded into     404 / 503
                   the whole input; the answer's keeper, when stored
    classify       model ("auto" -> a tier's model; its text embedded   400 / 404
                   first when the embedding head scores it), context
                   length, the request's Route (its picker)
    admit          rate limits, concurrency, token quotas             429 (503: limit store down)
    look_up_cache  exact then semantic answer, or the same request    hit: replayed here
                   in flight (only when some tenant uses the cache)
    queue          deadline; a slot in the model's pool: degrade,     400 / 429 / 503 / 504
                   then wait fairly when every replica is full
    forward        the proxy: attempts, retries, fallback, relay;     the replica's answer
                   publish and keep the answer for the cache

Classification runs before admission: an unknown model needs no admission, and the model
that answers is part of the cache key. So the embedding an ``auto`` request's semantic
lookup needs is computed here, for the classifier, and the lookup finds it in the
semantic cache's memo. After the last stage, ``gateway.accounting`` settles
limits, counts and logs, however the request ended.

Each stage is a plain method over the request's ``Exchange`` returning ``CONTINUE`` (None)
or a local reply: a response (a cache hit, the proxy's answer), or a ``GatewayError`` that
carries the refusal's reason, as an Envoy filter stops its chain with a local reply. Input
that fails validation deeper down raises a ``GatewayError``; ``Gateway.handle`` answers
both the same way. The list is built once from the settings, again on a reload of tenants.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeAlias

import orjson
from aiohttp import web

from cache.coalesce import Leader
from cache.semantic.cache import TextEmbedding
from cache.service import CacheHit, ResponseCache
from dialects.answer import CachedCompletion
from dialects.base import Call, Dialect
from dialects.registry import DIALECTS
from dialects.responses import RESPONSES_API, echo_previous
from gateway.auth import KeyRing, credential
from gateway.autoscale import PendingTokens
from gateway.errors import (
    BadRequest,
    GatewayError,
    GatewayTimeout,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    RequestTimeout,
    ServiceUnavailable,
)
from gateway.exchange import CACHE_HEADER, PRIORITY_HEADER, ROUTE_HEADER, TIER_HEADER, TIMEOUT_HEADER, Exchange
from gateway.lora import AdapterLoader
from gateway.proxy import Proxy
from gateway.request import context_overflow, parse_call
from gateway.responses_state import ResponseState
from gateway.settings import Settings, TenantSettings
from limits.config import reservation
from limits.decision import Decision
from limits.limiter import Limiter
from limits.plan import Subject
from replicas.fleet import Fleet
from routing import saturation
from routing.admission import Admitted
from routing.metrics import RoutingMetrics
from routing.router import Route, Router, TierChoice

log = logging.getLogger("fleetgate.routing")

# What a stage returns: CONTINUE, or the local reply that ends the request's path here.
Reply: TypeAlias = web.StreamResponse | GatewayError | None
Stage: TypeAlias = Callable[[Exchange, web.Request], Awaitable[Reply]]
CONTINUE = None


class Stages:
    """The stages of the request path, and the parts of the gateway they use."""

    def __init__(
        self,
        settings: Settings,
        *,
        keyring: KeyRing,
        tenants: Mapping[str, TenantSettings],
        fleet: Fleet,
        router: Router,
        limiter: Limiter,
        cache: ResponseCache,
        proxy: Proxy,
        pending: PendingTokens,
        routing_metrics: RoutingMetrics,
        responses: ResponseState,
        adapters: AdapterLoader,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.responses = responses
        self.adapters = adapters
        self.keyring = keyring
        self.tenants = tenants
        self.fleet = fleet
        self.router = router
        self.limiter = limiter
        self.cache = cache
        self.proxy = proxy
        self.pending = pending
        self.routing_metrics = routing_metrics
        self.clock = clock
        self.default_model = settings.default_model or settings.models[0].name
        self.max_model_len = {m.name: m.max_model_len for m in settings.models if m.max_model_len is not None}
        self._warned_mismatch = False
        uses_cache = any(t.cache.enabled for t in tenants.values())
        # Each API's path, top to bottom: the same for all but Responses, whose stored
        # conversation is recalled before anything reads its prompt.
        self.paths: dict[Dialect, tuple[Stage, ...]] = {
            dialect: (
                self.authenticate,
                self.parse,
                *((self.recall,) if dialect is RESPONSES_API else ()),
                self.classify,
                self.admit,
                *((self.look_up_cache,) if uses_cache else ()),
                *((self.load_adapter,) if adapters.loads else ()),
                self.queue,
                self.forward,
            )
            for dialect in DIALECTS
        }

    async def authenticate(self, ex: Exchange, request: web.Request) -> Reply:
        """The tenant that owns the request's API key (401 ``Unauthorized`` otherwise)."""
        key = self.keyring.owner_of(credential(request.headers))
        ex.tenant = self.tenants[key.owner]
        ex.key_id = key.key_id
        if ex.timeline is not None:
            ex.timeline.mark("auth", self.clock())
        return CONTINUE

    async def parse(self, ex: Exchange, request: web.Request) -> Reply:
        """Read the body (bounded in size and time) and validate it, once."""
        dialect = ex.dialect
        raw = await self._read_body(request, dialect)
        ex.call = parse_call(dialect, raw, request.headers.get("Content-Type"))
        if dialect.forward_headers:
            headers = request.headers
            ex.forward = {name: headers[name] for name in dialect.forward_headers if name in headers}
        return CONTINUE

    async def recall(self, ex: Exchange, request: web.Request) -> Reply:
        """A Responses request continues a stored conversation: its ``previous_response_id``
        expanded into the whole input, and its answer kept when asked (``gateway.responses_state``)."""
        assert ex.tenant is not None
        previous = ex.call.body.get("previous_response_id")
        ex.call, ex.keep, ex.chain = await self.responses.recall(ex.call, ex.tenant)
        if previous is not None:
            ex.rewrite = echo_previous(previous)
        if ex.call.stream:
            ex.on_start = self.responses.track(ex.tenant.id)
        return CONTINUE

    async def classify(self, ex: Exchange, request: web.Request) -> Reply:
        """The model whose pool serves the request, and its ``Route``.

        ``auto`` (and the tenant's ``classify_models``) is classified into a tier, served by
        that tier's model; the ``x-fleetgate-tier`` request header forces a tier where the
        tenant allows it. When no model serves a routing tier, ``auto`` is ``default_model``.
        A prompt that cannot fit the model's ``max_model_len`` stops here.
        """
        call, tenant = ex.call, ex.tenant
        assert tenant is not None
        name = tenant.model_aliases.get(call.model, call.model)
        choice: TierChoice | None = None
        if (name == "auto" or name in tenant.classify_models) and call.dialect.classifiable:
            choice = await self._choose_tier(ex, request, tenant)
        if choice is not None:
            model = choice.model
            if self.settings.routing.debug_header:
                ex.headers[ROUTE_HEADER] = choice.header()
        elif name == "auto":
            model = self.default_model
        elif name in self.fleet.by_model:
            model = name
        elif (base := self.adapters.catalog.base_of(name)) is not None:
            model, ex.adapter = base, name
        else:
            return NotFound(
                f"The model '{name}' does not exist or you do not have access to it.",
                code="model_not_found",
                param="model",
            )
        ex.model, ex.pool = ex.adapter or model, model
        limit = self.max_model_len.get(model)
        if limit is not None:
            too_long = context_overflow(call, limit)
            if too_long is not None:
                return too_long
        session = self._session(ex, request)
        route = self.router.route(
            model, call.prompt, call.prompt_tokens_estimate, call.max_tokens, choice, tenant.id, session
        )
        route.adapter = ex.adapter
        ex.route = route
        ex.pending = route.cost
        self.pending.add(model, ex.pending)
        ex.headers[TIER_HEADER] = self.fleet.tiers[model]
        if ex.timeline is not None:
            ex.timeline.mark("parse", self.clock())  # the "parse" span covers classification
        return CONTINUE

    def _session(self, ex: Exchange, request: web.Request) -> str | None:
        """The request's session key, from the first of ``routing.affinity.session_keys`` it has."""
        for source in self.settings.routing.affinity.session_keys:
            if source == "user":
                value = ex.call.body.get("user")
            elif source == "response_chain":
                value = ex.chain
            else:
                value = request.headers.get(source[len("header:") :])
            if isinstance(value, str) and value:
                return value
        return None

    async def admit(self, ex: Exchange, request: web.Request) -> Reply:
        """Rate limits, concurrency, quotas: a lease on the tenant's budget, or a refusal."""
        call, tenant = ex.call, ex.tenant
        assert tenant is not None and ex.key_id is not None
        reserve = reservation(call.prompt_tokens_estimate, call.max_tokens, tenant.limits, call.n)
        decision = await self.limiter.admit(Subject(tenant.id, ex.key_id, call.model), tenant.limits, reserve)
        ex.headers.update(decision.headers())
        if ex.timeline is not None:
            ex.timeline.mark("limits", self.clock())
        if not decision.allowed:
            return _rejection(decision)
        ex.lease = decision.lease
        return CONTINUE

    async def look_up_cache(self, ex: Exchange, request: web.Request) -> Reply:
        """A stored answer (exact, then semantic) replayed; else, for a cacheable request,
        become the ``Leader`` that goes upstream for its key.

        A request identical to one in flight waits for that one's answer (a streaming
        client gets keep-alives meanwhile) instead of going upstream itself.
        """
        call, tenant, model = ex.call, ex.tenant, ex.model
        assert tenant is not None and model is not None
        plan = self.cache.plan(
            tenant.id, model, ex.dialect, call.body, tenant.cache, request.headers.get("Cache-Control")
        )
        ex.plan = plan
        hit: CacheHit | None = None
        if plan.key is not None:
            ex.cache_kind = call.dialect.answers
            ex.cache_max_chars = tenant.cache.max_entry_bytes
            hit = await self.cache.find(plan)
            if hit is None and plan.coalesce:
                joining = self.cache.coalesce(plan.key, self.settings.upstream.first_byte_timeout_s)
                if call.stream:
                    joined = await self.proxy.with_keepalive(ex, request, joining, discard=_end_flight)
                else:  # keep-alives are SSE comments: a JSON client just waits
                    joined = await joining
                if isinstance(joined, CachedCompletion):
                    hit = CacheHit("exact", joined)
                else:
                    ex.leader = joined
        if ex.timeline is not None:
            ex.timeline.mark("cache", self.clock())
        if hit is None:
            return CONTINUE
        response = await self._replay(ex, request, hit)
        ex.charged = ResponseCache.tokens_to_charge(hit.completion, tenant.cache)
        return response

    async def load_adapter(self, ex: Exchange, request: web.Request) -> Reply:
        """A LoRA adapter that no routable replica serves is loaded on one first, when its
        configuration says where from (``gateway.lora``): one load for all who ask at once."""
        if ex.adapter is None or ex.pool is None:
            return CONTINUE
        return await self.adapters.ensure(ex.adapter, ex.pool)

    async def queue(self, ex: Exchange, request: web.Request) -> Reply:
        """The request's deadline, then a slot in its model's pool.

        While some replica of the pool has room this is a counter check. When every one is
        at capacity the tenant's degradation applies (overflow to a smaller tier, a
        ``max_tokens`` clamp), then the request waits in the pool's fair queue: until a slot
        frees up, or a 429 (its tenant's queue is full), 503 (waited its priority's longest
        wait) or 504 (its own deadline passed), each with ``Retry-After`` where retrying helps.
        """
        route, tenant = ex.route, ex.tenant
        assert isinstance(route, Route) and tenant is not None
        ex.headers[CACHE_HEADER] = "miss"  # whatever answers now, the cache did not
        bound = saturation.deadline(
            ex.started, self.settings.upstream.request_timeout_s, request.headers.get(TIMEOUT_HEADER)
        )
        if bound is None:
            return BadRequest(f"The {TIMEOUT_HEADER} header must be a positive integer (milliseconds).")
        ex.deadline, ex.cut_at_deadline = bound
        now = self.clock()
        if not route.pool.admission.ready(now):
            self._degrade(ex, tenant, route, now)
            admission = route.pool.admission
            if not admission.ready(now):
                refused = await self._wait(ex, tenant, route, request, now)
                if refused is not None:
                    return refused
        if ex.timeline is not None:
            ex.timeline.mark("queue", self.clock())
        return CONTINUE

    async def forward(self, ex: Exchange, request: web.Request) -> Reply:
        """The proxy's answer; a good one goes to requests waiting on it and to the cache."""
        route = ex.route
        assert route is not None
        if ex.call.stream:
            response = await self.proxy.stream(ex, route, request)
        else:
            response = await self.proxy.complete(ex, route)
        if ex.keep is not None and ex.status == 200 and not ex.call.stream:
            keep, ex.keep = ex.keep, None
            refused = await keep(ex.answer)
            if refused is not None:
                return refused
        completion = ex.completion
        if completion is not None:
            if ex.leader is not None:
                ex.leader.publish(completion)
            plan, tenant = ex.plan, ex.tenant
            if plan is not None and plan.store and plan.key is not None and tenant is not None:
                self.cache.store_later(plan.key, completion, tenant.cache, plan.semantic)
        return response

    # -- what the stages share --------------------------------------------------------------

    async def _read_body(self, request: web.Request, dialect: Dialect) -> bytes:
        server = self.settings.server
        limit = server.max_audio_bytes if dialect.multipart else server.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _too_large(limit)
        try:
            if request.content.is_eof():  # all of it arrived with the headers: nothing to wait for
                raw = await request.read()
            else:
                async with asyncio.timeout(server.body_timeout_s):
                    raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise _too_large(limit) from exc
        except TimeoutError as exc:
            raise RequestTimeout("The request body did not arrive in time.") from exc
        if len(raw) > limit:  # a chunked body, read within the application's larger bound
            raise _too_large(limit)
        return raw

    async def _choose_tier(self, ex: Exchange, request: web.Request, tenant: TenantSettings) -> TierChoice | None:
        """The classified request's tier: the text embedded first when the embedding head is
        to score it (``Router.text_to_embed``), else the n-gram model alone."""
        call = ex.call
        prompt = call.prompt
        forced = request.headers.get(TIER_HEADER)
        allowed = self._forcible(tenant) if forced else ()
        embedding, fallback, text = None, "", None
        if self.router.head is not None:  # routing.classifier.embedding is not "never"
            cache_control = request.headers.get("Cache-Control")
            shared = self.cache.semantic_text(ex.dialect, call.body, tenant.cache, cache_control)
            text = self.router.text_to_embed(prompt, shared, forced, allowed)
        if text is not None:
            embedding, fallback = await self._embedding(text)
        if embedding is None:
            return self.router.choose_tier(prompt, forced, allowed, None, fallback)
        return self.router.choose_tier(prompt, forced, allowed, embedding.vector, fallback, embedding.window)

    async def _embedding(self, text: str) -> tuple[TextEmbedding | None, str]:
        """``text``'s embedding (vector and window) for the classifier's embedding head, or None and why not.

        It is the semantic cache's embedder, through the cache's memo: the lookup (and the
        store) of the same text afterwards reuses this vector instead of embedding again.
        The wait is bounded by ``cache.semantic.embed_timeout_ms``; past it, or with the
        embedder overloaded or not loaded, the n-gram model classifies.
        """
        semantic, head = self.cache.semantic, self.router.head
        if semantic is None or not semantic.ready or head is None:
            return None, "unavailable"
        embedder = semantic.embedder
        # A head that weighs the window needs an embedder that reports it (the shipped one does).
        windowed = not head.uses_window or semantic.reports_windows
        if embedder is None or not windowed or not head.accepts(semantic.identity, embedder.dimension):
            if not self._warned_mismatch:
                self._warned_mismatch = True
                log.warning(
                    "the classifier's embedding head was trained on another embedder's vectors (or weighs "
                    "the token window, which this embedder does not report); classifying with n-grams "
                    "(set routing.classifier.embedding_head_path)",
                    extra={"embedder": semantic.identity, "head_embedder": head.embedder},
                )
            return None, "mismatch"
        return await semantic.vector(text, semantic.settings.embed_timeout_s)

    def _forcible(self, tenant: TenantSettings) -> tuple[str, ...] | list[str]:
        """Tiers the tenant may force with the request header."""
        allowed = tenant.allow_force_tier
        if allowed is True:
            return self.router.tiers.names
        return allowed or ()

    async def _replay(self, ex: Exchange, request: web.Request, hit: CacheHit) -> Reply:
        """Answer from the cache, in the shape the client asked for.

        A hit the client asked to store (Responses) is kept like a live answer
        (``Exchange.keep``), under the replay's fresh id, before the client sees any of it: a
        ``previous_response_id`` naming that id works at once. If it cannot be kept and must
        not go out unkept (``fail_closed``), the refusal answers instead.
        """
        ex.headers[CACHE_HEADER] = hit.kind
        cached, call = hit.completion, ex.call
        ex.usage = cached.usage
        ex.status = 200
        ex.first_token_at = self.clock()
        answers = call.dialect.answers
        assert answers is not None  # a hit has a key: the dialect's answers are cached
        completion_id, created = answers.new_id(), int(time.time())
        answer = answers.replay_object(cached, completion_id=completion_id, created=created, request=call.body)
        if ex.keep is not None:
            keep, ex.keep = ex.keep, None
            refused = await keep(answer)
            if refused is not None:
                if ex.response is None:
                    return refused
                ex.error_code = refused.code  # keep-alives went out: end the stream with the error
                errors = call.dialect.errors
                await ex.response.write(errors.event(refused.message, refused.code or "upstream_error", refused.type))
                await ex.response.write_eof()
                return ex.response
        if not call.stream:
            return web.Response(body=orjson.dumps(answer), content_type="application/json", headers=ex.headers)
        events = answers.replay_sse(
            cached,
            completion_id=completion_id,
            created=created,
            include_usage=call.client_wants_usage,
            request=call.body,
        )
        response = ex.response or await self.proxy.prepare(ex, request)
        await response.write(events)
        await response.write_eof()
        return response

    def _degrade(self, ex: Exchange, tenant: TenantSettings, route: Route, now: float) -> None:
        """The tenant's graceful degradation, when its request's pool is saturated."""
        degrade = tenant.degrade
        rm = self.routing_metrics
        if degrade.overflow and route.choice is not None:
            pools = self.router.pools
            smaller = saturation.overflow_model(
                self.router.tiers.smaller(route.choice.tier), lambda m: pools[m].admission.ready(now)
            )
            if smaller is not None:
                rm.series(rm.degraded, route.model, tenant.id, "overflow").inc()
                route.switch(smaller, "overflow")
                ex.headers[TIER_HEADER] = self.fleet.tiers[smaller]
                ex.cache_kind = None  # not the answer the cache key names
                return
        # Only what generates tokens has a cap to lower (an audio form has no JSON to rewrite).
        limit = saturation.clamp(ex.call.max_tokens, degrade.max_tokens) if ex.call.dialect.generates else None
        if limit is not None:
            rm.series(rm.degraded, route.model, tenant.id, "max_tokens").inc()
            _clamp_max_tokens(ex.call, limit)
            route.clamp(limit)
            ex.cache_kind = None

    async def _wait(
        self, ex: Exchange, tenant: TenantSettings, route: Route, request: web.Request, now: float
    ) -> GatewayError | None:
        """Wait in the pool's fair queue: None once admitted, else the refusal."""
        assert ex.deadline is not None
        level = saturation.priority(tenant.priority, request.headers.get(PRIORITY_HEADER))
        wait_s = self.settings.routing.queue.max_wait_s.for_priority(level)
        wait_until = min(now + wait_s, ex.deadline)
        outcome = await route.pool.admission.wait(tenant.id, route.cost, wait_until)
        rm = self.routing_metrics
        if isinstance(outcome, Admitted):
            route.queued_s = outcome.waited_s
            rm.series(rm.queue_wait, route.model, tenant.id).observe(outcome.waited_s)
            return None
        route.queued_s = self.clock() - now
        reason = saturation.shed_reason(outcome.reason, wait_until, ex.deadline)
        rm.series(rm.shed, route.model, tenant.id, reason).inc()
        retry_after = {"Retry-After": str(max(1, math.ceil(outcome.retry_after_s)))}
        if reason == saturation.QUEUE_FULL:
            return RateLimited(
                f"Too many of your requests are waiting for '{route.model}'; retry later.",
                code="queue_full",
                headers=retry_after,
            )
        if reason == saturation.DEADLINE:
            return GatewayTimeout(
                "The request's deadline passed while it waited for a free replica.", code="deadline_exceeded"
            )
        return ServiceUnavailable(
            f"Every replica of '{route.model}' stayed busy for {wait_s:g} s; retry later.",
            code="queue_timeout",
            headers=retry_after,
        )


def _rejection(decision: Decision) -> GatewayError:
    """A limiter's rejection as the client's error: 429 (or 503 when the limit store is down)."""
    err: GatewayError
    if decision.status == ServiceUnavailable.status:
        err = ServiceUnavailable(decision.message, code=decision.error_code, headers=decision.headers())
    else:
        err = RateLimited(decision.message, code=decision.error_code, headers=decision.headers())
        err.type = decision.error_type or err.type
    return err


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The request body is larger than the {limit}-byte limit.")


def _end_flight(joined: Leader | CachedCompletion) -> None:
    """A flight led by a request that left before it could go upstream: end it."""
    if isinstance(joined, Leader):
        joined.abandon()


def _clamp_max_tokens(call: Call, limit: int) -> None:
    """Lower the request's max_tokens to ``limit`` (graceful degradation), in the forwarded body too."""
    body = dict(call.body)
    fields = call.dialect.max_tokens_fields
    body[next((f for f in fields if f in body), fields[-1])] = limit
    call.body = body
    call.max_tokens = limit
    call.raw = orjson.dumps(body)
