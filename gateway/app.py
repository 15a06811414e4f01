"""The gateway application: components, routes, and the path of one request.

``Gateway.handle`` is the whole request path in order: authenticate -> read and parse ->
admit -> cache -> classify -> route -> proxy -> settle, with one place that turns
``GatewayError`` into an OpenAI error response and one access-log line at the end.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from aiohttp import web
from prometheus_client import REGISTRY, generate_latest

from gateway.admin import AdminApi
from gateway.auth import KeyRing
from gateway.errors import (
    GatewayError,
    InternalError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    ServiceUnavailable,
    error_response,
)
from gateway.logs import AccessLog
from gateway.metrics import FleetCollector, GatewayMetrics
from gateway.proxy import Exchange, Picker, Proxy
from gateway.request import Endpoint, parse_call
from gateway.settings import DEV_API_KEY, Settings, TenantSettings
from replicas.fleet import Fleet
from replicas.replica import Replica
from routing.least_outstanding import pick_least_outstanding

log = logging.getLogger("fleetgate.app")

GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway")
# nginx's "client closed request": the client left before the response ended.
CLIENT_CLOSED = 499
_MAX_REQUEST_ID = 128


class Gateway:
    """Everything one gateway process holds, built from the settings once."""

    def __init__(
        self,
        settings: Settings,
        *,
        log_dir: Path = Path("logs"),
        access_stream: IO[bytes] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.metrics = GatewayMetrics()
        self.access_log = AccessLog(access_stream, enabled=settings.server.access_log)
        self.fleet = Fleet(settings.models, settings.health, restart=settings.restart, log_dir=log_dir, clock=clock)
        self.metrics.registry.register(FleetCollector(self.fleet.all, clock))
        self.proxy = Proxy(settings.upstream, self.metrics, clock)
        self.rng = random.Random()
        self.ready = False
        self.apply_tenants(settings.effective_tenants(), settings.admin_api_keys)
        self.default_model = settings.default_model or settings.models[0].name

    def apply_tenants(self, tenants: list[TenantSettings], admin_keys: list[str]) -> None:
        """Swap in a new set of tenants and keys (start-up and hot reload)."""
        entries = [(t.id, t.api_keys) for t in tenants]
        keyring, missing = KeyRing.build(entries)
        admin, missing_admin = KeyRing.build([("admin", admin_keys)])
        for var in missing + missing_admin:
            log.warning("API key variable is not set; that key is disabled", extra={"variable": var})
        self.tenants = {t.id: t for t in tenants}
        self.keyring = keyring
        self.admin_keyring = admin

    # -- the request path ---------------------------------------------------------------

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        started = self.clock()
        request_id = _request_id(request)
        headers = {"x-request-id": request_id}
        tenant_id: str | None = None
        model: str | None = None
        ex: Exchange | None = None
        status = 500
        error_code: str | None = None
        self.metrics.in_flight.inc()
        try:
            # 1 authenticate
            tenant_id = self.keyring.owner_of(request.headers.get("Authorization"))
            # 2 read + parse
            call = parse_call(endpoint, await self._read_body(request))
            # 3 admit (limits) and 4 cache lookup hook in here.
            # 5 classify: "auto" -> a model of the right tier
            model = self._resolve_model(call.model)
            headers["x-fleetgate-tier"] = self.fleet.tiers[model]
            headers["x-fleetgate-cache"] = "miss"
            # 6 route + 7 proxy
            ex = Exchange(call, request_id, headers, started)
            pick = self._picker(model)
            if call.stream:
                response = await self.proxy.stream(ex, pick, request)
            else:
                response = await self.proxy.complete(ex, pick)
            status = ex.status or response.status
            error_code = ex.error_code
            return response
        except GatewayError as err:
            status, error_code = err.status, err.code
            return error_response(err, headers)
        except asyncio.CancelledError:
            status, error_code = CLIENT_CLOSED, "client_closed"
            if model is not None:
                self.metrics.client_disconnects.labels(model).inc()
            raise
        except Exception:
            log.exception("unexpected error", extra={"request_id": request_id})
            internal = InternalError("The gateway hit an unexpected error; it has been logged.")
            status, error_code = internal.status, internal.code
            return error_response(internal, headers)
        finally:
            # 8 settle: limits, metrics, one log line
            self.metrics.in_flight.dec()
            self._record(endpoint, request_id, tenant_id, model, ex, status, error_code, started)

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.settings.server.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise PayloadTooLarge(f"The request body is larger than the {limit}-byte limit.")
        try:
            async with asyncio.timeout(self.settings.server.body_timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise PayloadTooLarge(f"The request body is larger than the {limit}-byte limit.") from exc
        except TimeoutError as exc:
            raise RequestTimeout("The request body did not arrive in time.") from exc

    def _resolve_model(self, name: str) -> str:
        if name == "auto":
            return self.default_model
        if name not in self.fleet.by_model:
            raise NotFound(
                f"The model '{name}' does not exist or you do not have access to it.",
                code="model_not_found",
                param="model",
            )
        return name

    def _picker(self, model: str) -> Picker:
        replicas = self.fleet.by_model[model]
        clock, rng = self.clock, self.rng

        def pick(exclude: set[str]) -> Replica | None:
            return pick_least_outstanding(replicas, clock(), rng, exclude)

        return pick

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
    ) -> None:
        now = self.clock()
        elapsed = now - started
        model_label = model or "-"
        m = self.metrics
        m.requests.labels(endpoint.label, model_label, str(status)).inc()
        m.latency.labels(endpoint.label, model_label).observe(elapsed)
        entry: dict[str, Any] = {
            "request_id": request_id,
            "tenant": tenant_id,
            "endpoint": endpoint.label,
            "model": model,
            "status": status,
            "duration_ms": round(elapsed * 1000, 2),
        }
        if error_code:
            entry["error"] = error_code
        if ex is not None:
            entry["stream"] = ex.call.stream
            entry["attempts"] = ex.attempts
            if ex.replica is not None:
                entry["replica"] = ex.replica.id
            if ex.first_token_at is not None:
                ttft = ex.first_token_at - started
                entry["ttft_ms"] = round(ttft * 1000, 2)
                m.ttft.labels(model_label).observe(ttft)
            if ex.usage:
                prompt = int(ex.usage.get("prompt_tokens") or 0)
                completion = int(ex.usage.get("completion_tokens") or 0)
                entry["prompt_tokens"], entry["completion_tokens"] = prompt, completion
                if tenant_id is not None:
                    m.tokens.labels(tenant_id, model_label, "prompt").inc(prompt)
                    m.tokens.labels(tenant_id, model_label, "completion").inc(completion)
            if ex.upstream_started is not None:
                upstream = (ex.upstream_ended or now) - ex.upstream_started
                m.overhead.labels(endpoint.label).observe(max(0.0, elapsed - upstream))
            if self.settings.server.log_prompts:
                entry["body"] = ex.call.body
        self.access_log.write(entry)

    # -- other endpoints --------------------------------------------------------------------

    async def list_models(self, request: web.Request) -> web.Response:
        headers = {"x-request-id": _request_id(request)}
        try:
            self.keyring.owner_of(request.headers.get("Authorization"))
        except GatewayError as err:
            return error_response(err, headers)
        names = ["auto", *self.fleet.by_model]
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "fleetgate"} for n in names]
        return web.json_response({"object": "list", "data": data}, headers=headers)

    async def healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, _: web.Request) -> web.Response:
        healthy = self.fleet.healthy_count()
        if self.ready and healthy:
            return web.json_response({"status": "ready", "healthy_replicas": healthy})
        err = ServiceUnavailable("Not ready: no healthy replica." if self.ready else "Not ready: starting or stopping.")
        return error_response(err, {})

    async def prometheus(self, _: web.Request) -> web.Response:
        # The gateway's own registry plus the process-wide one (limits, caches, process stats).
        body = generate_latest(self.metrics.registry) + generate_latest(REGISTRY)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def not_found(self, request: web.Request) -> web.Response:
        known = {e.value for e in Endpoint} | {"/v1/models", "/healthz", "/readyz", "/metrics", "/admin/fleet"}
        if request.path in known:
            err: GatewayError = MethodNotAllowed(f"Method {request.method} is not allowed on {request.path}.")
        else:
            err = NotFound(f"Unknown path {request.path}.", code="unknown_url")
        return error_response(err, {"x-request-id": _request_id(request)})


def _request_id(request: web.Request) -> str:
    sent = request.headers.get("x-request-id")
    if sent and len(sent) <= _MAX_REQUEST_ID and sent.isprintable():
        return sent
    return os.urandom(12).hex()


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
    app.router.add_get("/healthz", gateway.healthz)
    app.router.add_get("/readyz", gateway.readyz)
    app.router.add_get("/metrics", gateway.prometheus)
    AdminApi(gateway).add_routes(app)
    app.router.add_route("*", "/{tail:.*}", gateway.not_found)
    app.cleanup_ctx.append(_lifecycle)
    return app


async def _lifecycle(app: web.Application) -> Any:
    gateway = app[GATEWAY_KEY]
    settings = gateway.settings
    if settings.uses_dev_tenant:
        log.warning(
            "no tenants configured: using the development tenant; do not expose this gateway",
            extra={"api_key": DEV_API_KEY},
        )
    async with gateway.proxy, gateway.fleet:
        gateway.ready = True
        announce = asyncio.create_task(_announce_ready(gateway), name="announce-ready")
        yield
        gateway.ready = False
        announce.cancel()
        await gateway.fleet.drain_all(settings.server.shutdown_grace_s)


async def _announce_ready(gateway: Gateway) -> None:
    """Log when the first replica becomes routable (vLLM can take minutes to load)."""
    if await gateway.fleet.wait_healthy(gateway.settings.health.start_timeout_s):
        log.info("gateway ready", extra={"healthy_replicas": gateway.fleet.healthy_count()})
    else:
        log.error("no replica became healthy in time; answering 503 until one does")
