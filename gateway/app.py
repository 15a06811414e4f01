"""The gateway application: components, routes, and the path of one request.

``Gateway.handle`` is the whole request path in order: authenticate -> read and parse ->
admit -> cache -> classify -> route -> proxy -> settle, with one place that turns
``GatewayError`` into an OpenAI error response and one access-log line at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import orjson
from aiohttp import HttpVersion11, web
from prometheus_client import REGISTRY, generate_latest

from cache.coalesce import Leader
from cache.entry import CachedCompletion
from cache.keys import CachePlan, endpoint_kind
from cache.metrics import CacheMetrics
from cache.replay import new_completion_id, replay_json, replay_sse
from cache.service import CacheHit, ResponseCache, create_response_cache
from common.breaker import BreakerConfig
from gateway.admin import AdminApi
from gateway.auth import KeyRing
from gateway.autoscale import AutoscaleCollector, PendingTokens
from gateway.errors import (
    BadRequest,
    ExpectationFailed,
    GatewayError,
    GatewayTimeout,
    InternalError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    RequestTimeout,
    ServiceUnavailable,
    error_response,
)
from gateway.logs import AccessLog
from gateway.metrics import FleetCollector, GatewayMetrics, QuotaCollector, watch_loop_lag
from gateway.proxy import Exchange, Proxy
from gateway.reload import ConfigWatcher
from gateway.request import Call, Endpoint, parse_call
from gateway.settings import DEV_API_KEY, ConfigError, Settings, TenantSettings
from gateway.spans import Outcome, RequestSpans, Timeline
from gateway.tracing import TraceContext, start_trace
from limits.config import reservation
from limits.decision import Decision, Lease
from limits.limiter import LimiterOptions, create_limiter
from limits.metrics import LimitsMetrics
from limits.plan import Subject
from replicas.credentials import CredentialError
from replicas.fleet import Fleet
from routing.admission import Admitted
from routing.config import PRIORITIES, Priority
from routing.fair_queue import RejectReason
from routing.metrics import QueueCollector, RoutingMetrics
from routing.router import PoolSpec, Route, Router, TierChoice

log = logging.getLogger("fleetgate.app")

GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway")
# nginx's "client closed request": the client left before the response ended.
CLIENT_CLOSED = 499
# Routing request headers: force a tier (where the tenant allows it), bound the request's
# time, lower its queueing priority. The response carries x-fleetgate-route (debug).
TIER_HEADER = "x-fleetgate-tier"
TIMEOUT_HEADER = "x-fleetgate-timeout-ms"
PRIORITY_HEADER = "x-fleetgate-priority"
ROUTE_HEADER = "x-fleetgate-route"
_MAX_REQUEST_ID = 128


class Gateway:
    """Everything one gateway process holds, built from the settings once."""

    def __init__(
        self,
        settings: Settings,
        *,
        log_dir: Path = Path("logs"),
        config_path: Path | None = None,
        access_stream: IO[bytes] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        # Watched for live edits of tenants (None: the settings came from defaults/env only).
        self.config_path = config_path
        self.clock = clock
        self.metrics = GatewayMetrics()
        self.access_log = AccessLog(access_stream, enabled=settings.server.access_log)
        try:
            self.fleet = Fleet(settings.models, settings.health, restart=settings.restart, log_dir=log_dir, clock=clock)
        except CredentialError as exc:
            raise ConfigError(str(exc)) from None
        self.metrics.registry.register(FleetCollector(self.fleet.all, clock, lambda: self.fleet.by_model))
        self.metrics.registry.register(QuotaCollector(lambda: self.tenants))
        self.proxy = Proxy(settings.upstream, self.metrics, clock)
        try:
            redis_security = settings.redis.resolve(os.environ)
        except ValueError as exc:  # the password's variable or file: only known at start
            raise ConfigError(str(exc)) from exc
        self.cache = create_response_cache(
            settings.redis_url,
            settings.cache,
            CacheMetrics(self.metrics.registry),
            start_semantic=any(t.cache.enabled and t.cache.semantic.enabled for t in settings.tenants),
            security=redis_security,
        )
        ls = settings.limits
        self.limiter = create_limiter(
            settings.redis_url,
            options=LimiterOptions(
                lease_ttl_s=ls.lease_ttl_s,
                heartbeat_s=ls.heartbeat_s,
                breaker=BreakerConfig(failures=ls.breaker_failures, cooldown_s=ls.breaker_cooldown_s),
                redis_timeout_s=ls.redis_timeout_ms / 1000,
            ),
            metrics=LimitsMetrics(self.metrics.registry),
            security=redis_security,
        )
        self._background: set[asyncio.Task[None]] = set()
        self.rng = random.Random()
        # Trace and span ids (gateway.tracing): its own stream, so routing's stays as it was.
        self.trace_rng = random.Random()
        # OpenTelemetry spans: None (off, the default) unless an OTLP endpoint is configured.
        self.spans = RequestSpans.from_environment(os.environ)
        self.ready = False
        # Set on SIGTERM: /readyz answers 503 and every response closes its connection, so
        # clients move to other pods before the listener closes (gateway.cli.serve).
        self.draining = False
        self.routing_metrics = RoutingMetrics(self.metrics.registry, settings.routing.policy)
        self.router = Router.build(
            settings.routing,
            [PoolSpec(m.name, m.tier, tuple(m.fallback), m.capacity) for m in settings.models],
            self.fleet.by_model,
            rng=self.rng,
            clock=clock,
            metrics=self.routing_metrics,
        )
        self.metrics.registry.register(QueueCollector(self.router.depths))
        self.pending = PendingTokens(m.name for m in settings.models)
        self.metrics.registry.register(AutoscaleCollector(self.pending, settings.autoscaling.target))
        self.apply_tenants(settings.tenants, settings.admin_api_keys)
        self.default_model = settings.default_model or settings.models[0].name

    def apply_settings(self, new: Settings) -> None:
        """A reloaded configuration: the parts that apply live (tenants, keys)."""
        self.apply_tenants(new.tenants, new.admin_api_keys)

    def apply_tenants(self, tenants: list[TenantSettings], admin_keys: list[str]) -> None:
        """Swap in a new set of tenants and keys (start-up and hot reload)."""
        entries = [(t.id, [k if isinstance(k, str) else (k.id, k.key) for k in t.api_keys]) for t in tenants]
        try:
            keyring, missing = KeyRing.build(entries)
            admin, missing_admin = KeyRing.build([("admin", admin_keys)])
        except ValueError as exc:  # one key for two tenants: only known once env keys resolve
            raise ConfigError(f"tenants: {exc}") from exc
        for var in missing + missing_admin:
            log.warning("API key variable is not set; that key is disabled", extra={"variable": var})
        self.tenants = {t.id: t for t in tenants}
        self.keyring = keyring
        self.admin_keyring = admin
        self.router.set_weights({t.id: t.weight for t in tenants})

    # -- the request path ---------------------------------------------------------------

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        started = self.clock()
        request_id = _request_id(request)
        headers = {"x-request-id": request_id}
        rh = request.headers
        spans = self.spans
        trace = start_trace(rh.get("traceparent"), rh.get("tracestate"), self.trace_rng, sample_new=spans is not None)
        timeline = Timeline(started) if spans is not None else None
        tenant_id: str | None = None
        model: str | None = None
        ex: Exchange | None = None
        lease: Lease | None = None
        # Tokens a cache hit charges (None: settle on the replica's usage).
        charged: int | None = None
        pending = 0  # tokens counted in self.pending for this request's pool
        status = 500
        error_code: str | None = None
        self.metrics.requests_in_flight += 1
        try:
            # 1 authenticate
            key = self.keyring.owner_of(request.headers.get("Authorization"))
            tenant_id = key.owner
            tenant = self.tenants[tenant_id]
            if timeline is not None:
                timeline.mark("auth", self.clock())
            # 2 read + parse
            call = parse_call(endpoint, await self._read_body(request))
            ex = Exchange(call, request_id, headers, started, trace=trace, timeline=timeline)
            # 5 classify: "auto" -> a model of the right tier. First, because an unknown
            # model needs no admission, and the model that answers is part of the cache key.
            model = self._resolve_model(ex, tenant, request)
            assert ex.route is not None
            pending = ex.route.cost
            self.pending.add(model, pending)
            headers["x-fleetgate-tier"] = self.fleet.tiers[model]
            if timeline is not None:
                timeline.mark("parse", self.clock())
            # 3 admit: rate limits, concurrency, quotas (a rejection is a value, not a surprise)
            reserve = reservation(call.prompt_tokens_estimate, call.max_tokens, tenant.limits, call.n)
            decision = await self.limiter.admit(Subject(tenant.id, key.key_id, call.model), tenant.limits, reserve)
            headers.update(decision.headers())
            if timeline is not None:
                timeline.mark("limits", self.clock())
            if not decision.allowed:
                raise _rejection(decision)
            lease = decision.lease
            # 4 cache: a stored answer, or the same request already in flight
            plan = self.cache.plan(
                tenant.id, model, endpoint, call.body, tenant.cache, request.headers.get("Cache-Control")
            )
            cached, leader = await self._from_cache(request, ex, plan, tenant)
            if timeline is not None:
                timeline.mark("cache", self.clock())
            if cached is not None:
                response = await self._replay(request, ex, cached)
                status = ex.status
                charged = ResponseCache.tokens_to_charge(cached.completion, tenant.cache)
                return response
            headers["x-fleetgate-cache"] = "miss"
            # The leader's flight ends with this block, however the request does: refused
            # while queued, cancelled or failed, its followers never wait on it in vain.
            with leader or contextlib.nullcontext():
                # 6 route: a slot in the model's pool (a fair wait when every replica is full),
                # then the picker that chooses a replica per attempt; 7 proxy
                pick = await self._picker(ex, tenant, request)
                if timeline is not None:
                    timeline.mark("queue", self.clock())
                if call.stream:
                    response = await self.proxy.stream(ex, pick, request)
                else:
                    response = await self.proxy.complete(ex, pick)
                if leader is not None and ex.completion is not None:
                    leader.publish(ex.completion)
            if plan.store and plan.key is not None and ex.completion is not None:
                self.cache.store_later(plan.key, ex.completion, tenant.cache, plan.semantic)
            status = ex.status or response.status
            error_code = ex.error_code
            return response
        except GatewayError as err:
            status, error_code = err.status, err.code
            return error_response(err, headers)
        except asyncio.CancelledError:
            status, error_code = self._client_left(model)
            raise
        except ConnectionResetError:
            # Writing to a client that already left (aiohttp's ClientConnectionResetError),
            # found by a write before the handler's cancellation arrives: the same disconnect.
            status, error_code = self._client_left(model)
            if ex is not None and ex.response is not None:
                return ex.response
            return web.Response(status=CLIENT_CLOSED, headers=headers)
        except Exception:
            log.exception("unexpected error", extra={"request_id": request_id})
            internal = InternalError("The gateway hit an unexpected error; it has been logged.")
            status, error_code = internal.status, internal.code
            return error_response(internal, headers)
        finally:
            # 8 settle: the pool's next waiting request, limits, metrics, one log line
            if ex is not None and ex.route is not None:
                ex.route.finished()
            self.metrics.requests_in_flight -= 1
            if pending and model is not None:
                self.pending.remove(model, pending)
            if lease is not None:
                self._settle(lease, charged if charged is not None else _used_tokens(ex))
            entry = self._record(endpoint, request_id, tenant_id, model, ex, status, error_code, started, trace)
            if spans is not None and timeline is not None:
                self._emit_spans(spans, trace, timeline, entry, ex)

    def _client_left(self, model: str | None) -> tuple[int, str]:
        if model is not None:
            self.metrics.client_disconnects.labels(model).inc()
        return CLIENT_CLOSED, "client_closed"

    def _settle(self, lease: Lease, used: int | None) -> None:
        """Settle in the background: the response need not wait for the limit store."""
        if lease.origin == "none":
            return
        if self.limiter.settle_locally(lease, used):
            return  # memory store: done synchronously, no task needed
        task = asyncio.create_task(self.limiter.settle(lease, used), name="settle")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _from_cache(
        self, request: web.Request, ex: Exchange, plan: CachePlan, tenant: TenantSettings
    ) -> tuple[CacheHit | None, Leader | None]:
        """A cached answer (exact or semantic); else, for a cacheable request, the ``Leader``
        that goes upstream.

        A request identical to one in flight waits for that one's answer (a streaming
        client gets keep-alives meanwhile) instead of going upstream itself.
        """
        if plan.key is None:
            return None, None
        ex.cache_kind = endpoint_kind(ex.call.endpoint)
        ex.cache_max_chars = tenant.cache.max_entry_bytes
        cached = await self.cache.find(plan)
        if cached is not None or not plan.coalesce:
            return cached, None
        wait_s = self.settings.upstream.first_byte_timeout_s
        joining = self.cache.coalesce(plan.key, wait_s)
        if ex.call.stream:
            joined = await self.proxy.with_keepalive(ex, request, joining, discard=_end_flight)
        else:  # keep-alives are SSE comments: a JSON client just waits
            joined = await joining
        return (CacheHit("exact", joined), None) if isinstance(joined, CachedCompletion) else (None, joined)

    async def finish_background(self, timeout_s: float) -> None:
        """Let settlements still in flight reach the limit store before it closes (bounded)."""
        if self._background:
            await asyncio.wait(self._background, timeout=timeout_s)

    async def _replay(self, request: web.Request, ex: Exchange, hit: CacheHit) -> web.StreamResponse:
        """Answer from the cache, in the shape the client asked for."""
        ex.headers["x-fleetgate-cache"] = hit.kind
        cached = hit.completion
        ex.usage = cached.usage
        ex.status = 200
        ex.first_token_at = self.clock()
        completion_id, created = new_completion_id(cached.kind), int(time.time())
        if not ex.call.stream:
            body = replay_json(cached, completion_id=completion_id, created=created)
            return web.Response(body=body, content_type="application/json", headers=ex.headers)
        events = replay_sse(
            cached, completion_id=completion_id, created=created, include_usage=ex.call.client_wants_usage
        )
        response = ex.response or await self.proxy.prepare(ex, request)
        await response.write(events)
        await response.write_eof()
        return response

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.settings.server.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise PayloadTooLarge(f"The request body is larger than the {limit}-byte limit.")
        try:
            if request.content.is_eof():  # all of it arrived with the headers: nothing to wait for
                return await request.read()
            async with asyncio.timeout(self.settings.server.body_timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise PayloadTooLarge(f"The request body is larger than the {limit}-byte limit.") from exc
        except TimeoutError as exc:
            raise RequestTimeout("The request body did not arrive in time.") from exc

    def _resolve_model(self, ex: Exchange, tenant: TenantSettings, request: web.Request) -> str:
        """The model whose pool serves the request; sets up its ``Route`` (``ex.route``).

        ``auto`` (and the tenant's ``classify_models``) is classified into a tier, served by
        that tier's model; the ``x-fleetgate-tier`` request header forces a tier where the
        tenant allows it. When no model serves a routing tier, ``auto`` is ``default_model``.
        """
        call = ex.call
        name = call.model
        choice: TierChoice | None = None
        if (name == "auto" or name in tenant.classify_models) and call.endpoint is not Endpoint.EMBEDDINGS:
            forced = request.headers.get(TIER_HEADER)
            choice = self.router.choose_tier(call.body, forced, self._forcible(tenant) if forced else ())
        if choice is not None:
            model = choice.model
            if self.settings.routing.debug_header:
                ex.headers[ROUTE_HEADER] = choice.header()
        elif name == "auto":
            model = self.default_model
        elif name in self.fleet.by_model:
            model = name
        else:
            raise NotFound(
                f"The model '{name}' does not exist or you do not have access to it.",
                code="model_not_found",
                param="model",
            )
        ex.route = self.router.route(model, call.body, call.prompt_tokens_estimate, call.max_tokens, choice, tenant.id)
        return model

    def _forcible(self, tenant: TenantSettings) -> tuple[str, ...] | list[str]:
        """Tiers the tenant may force with the request header."""
        allowed = tenant.allow_force_tier
        if allowed is True:
            return self.router.tiers.names
        return allowed or ()

    async def _picker(self, ex: Exchange, tenant: TenantSettings, request: web.Request) -> Route:
        """Step 6: the request's deadline, then a slot in its model's pool, and its picker.

        While some replica of the pool has room this is a counter check. When every one is
        at capacity the tenant's degradation applies (overflow to a smaller tier, a
        ``max_tokens`` clamp), then the request waits in the pool's fair queue: until a slot
        frees up, or a 429 (its tenant's queue is full), 503 (waited its priority's longest
        wait) or 504 (its own deadline passed), each with ``Retry-After`` where retrying helps.
        """
        route = ex.route
        assert route is not None
        ex.deadline, ex.cut_at_deadline = self._deadline(request, ex.started)
        now = self.clock()
        if route.pool.admission.ready(now):
            return route
        self._degrade(ex, tenant, route, now)
        admission = route.pool.admission
        if admission.ready(now):
            return route
        wait_s = self.settings.routing.queue.max_wait_s.for_priority(_priority(tenant, request))
        deadline = min(now + wait_s, ex.deadline)
        outcome = await admission.wait(tenant.id, route.cost, deadline)
        rm = self.routing_metrics
        if isinstance(outcome, Admitted):
            route.queued_s = outcome.waited_s
            rm.series(rm.queue_wait, route.model, tenant.id).observe(outcome.waited_s)
            return route
        route.queued_s = self.clock() - now
        retry_after = {"Retry-After": str(max(1, math.ceil(outcome.retry_after_s)))}
        err: GatewayError
        if outcome.reason is RejectReason.QUEUE_FULL:
            reason = "queue_full"
            err = RateLimited(
                f"Too many of your requests are waiting for '{route.model}'; retry later.",
                code="queue_full",
                headers=retry_after,
            )
        elif deadline >= ex.deadline:
            reason = "deadline"
            err = GatewayTimeout(
                "The request's deadline passed while it waited for a free replica.", code="deadline_exceeded"
            )
        else:
            reason = "wait_exceeded"
            err = ServiceUnavailable(
                f"Every replica of '{route.model}' stayed busy for {wait_s:g} s; retry later.",
                code="queue_timeout",
                headers=retry_after,
            )
        rm.series(rm.shed, route.model, tenant.id, reason).inc()
        raise err

    def _deadline(self, request: web.Request, started: float) -> tuple[float, bool]:
        """When the request must be answered: ``upstream.request_timeout_s`` after it started,
        or sooner if the client asks (``x-fleetgate-timeout-ms``; True: cut attempts there)."""
        limit = self.settings.upstream.request_timeout_s
        sent = request.headers.get(TIMEOUT_HEADER)
        if sent is None:
            return started + limit, False
        try:
            ms = int(sent)
        except ValueError:
            ms = 0
        if ms <= 0:
            raise BadRequest(f"The {TIMEOUT_HEADER} header must be a positive integer (milliseconds).")
        return started + min(ms / 1000, limit), True

    def _degrade(self, ex: Exchange, tenant: TenantSettings, route: Route, now: float) -> None:
        """The tenant's graceful degradation, when its request's pool is saturated."""
        degrade = tenant.degrade
        rm = self.routing_metrics
        if degrade.overflow and route.choice is not None:
            for smaller in self.router.tiers.smaller(route.choice.tier):
                if self.router.pools[smaller].admission.ready(now):
                    rm.series(rm.degraded, route.model, tenant.id, "overflow").inc()
                    route.switch(smaller, "overflow")
                    ex.headers["x-fleetgate-tier"] = self.fleet.tiers[smaller]
                    ex.cache_kind = None  # not the answer the cache key names
                    return
        limit = degrade.max_tokens
        if limit is not None and (ex.call.max_tokens is None or ex.call.max_tokens > limit):
            rm.series(rm.degraded, route.model, tenant.id, "max_tokens").inc()
            _clamp_max_tokens(ex.call, limit)
            route.clamp(limit)
            ex.cache_kind = None

    def _record(
        self,
        endpoint: Endpoint,
        request_id: str,
        tenant_id: str | None,
        model: str | None,
        ex: Exchange | None,
        status: int,
        error_code: str | None,
        started: float,
        trace: TraceContext,
    ) -> dict[str, Any]:
        now = self.clock()
        elapsed = now - started
        model_label = model or "-"
        m = self.metrics
        m.series(m.requests, endpoint.label, model_label, str(status)).inc()
        m.latency.observe((endpoint.label, model_label), elapsed)
        entry: dict[str, Any] = {
            "request_id": request_id,
            "tenant": tenant_id,
            "endpoint": endpoint.label,
            "model": model,
            "status": status,
            "duration_ms": round(elapsed * 1000, 2),
            "trace_id": trace.trace_id,
            "span_id": trace.span_id,
        }
        if error_code:
            entry["error"] = error_code
        if ex is not None:
            entry["stream"] = ex.call.stream
            entry["attempts"] = ex.attempts
            if ex.route is not None:
                ex.route.annotate(entry)
            if ex.replica is not None:
                entry["replica"] = ex.replica.id
            if ex.first_token_at is not None:
                ttft = ex.first_token_at - started
                entry["ttft_ms"] = round(ttft * 1000, 2)
                m.ttft.observe((model_label,), ttft)
            if ex.usage:
                prompt = int(ex.usage.get("prompt_tokens") or 0)
                completion = int(ex.usage.get("completion_tokens") or 0)
                entry["prompt_tokens"], entry["completion_tokens"] = prompt, completion
                if tenant_id is not None:
                    m.series(m.tokens, tenant_id, model_label, "prompt").inc(prompt)
                    m.series(m.tokens, tenant_id, model_label, "completion").inc(completion)
            if ex.upstream_started is not None:
                upstream = (ex.upstream_ended or now) - ex.upstream_started
                m.overhead.observe((endpoint.label,), max(0.0, elapsed - upstream))
            if self.settings.server.log_prompts:
                entry["body"] = ex.call.body
        self.access_log.write(entry)
        return entry

    def _emit_spans(
        self, spans: RequestSpans, trace: TraceContext, timeline: Timeline, entry: dict[str, Any], ex: Exchange | None
    ) -> None:
        """The request's OpenTelemetry spans (only with tracing on, after the response)."""
        if timeline.attempts and timeline.attempts[-1].end is None and ex is not None:
            timeline.attempts[-1].end = ex.upstream_ended
        try:
            spans.emit(trace, timeline, Outcome.from_access_entry(entry, ex.call.body if ex else None), self.clock())
        except Exception:  # tracing must never fail a request
            log.exception("could not record the request's spans", extra={"request_id": entry.get("request_id")})

    # -- other endpoints --------------------------------------------------------------------

    async def list_models(self, request: web.Request) -> web.Response:
        headers = {"x-request-id": _request_id(request)}
        try:
            self.keyring.owner_of(request.headers.get("Authorization"))
        except GatewayError as err:
            return error_response(err, headers)
        data = [_model_object(n) for n in ("auto", *self.fleet.by_model)]
        return web.json_response({"object": "list", "data": data}, headers=headers)

    async def retrieve_model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}``: one model, in OpenAI's shape (404 ``model_not_found``)."""
        headers = {"x-request-id": _request_id(request)}
        name = request.match_info["model"]
        try:
            self.keyring.owner_of(request.headers.get("Authorization"))
            if name != "auto" and name not in self.fleet.by_model:
                raise NotFound(f"The model '{name}' does not exist.", code="model_not_found", param="model")
        except GatewayError as err:
            return error_response(err, headers)
        return web.json_response(_model_object(name), headers=headers)

    async def healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, _: web.Request) -> web.Response:
        """Ready: this process can answer (started, not draining). Not "a replica is healthy":
        with none, requests get an OpenAI-shaped 503 (``no_healthy_replica``) and
        ``fleetgate_model_healthy_replicas`` says 0, which a pod outside the Service could not."""
        if self.ready and not self.draining:
            return web.json_response({"status": "ready", "healthy_replicas": self.fleet.healthy_count()})
        return error_response(ServiceUnavailable("Not ready: starting or draining."), {})

    async def prometheus(self, _: web.Request) -> web.Response:
        # The gateway's own registry (every package's metrics) plus the process-wide one (process stats).
        body = generate_latest(self.metrics.registry) + generate_latest(REGISTRY)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def not_found(self, request: web.Request) -> web.Response:
        known = {e.value for e in Endpoint} | {"/v1/models", "/healthz", "/readyz"}
        if self.settings.server.admin_port is None:  # else they live on the admin port only
            known |= {"/metrics", "/admin/fleet"}
        if request.path in known or request.path.startswith("/v1/models/"):
            err: GatewayError = MethodNotAllowed(f"Method {request.method} is not allowed on {request.path}.")
        else:
            err = NotFound(f"Unknown path {request.path}.", code="unknown_url")
        return error_response(err, {"x-request-id": _request_id(request)})


