"""The gateway application: its components, its routes, and the runner of the request path.

``Gateway`` holds every part, built once from the settings by ``gateway.build``.
``Gateway.handle`` runs one request through its API's path of stages (``gateway.stages``)
until one replies, answers a ``GatewayError`` in the API's error shape in one place, and
hands the finished request to ``gateway.accounting`` (metrics, one access-log line). The
endpoints beside the request path are ``gateway.endpoints``'.
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

from batch.loopback import KEY_ID as BATCH_KEY_ID
from batch.loopback import InternalKeys, LoopbackSender
from batch.runner import Runner
from common.idle_trim import IdleTrim, glibc_malloc_trim, release_memory, trim_when_idle
from dialects.base import Dialect
from dialects.registry import DIALECTS
from gateway import build
from gateway.accounting import REQUEST_ID_KEY, Accounting
from gateway.admin import AdminApi
from gateway.auth import KeyRing
from gateway.autoscale import AutoscaleCollector, PendingTokens
from gateway.batch_api import BatchApi
from gateway.endpoints import CATCH_ALL, Endpoints, Handler
from gateway.errors import ExpectationFailed, GatewayError, InternalError, error_response
from gateway.exchange import CLIENT_CLOSED, REQUEST_ID_HEADER, Exchange, request_id
from gateway.logs import AccessLog
from gateway.metrics import FleetCollector, GatewayMetrics, KvEventsCollector, QuotaCollector, watch_loop_lag
from gateway.reload import ConfigWatcher
from gateway.settings import DEV_API_KEY, ConfigError, Settings, TenantSettings
from gateway.spans import RequestSpans, Timeline
from gateway.stages import CONTINUE, Reply, Stage
from gateway.tracing import start_trace
from routing.metrics import QueueCollector, RoutingMetrics

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
        self.metrics = metrics = GatewayMetrics()
        self.access_log = AccessLog(access_stream, enabled=settings.server.access_log)
        self.proxy = build.proxy(settings, metrics, clock)
        # Counted first: a model's tokenizer decides whether its managed replicas publish KV events.
        self.counter = build.prompt_counter(settings, os.environ)
        self.fleet = build.fleet(settings, self.proxy, log_dir, clock, self.counter)
        security = build.redis_security(settings)
        self.cache = build.response_cache(settings, metrics, security)
        self.responses = build.response_state(settings, metrics, security, clock)
        self.limiter = build.limiter(settings, metrics, security)
        # Routing's randomness, and trace and span ids (gateway.tracing) on a stream of their own.
        self.rng, self.trace_rng = random.Random(), random.Random()
        # OpenTelemetry spans: None (off, the default) unless an OTLP endpoint is configured.
        self.spans = RequestSpans.from_environment(os.environ, stage_spans=settings.tracing.stage_spans)
        self.accounting = Accounting(
            metrics, self.access_log, self.spans, clock, log_prompts=settings.server.log_prompts
        )
        self.ready = False
        # Set on SIGTERM: /readyz answers 503 and every response closes its connection, so
        # clients move to other pods before the listener closes (gateway.cli.serve).
        self.draining = False
        self.routing_metrics = RoutingMetrics(metrics.registry, settings.routing.policy)
        self.router = build.router(settings, self.fleet, self.routing_metrics, self.rng, clock)
        self.adapters = build.adapters(settings, self.fleet, self.proxy, clock)
        self.kv_events = build.kv_events(settings, self.fleet, self.router, self.counter)
        self.pending = PendingTokens(m.name for m in settings.models)
        registry = metrics.registry
        registry.register(FleetCollector(self.fleet.all, clock, lambda: self.fleet.by_model))
        registry.register(QuotaCollector(lambda: self.tenants))
        registry.register(QueueCollector(self.router.band_depths))
        registry.register(KvEventsCollector(self.kv_events.describe))
        registry.register(AutoscaleCollector(self.pending, settings.autoscaling.target))
        self.parts = build.PathParts(
            settings,
            fleet=self.fleet,
            router=self.router,
            limiter=self.limiter,
            cache=self.cache,
            proxy=self.proxy,
            pending=self.pending,
            routing_metrics=self.routing_metrics,
            responses=self.responses,
            adapters=self.adapters,
            counter=self.counter,
            clock=clock,
        )
        self.endpoints = Endpoints(
            keyring=lambda: self.keyring,
            tenants=lambda: self.tenants,
            fleet=self.fleet,
            adapters=self.adapters.catalog,
            responses=self.responses,
            registry=registry,
            not_ready=self._not_ready,
            accounting=self.accounting,
        )
        self.batch: BatchApi | None = None
        self.batch_keys: InternalKeys | None = None
        if settings.batch.enabled:
            self._build_batch(settings)
        self.apply_tenants(settings.tenants, settings.admin_api_keys)

    def _build_batch(self, settings: Settings) -> None:
        """The Batch API: its store, files, runner (sending items to this process's listener
        with an internal key per tenant) and handlers."""
        store, files, metrics, keys = build.batch_parts(settings, self.metrics.registry, build.redis_security(settings))
        batch = settings.batch
        sender = LoopbackSender(build.loopback_url(settings), keys, batch.band, batch.concurrency, batch.item_timeout_s)
        self.batch_sender = sender
        self.batch_store = store
        runner = Runner(batch, store, files, sender, metrics, accepting=lambda: not self.draining)
        self.batch_runner = runner
        self.batch_keys = keys
        self.batch = BatchApi(batch, store, files, runner, metrics, lambda request: self.endpoints.tenant(request).id)

    def apply_settings(self, new: Settings) -> None:
        """A reloaded configuration: the parts that apply live (tenants, keys)."""
        self.apply_tenants(new.tenants, new.admin_api_keys)

    def apply_tenants(self, tenants: list[TenantSettings], admin_keys: list[str]) -> None:
        """Swap in a new set of tenants and keys (start-up and hot reload)."""
        entries = [(t.id, [k if isinstance(k, str) else (k.id, k.key) for k in t.api_keys]) for t in tenants]
        if self.batch_keys is not None:  # each tenant's internal key: its batch items' credential
            keys = self.batch_keys
            entries += [(t.id, [(BATCH_KEY_ID, keys.digest_ref(t.id))]) for t in tenants]
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
        self.paths: dict[Dialect, tuple[Stage, ...]] = self.parts.paths(keyring, self.tenants)

    def _not_ready(self) -> str | None:
        """Why this process cannot serve yet (None: it can)."""
        if self.ready and not self.draining:
            return None
        return "draining" if self.draining else "starting, the fleet's state is not known yet"

    # -- the request path ---------------------------------------------------------------

    async def handle(self, request: web.Request, dialect: Dialect) -> web.StreamResponse:
        """Run the request through its API's path (``self.paths``) until a stage replies, then account."""
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
        self.accounting.open()
        try:
            with ex:  # what each stage took, handed back in reverse order however the path ends
                reply: Reply = CONTINUE
                for stage in self.paths[dialect]:
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
            self.accounting.close(ex)

    def _client_left(self, ex: Exchange) -> None:
        if ex.model is not None:
            self.metrics.client_disconnects.labels(ex.model).inc()
        if ex.response is not None and ex.cut is None:
            ex.cut = "client_gone"  # a stream under way (its status already sent)
        ex.status, ex.error_code = CLIENT_CLOSED, "client_closed"


