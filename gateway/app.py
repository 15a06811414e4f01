"""The gateway application: its components, its routes, and the runner of the request path.

``Gateway`` builds every part once from the settings. ``Gateway.handle`` runs one request
through the stages ``gateway.stages`` declares (authenticate -> parse -> classify -> admit
-> cache -> queue -> forward) until one replies, answers a ``GatewayError`` in OpenAI's
shape in one place, and hands the finished request to ``gateway.accounting`` (settle,
metrics, one access-log line).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from aiohttp import HttpVersion11, web
from prometheus_client import REGISTRY, generate_latest

from cache.coalesce import Wake
from cache.metrics import CacheMetrics
from cache.service import create_response_cache
from common.breaker import BreakerConfig
from common.idle_trim import IdleTrim, glibc_malloc_trim, release_memory, trim_when_idle
from conversations.factory import create_response_store
from dialects.base import Dialect
from dialects.registry import DIALECTS
from gateway.accounting import Accounting
from gateway.admin import AdminApi
from gateway.auth import KeyRing, credential
from gateway.autoscale import AutoscaleCollector, PendingTokens
from gateway.errors import (
    ExpectationFailed,
    GatewayError,
    InternalError,
    MethodNotAllowed,
    NotFound,
    ServiceUnavailable,
    error_response,
)
from gateway.exchange import CLIENT_CLOSED, REQUEST_ID_HEADER, Exchange, request_id
from gateway.logs import AccessLog
from gateway.lora import AdapterLoader
from gateway.metrics import FleetCollector, GatewayMetrics, QuotaCollector, watch_loop_lag
from gateway.proxy import Proxy
from gateway.reload import ConfigWatcher
from gateway.responses_state import ResponseState
from gateway.settings import DEV_API_KEY, ConfigError, Settings, TenantSettings, chunk_gaps
from gateway.spans import RequestSpans, Timeline
from gateway.stages import CONTINUE, Reply, Stages
from gateway.tracing import start_trace
from limits.limiter import LimiterOptions, create_limiter
from limits.metrics import LimitsMetrics
from replicas.credentials import CredentialError
from replicas.fleet import Fleet
from routing.adapters import AdapterCatalog, AdapterSpec
from routing.embedding_head import EmbeddingHeadError, load_head
from routing.metrics import QueueCollector, RoutingMetrics
from routing.router import PoolSpec, Router
from routing.static_head import StaticHeadError, load_static_head

log = logging.getLogger("fleetgate.app")

GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway")


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
        self.proxy = Proxy(settings.upstream, self.metrics, clock, chunk_gaps=chunk_gaps(settings))
        try:
            self.fleet = Fleet(
                settings.models,
                settings.health,
                restart=settings.restart,
                log_dir=log_dir,
                clock=clock,
                on_down=self.proxy.abandon,
            )
        except CredentialError as exc:
            raise ConfigError(str(exc)) from None
        self.metrics.registry.register(FleetCollector(self.fleet.all, clock, lambda: self.fleet.by_model))
        self.metrics.registry.register(QuotaCollector(lambda: self.tenants))
        try:
            redis_security = settings.redis.resolve(os.environ)
        except ValueError as exc:  # the password's variable or file: only known at start
            raise ConfigError(str(exc)) from exc
        self.cache = create_response_cache(
            settings.redis_url,
            settings.cache,
            CacheMetrics(self.metrics.registry),
            # The embedder also loads at start for a classifier told to embed every auto request.
            start_semantic=any(t.cache.enabled and t.cache.semantic.enabled for t in settings.tenants)
            or settings.routing.classifier.embedding == "always",
            security=redis_security,
        )
        self.responses = ResponseState(
            create_response_store(settings.redis_url, settings.responses, redis_security, clock=clock),
            settings.responses,
            self.metrics,
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
        self.rng = random.Random()
        # Trace and span ids (gateway.tracing): its own stream, so routing's stays as it was.
        self.trace_rng = random.Random()
        # OpenTelemetry spans: None (off, the default) unless an OTLP endpoint is configured.
        self.spans = RequestSpans.from_environment(os.environ, stage_spans=settings.tracing.stage_spans)
        self.accounting = Accounting(
            self.metrics, self.access_log, self.limiter, self.spans, clock, log_prompts=settings.server.log_prompts
        )
        self.ready = False
        # Set on SIGTERM: /readyz answers 503 and every response closes its connection, so
        # clients move to other pods before the listener closes (gateway.cli.serve).
        self.draining = False
        self.routing_metrics = RoutingMetrics(self.metrics.registry, settings.routing.policy)
        classifier = settings.routing.classifier
        try:
            head = None if classifier.embedding == "never" else load_head(classifier.embedding_head_path)
        except EmbeddingHeadError as exc:
            raise ConfigError(f"routing.classifier.embedding_head_path: {exc}") from exc
        try:
            static = load_static_head(classifier.static_head_path) if classifier.static_head_path else None
        except StaticHeadError as exc:
            raise ConfigError(f"routing.classifier.static_head_path: {exc}") from exc
        self.router = Router.build(
            settings.routing,
            [PoolSpec(m.name, m.tier, tuple(m.fallback), m.capacity) for m in settings.models],
            self.fleet.by_model,
            rng=self.rng,
            clock=clock,
            metrics=self.routing_metrics,
            head=head,
            static=static,
        )
        self.metrics.registry.register(QueueCollector(self.router.depths))
        configured = [AdapterSpec(a.name, m.name, a.path) for m in settings.models for a in m.adapters]
        self.adapters = AdapterLoader(
            AdapterCatalog(configured, self.fleet.by_model),
            self.fleet.by_model,
            lambda: self.proxy.client,
            timeout_s=settings.upstream.adapter_load_timeout_s,
            clock=clock,
        )
        self.pending = PendingTokens(m.name for m in settings.models)
        self.metrics.registry.register(AutoscaleCollector(self.pending, settings.autoscaling.target))
        self.apply_tenants(settings.tenants, settings.admin_api_keys)

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
        # The request path, rebuilt with the tenants: their keys, and whether any uses the cache.
        self.stages = Stages(
            self.settings,
            keyring=keyring,
            tenants=self.tenants,
            fleet=self.fleet,
            router=self.router,
            limiter=self.limiter,
            cache=self.cache,
            proxy=self.proxy,
            pending=self.pending,
            routing_metrics=self.routing_metrics,
            responses=self.responses,
            adapters=self.adapters,
            clock=self.clock,
        )

    # -- the request path ---------------------------------------------------------------

    async def handle(self, request: web.Request, dialect: Dialect) -> web.StreamResponse:
        """Run the request through its API's path (``self.stages.paths``) until a stage replies, then account."""
        started = self.clock()
        rh = request.headers
        spans = self.spans
        rid = request_id(request)
        ex = Exchange(dialect, rid, {REQUEST_ID_HEADER: rid}, started)
        trace = start_trace(
            rh.get("traceparent"), rh.get("tracestate"), self.trace_rng, spans.sampler if spans is not None else None
        )
        ex.trace = trace
        if spans is not None and trace.sampled:  # only a sampled request notes its stages' times
            ex.timeline = Timeline(started)
        self.metrics.requests_in_flight += 1
        self.metrics.requests_started += 1
        left = False
        try:
            reply: Reply = CONTINUE
            for stage in self.stages.paths[dialect]:
                reply = await stage(ex, request)
                if reply is not CONTINUE:
                    break
            if isinstance(reply, GatewayError):
                return _refuse(ex, reply)
            assert reply is not None, "the last stage always replies"
            ex.status = ex.status or reply.status
            return reply
        except GatewayError as err:
            return _refuse(ex, err)
        except asyncio.CancelledError:
            left = True
            self._client_left(ex)
            raise
        except ConnectionResetError:
            # Writing to a client that already left (aiohttp's ClientConnectionResetError),
            # found by a write before the handler's cancellation arrives: the same disconnect.
            self._client_left(ex)
            if ex.response is not None:
                return ex.response
            return web.Response(status=CLIENT_CLOSED, headers=ex.headers)
        except Exception:
            log.exception("unexpected error", extra={"request_id": ex.request_id})
            return _refuse(ex, InternalError("The gateway hit an unexpected error; it has been logged."))
        finally:
            # The leader's flight ends with the request, however it ends: refused while
            # queued, cancelled or failed, its followers never wait on it in vain.
            if ex.leader is not None:
                ex.leader.abandon(Wake.HANDOFF if left else Wake.SOLO)
            # The pool's next waiting request, then limits, metrics, one log line.
            if ex.route is not None:
                ex.route.finished()
            self.metrics.requests_in_flight -= 1
            if ex.pending and ex.pool is not None:
                self.pending.remove(ex.pool, ex.pending)
            self.accounting.close(ex)

    def _client_left(self, ex: Exchange) -> None:
        if ex.model is not None:
            self.metrics.client_disconnects.labels(ex.model).inc()
        if ex.response is not None and ex.cut is None:
            ex.cut = "client_gone"  # a stream under way (its status already sent)
        ex.status, ex.error_code = CLIENT_CLOSED, "client_closed"

    # -- other endpoints --------------------------------------------------------------------

    async def list_models(self, request: web.Request) -> web.Response:
        headers = {"x-request-id": request_id(request)}
        try:
            key = self.keyring.owner_of(credential(request.headers))
        except GatewayError as err:
            return error_response(err, headers)
        # Every tenant may call every fleet model, so every tenant sees every adapter too.
        adapters = self.adapters.catalog.listing()
        names = ("auto", *self.fleet.by_model, *self._aliases(key.owner), *adapters)
        data = [_model_object(n, adapters.get(n)) for n in names]
        page = {"object": "list", "data": data, "has_more": False, "first_id": names[0], "last_id": names[-1]}
        return web.json_response(page, headers=headers)

    def _aliases(self, tenant_id: str) -> list[str]:
        """The tenant's model aliases whose target it can call."""
        tenant = self.tenants.get(tenant_id)
        if tenant is None:
            return []
        known = self.fleet.by_model
        return [alias for alias, target in tenant.model_aliases.items() if target == "auto" or target in known]

    async def retrieve_model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}``: one model, in OpenAI's shape (404 ``model_not_found``)."""
        headers = {"x-request-id": request_id(request)}
        name = request.match_info["model"]
        try:
            key = self.keyring.owner_of(credential(request.headers))
            parent = self.adapters.catalog.base_of(name)
            known = name == "auto" or name in self.fleet.by_model or name in self._aliases(key.owner)
            if not known and parent is None:
                raise NotFound(f"The model '{name}' does not exist.", code="model_not_found", param="model")
        except GatewayError as err:
            return error_response(err, headers)
        return web.json_response(_model_object(name, parent), headers=headers)

    async def stored_response(self, request: web.Request) -> web.Response:
        """``GET``/``DELETE /v1/responses/{id}``, ``GET .../input_items``, ``POST .../cancel``:
        the tenant's stored responses (``gateway.responses_state``)."""
        headers = {"x-request-id": request_id(request)}
        try:
            key = self.keyring.owner_of(credential(request.headers))
            tenant = self.tenants[key.owner]
            response_id = request.match_info["response_id"]
            action = request.match_info.get("action", "")
            state = self.responses
            if request.method == "DELETE" and not action:
                response = await state.delete(tenant, response_id)
            elif request.method == "GET" and action in ("", "input_items"):
                response = await (state.input_items if action else state.retrieve)(tenant, response_id)
            elif request.method == "POST" and action == "cancel":
                response = await state.cancel(tenant, response_id)
            else:
                raise MethodNotAllowed(f"Method {request.method} is not allowed on {request.path}.")
        except GatewayError as err:
            return error_response(err, headers)
        response.headers.update(headers)
        return response

    async def healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, _: web.Request) -> web.Response:
        """Ready: this process can serve (started, its fleet's state known, not draining).

        At start it waits until the fleet's state is known (``replicas.readiness``; set by
        ``_announce_ready``). From then on it is not "a replica is healthy": with none,
        requests get an OpenAI-shaped 503 (``no_healthy_replica``) and
        ``fleetgate_model_healthy_replicas`` says 0, which a pod outside the Service could not."""
        if self.ready and not self.draining:
            return web.json_response({"status": "ready", "healthy_replicas": self.fleet.healthy_count()})
        why = "draining" if self.draining else "starting, the fleet's state is not known yet"
        return error_response(ServiceUnavailable(f"Not ready: {why}."), {})

    async def prometheus(self, _: web.Request) -> web.Response:
        # The gateway's own registry (every package's metrics) plus the process-wide one (process stats).
        body = generate_latest(self.metrics.registry) + generate_latest(REGISTRY)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def not_found(self, request: web.Request) -> web.Response:
        known = {d.path for d in DIALECTS} | {"/v1/models", "/healthz", "/readyz", "/v1/responses/{id}"}
        if self.settings.server.admin_port is None:  # else they live on the admin port only
            known |= {"/metrics", "/admin/fleet"}
        if request.path in known or request.path.startswith("/v1/models/"):
            err: GatewayError = MethodNotAllowed(f"Method {request.method} is not allowed on {request.path}.")
        else:
            paths = ", ".join(sorted(known | {"/v1/models/{model}"}))
            err = NotFound(f"Unknown path {request.path}. The gateway serves: {paths}.", code="unknown_url")
        return error_response(err, {"x-request-id": request_id(request)})