def _model_object(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "fleetgate"}


def _rejection(decision: Decision) -> GatewayError:
    """A limiter's rejection as the client's error: 429 (or 503 when the limit store is down)."""
    err: GatewayError
    if decision.status == ServiceUnavailable.status:
        err = ServiceUnavailable(decision.message, code=decision.error_code, headers=decision.headers())
    else:
        err = RateLimited(decision.message, code=decision.error_code, headers=decision.headers())
        err.type = decision.error_type or err.type
    return err


def _end_flight(joined: Leader | CachedCompletion) -> None:
    """A flight led by a request that left before it could go upstream: end it."""
    if isinstance(joined, Leader):
        joined.abandon()


def _priority(tenant: TenantSettings, request: web.Request) -> Priority:
    """The tenant's priority, or a lower one the request asks for (never a higher one)."""
    asked = request.headers.get(PRIORITY_HEADER)
    for level in PRIORITIES:
        if level == tenant.priority:
            return level
        if level == asked:
            return level
    return tenant.priority


def _clamp_max_tokens(call: Call, limit: int) -> None:
    """Lower the request's max_tokens to ``limit`` (graceful degradation), in the forwarded body too."""
    body = dict(call.body)
    body["max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"] = limit
    call.body = body
    call.max_tokens = limit
    call.raw = orjson.dumps(body)