def _refuse(ex: Exchange, err: GatewayError) -> web.Response:
    """The request's answer is ``err``, in its API's error shape."""
    ex.status, ex.error_code = err.status, err.code
    return error_response(err, ex.headers, ex.dialect.errors)


def create_app(gateway: Gateway) -> web.Application:
    """The aiohttp application; the gateway's parts start and stop with it, in order."""
    server = gateway.settings.server
    app = web.Application(client_max_size=max(server.max_body_bytes, server.max_audio_bytes))
    app[GATEWAY_KEY] = gateway
    endpoints = gateway.endpoints
    logged = endpoints.logged

    def route(dialect: Dialect) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await gateway.handle(request, dialect)

        return handler

    for dialect in DIALECTS:
        app.router.add_post(dialect.path, route(dialect))
    app.router.add_route("*", "/v1/responses/{response_id}", logged(endpoints.stored_response(), "responses_stored"))
    for action in ("input_items", "cancel"):
        stored = logged(endpoints.stored_response(action), "responses_stored")
        app.router.add_route("*", f"/v1/responses/{{response_id}}/{action}", stored)
    app.router.add_get("/v1/models", logged(endpoints.list_models, "models"))
    if gateway.batch is not None:
        gateway.batch.add_routes(app, logged)
    app.router.add_get("/v1/models/{model:.+}", logged(endpoints.retrieve_model, "models"))
    _add_probes(app, gateway)
    if server.admin_port is None:
        _add_monitoring_routes(app, gateway)
    app.router.add_route("*", CATCH_ALL, logged(endpoints.not_found(app), "not_found"))
    app.on_response_prepare.append(_close_while_draining)
    _answer_expect_in_openai_shape(app, gateway.accounting)
    app.cleanup_ctx.append(_lifecycle)
    return app