def _refuse(ex: Exchange, err: GatewayError) -> web.Response:
    """The request's answer is ``err``, in its API's error shape."""
    ex.status, ex.error_code = err.status, err.code
    return error_response(err, ex.headers, ex.dialect.errors)


def _model_object(name: str, parent: str | None = None) -> dict[str, Any]:
    """A model in OpenAI's shape, with the fields Anthropic's SDK reads (``type``,
    ``display_name``, ``created_at``) beside them: one list serves both SDKs. A LoRA
    adapter names its base model in ``parent``, as vLLM lists it."""
    model: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "fleetgate",
        "type": "model",
        "display_name": name,
        "created_at": "1970-01-01T00:00:00Z",
    }
    if parent is not None:
        model["parent"] = parent
    return model


def create_app(gateway: Gateway) -> web.Application:
    """The aiohttp application; the gateway's parts start and stop with it, in order."""
    server = gateway.settings.server
    app = web.Application(client_max_size=max(server.max_body_bytes, server.max_audio_bytes))
    app[GATEWAY_KEY] = gateway

    def route(dialect: Dialect) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await gateway.handle(request, dialect)

        return handler

    for dialect in DIALECTS:
        app.router.add_post(dialect.path, route(dialect))
    stored = gateway.stored_response
    app.router.add_route("*", "/v1/responses/{response_id}", stored)
    app.router.add_route("*", "/v1/responses/{response_id}/{action}", stored)
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
        return error_response(err, {"x-request-id": request_id(request)})
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
        for part in (gateway.limiter, gateway.cache, gateway.responses, gateway.proxy, gateway.fleet):
            await stack.enter_async_context(part)
        if gateway.spans is not None:
            await stack.enter_async_context(gateway.spans)
        if gateway.config_path is not None:
            count = gateway.metrics.config_reloads.labels
            await stack.enter_async_context(
                ConfigWatcher(gateway.config_path, settings, gateway.apply_settings, lambda r: count(r).inc())
            )
        # Ready once the fleet's state is known: _announce_ready sets it.
        announce = asyncio.create_task(_announce_ready(gateway), name="announce-ready")
        lag = asyncio.create_task(watch_loop_lag(gateway.metrics.loop_lag, time.monotonic), name="loop-lag")
        trim = _start_idle_trim(gateway)
        yield
        gateway.ready = False
        announce.cancel()
        lag.cancel()
        if trim is not None:
            trim.cancel()
        gateway.router.close()  # requests still queued get their 503 now, not at their deadline
        await gateway.fleet.drain_all(settings.server.shutdown_grace_s)
        await gateway.accounting.finish_background(settings.server.shutdown_grace_s)
        gateway.access_log.flush()