def _used_tokens(ex: Exchange | None) -> int | None:
    """Tokens to settle: the replica's usage; else what was seen streaming; None releases."""
    if ex is None:
        return None
    if ex.usage:
        total = ex.usage.get("total_tokens")
        if isinstance(total, int):
            return total
    if ex.generated:
        return ex.call.prompt_tokens_estimate + ex.generated
    return None


# Generated request ids: a random prefix per process and a counter (unique across pods,
# and cheaper than fresh random bytes for every request).
_ID_PREFIX = os.urandom(6).hex()
_ID_SERIAL = itertools.count(1)


def _request_id(request: web.Request) -> str:
    sent = request.headers.get("x-request-id")
    # Printable ASCII only: it goes back out in headers (to the client, to replicas).
    if sent and len(sent) <= _MAX_REQUEST_ID and sent.isascii() and sent.isprintable():
        return sent
    return f"{_ID_PREFIX}{next(_ID_SERIAL):012x}"


def create_app(gateway: Gateway) -> web.Application:
    """The aiohttp application; the gateway's parts start and stop with it, in order."""
    app = web.Application(client_max_size=gateway.settings.server.max_body_bytes)
    app[GATEWAY_KEY] = gateway

    def route(endpoint: Endpoint) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await gateway.handle(request, endpoint)

        return handler

    for endpoint in Endpoint:
        app.router.add_post(endpoint.value, route(endpoint))
    app.router.add_get("/v1/models", gateway.list_models)
    app.router.add_get("/v1/models/{model:.+}", gateway.retrieve_model)
    app.router.add_get("/healthz", gateway.healthz)
    app.router.add_get("/readyz", gateway.readyz)
    if gateway.settings.server.admin_port is None:
        _add_monitoring_routes(app, gateway)
    app.router.add_route("*", "/{tail:.*}", gateway.not_found)
    app.on_response_prepare.append(_close_while_draining)
    _answer_expect_in_openai_shape(app)
    app.cleanup_ctx.append(_lifecycle)
    return app