def create_admin_app(gateway: Gateway) -> web.Application:
    """The admin/metrics listener's application (``server.admin_port``): /metrics, /admin/*
    and the probes, apart from the API, so a NetworkPolicy can keep it to the monitoring
    namespace. It shares the API application's gateway and lifecycle (serve it alongside)."""
    app = web.Application()
    _add_probes(app, gateway)
    _add_monitoring_routes(app, gateway)
    endpoints = gateway.endpoints
    app.router.add_route("*", CATCH_ALL, endpoints.logged(endpoints.not_found(app), "not_found"))
    _answer_expect_in_openai_shape(app, gateway.accounting)
    return app


def _add_probes(app: web.Application, gateway: Gateway) -> None:
    endpoints = gateway.endpoints
    app.router.add_get("/healthz", endpoints.logged(endpoints.healthz, "healthz"))
    app.router.add_get("/readyz", endpoints.logged(endpoints.readyz, "readyz"))


def _add_monitoring_routes(app: web.Application, gateway: Gateway) -> None:
    endpoints = gateway.endpoints
    models = [m.name for m in gateway.settings.models]
    admin = AdminApi(
        gateway.fleet,
        lambda: gateway.admin_keyring,
        gateway.proxy.migrate,
        lambda: gateway.counter.describe(models),
        gateway.kv_events.describe,
    )
    metrics: Handler = endpoints.prometheus
    if gateway.settings.server.metrics_require_key:
        metrics = admin.guarded(endpoints.prometheus)
    app.router.add_get("/metrics", endpoints.logged(metrics, "metrics"))
    admin.add_routes(app, endpoints.logged)


async def _close_while_draining(request: web.Request, response: web.StreamResponse) -> None:
    """While draining, each response ends its keep-alive connection: the client's next request
    opens a new connection, which the Service sends to a pod that is staying."""
    if request.app[GATEWAY_KEY].draining:
        response.force_close()
        response.headers["Connection"] = "close"  # the header is computed before this hook runs


def _answer_expect_in_openai_shape(app: web.Application, accounting: Accounting) -> None:
    """Every route of ``app`` answers an ``Expect`` header with ``_expect``."""

    async def expect(request: web.Request) -> web.StreamResponse | None:
        started = accounting.clock()
        refused = await _expect(request)
        if refused is not None:  # the route's handler never runs: the refusal's line is here
            accounting.record_plain(request, "expect", refused.status, started)
        return refused

    for each in app.router.routes():
        each._expect_handler = expect


async def _expect(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue`` as aiohttp answers it; any other expectation is a 417 in
    OpenAI's shape (aiohttp's own is plain text, and a 500 for a header that is not UTF-8)."""
    if request.headers.get("Expect", "").lower() != "100-continue":
        err = ExpectationFailed("Only 'Expect: 100-continue' is supported.")
        rid = request[REQUEST_ID_KEY] = request_id(request)
        return error_response(err, {"x-request-id": rid})
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
        for part in (
            gateway.limiter,
            gateway.cache,
            gateway.responses,
            gateway.proxy,
            gateway.fleet,
            gateway.kv_events,
        ):
            await stack.enter_async_context(part)
        if gateway.spans is not None:
            await stack.enter_async_context(gateway.spans)
        if gateway.batch is not None:  # last in, first out: the runner stops before the rest
            await stack.enter_async_context(gateway.batch_store)
            await stack.enter_async_context(gateway.batch_sender)
            await stack.enter_async_context(gateway.batch_runner)
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
        await gateway.parts.admit.finish_background(settings.server.shutdown_grace_s)
        gateway.counter.close()
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