def _start_idle_trim(gateway: Gateway) -> asyncio.Task[None] | None:
    """Release memory once per idle period (``server.memory_trim_idle_s``; None: never)."""
    idle_after_s = gateway.settings.server.memory_trim_idle_s
    if idle_after_s is None:
        return None
    metrics = gateway.metrics
    malloc_trim = glibc_malloc_trim()
    return asyncio.create_task(
        trim_when_idle(
            IdleTrim(idle_after_s),
            lambda: (metrics.requests_in_flight, metrics.requests_started),
            lambda: release_memory(malloc_trim),
            time.monotonic,
        ),
        name="idle-trim",
    )


async def _announce_ready(gateway: Gateway) -> None:
    """Turn ready once the fleet's state is known (``Fleet.state_known``: the first discovery
    lists, the first probes, a managed replica of each model healthy; vLLM can take minutes to
    load), or after ``health.start_timeout_s`` whatever it is; say so in the log."""
    fleet, timeout_s = gateway.fleet, gateway.settings.health.start_timeout_s
    known = await fleet.wait_known(timeout_s)
    gateway.ready = True
    healthy = fleet.healthy_count()
    if not known:
        log.error(
            "the fleet's state is still not known after health.start_timeout_s; ready anyway, "
            "answering 503 until a replica is healthy",
            extra={"healthy_replicas": healthy, "start_timeout_s": timeout_s},
        )
    elif healthy == 0:
        log.warning("gateway ready with no healthy replica; answering 503 until one is", extra={"healthy_replicas": 0})
    else:
        log.info("gateway ready", extra={"healthy_replicas": healthy})