def create_admin_app(gateway: Gateway) -> web.Application:
    """The admin/metrics listener's application (``server.admin_port``): /metrics, /admin/*
    and the probes, apart from the API, so a NetworkPolicy can keep it to the monitoring
    namespace. It shares the API application's gateway and lifecycle (serve it alongside)."""
    app = web.Application()
    app.router.add_get("/healthz", gateway.healthz)
    app.router.add_get("/readyz", gateway.readyz)
    _add_monitoring_routes(app, gateway)
    app.router.add_route("*", "/{tail:.*}", gateway.not_found)
    _answer_expect_in_openai_shape(app)
    return app


def _add_monitoring_routes(app: web.Application, gateway: Gateway) -> None:
    admin = AdminApi(gateway.fleet, lambda: gateway.admin_keyring)
    metrics = gateway.prometheus
    app.router.add_get("/metrics", admin.guarded(metrics) if gateway.settings.server.metrics_require_key else metrics)
    admin.add_routes(app)


async def _close_while_draining(request: web.Request, response: web.StreamResponse) -> None:
    """While draining, each response ends its keep-alive connection: the client's next request
    opens a new connection, which the Service sends to a pod that is staying."""
    if request.app[GATEWAY_KEY].draining:
        response.force_close()
        response.headers["Connection"] = "close"  # the header is computed before this hook runs


def _answer_expect_in_openai_shape(app: web.Application) -> None:
    """Every route of ``app`` answers an ``Expect`` header with ``_expect``."""
    for each in app.router.routes():
        each._expect_handler = _expect


async def _expect(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue`` as aiohttp answers it; any other expectation is a 417 in
    OpenAI's shape (aiohttp's own is plain text, and a 500 for a header that is not UTF-8)."""
    if request.headers.get("Expect", "").lower() != "100-continue":
        err = ExpectationFailed("Only 'Expect: 100-continue' is supported.")
        return error_response(err, {"x-request-id": _request_id(request)})
    if request.version == HttpVersion11:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response itself is still to come
    return None


async def _lifecycle(app: web.Application) -> Any:
    gateway = app[GATEWAY_KEY]
    settings = gateway.settings
    if settings.uses_dev_tenant:
        log.warning(
            "using the development tenant and its well-known key; do not expose this gateway",
            extra={"api_key": DEV_API_KEY},
        )
    elif not settings.tenants:
        log.warning("no tenants configured: every request will be refused with 401")
    async with contextlib.AsyncExitStack() as stack:
        for part in (gateway.limiter, gateway.cache, gateway.proxy, gateway.fleet):
            await stack.enter_async_context(part)
        if gateway.spans is not None:
            await stack.enter_async_context(gateway.spans)
        if gateway.config_path is not None:
            count = gateway.metrics.config_reloads.labels
            await stack.enter_async_context(
                ConfigWatcher(gateway.config_path, settings, gateway.apply_settings, lambda r: count(r).inc())
            )
        gateway.ready = True
        announce = asyncio.create_task(_announce_ready(gateway), name="announce-ready")
        lag = asyncio.create_task(watch_loop_lag(gateway.metrics.loop_lag, time.monotonic), name="loop-lag")
        yield
        gateway.ready = False
        announce.cancel()
        lag.cancel()
        gateway.router.close()  # requests still queued get their 503 now, not at their deadline
        await gateway.fleet.drain_all(settings.server.shutdown_grace_s)
        await gateway.finish_background(settings.server.shutdown_grace_s)
        gateway.access_log.flush()


async def _announce_ready(gateway: Gateway) -> None:
    """Log when the first replica becomes routable (vLLM can take minutes to load)."""
    if await gateway.fleet.wait_healthy(gateway.settings.health.start_timeout_s):
        log.info("gateway ready", extra={"healthy_replicas": gateway.fleet.healthy_count()})
    else:
        log.error("no replica became healthy in time; answering 503 until one does")
