"""The endpoints beside the request path: models, stored responses, probes, metrics, and the
answer to a path or method the gateway does not serve (404 / 405, derived from the app's own
routing table).

Every one of them writes one access-log line (``Accounting.record_plain``), as the request
path does for the APIs it serves.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from gateway.accounting import REQUEST_ID_KEY, TENANT_KEY, Accounting
from gateway.auth import KeyRing, credential
from gateway.errors import GatewayError, MethodNotAllowed, NotFound, ServiceUnavailable, error_response
from gateway.exchange import request_id
from gateway.responses_state import ResponseState
from gateway.settings import TenantSettings
from replicas.fleet import Fleet
from routing.adapters import AdapterCatalog

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The catch-all route: every path no other route serves (and its canonical form).
CATCH_ALL = "/{tail:.*}"
_CATCH_ALL_CANONICAL = "/{tail}"


class Endpoints:
    """The handlers that answer outside the request path. ``keyring``, ``tenants`` and
    ``not_ready`` are asked on every request: a reload replaces the keys and tenants, the
    lifecycle sets readiness."""

    def __init__(
        self,
        *,
        keyring: Callable[[], KeyRing],
        tenants: Callable[[], Mapping[str, TenantSettings]],
        fleet: Fleet,
        adapters: AdapterCatalog,
        responses: ResponseState,
        registry: CollectorRegistry,
        not_ready: Callable[[], str | None],
        accounting: Accounting,
    ) -> None:
        self._keyring = keyring
        self._tenants = tenants
        self._fleet = fleet
        self._adapters = adapters
        self._responses = responses
        self._registry = registry
        self._not_ready = not_ready
        self._accounting = accounting

    def logged(self, handler: Handler, endpoint: str) -> Handler:
        """``handler``, with its request's access-log line (``endpoint`` names it there)."""
        accounting = self._accounting

        async def wrapper(request: web.Request) -> web.StreamResponse:
            started = accounting.clock()
            request[REQUEST_ID_KEY] = request_id(request)
            status = 500
            try:
                response = await handler(request)
                status = response.status
                return response
            finally:
                accounting.record_plain(request, endpoint, status, started)

        return wrapper

    def tenant(self, request: web.Request) -> TenantSettings:
        """The tenant of the request's API key (401 otherwise), noted for its log line."""
        key = self._keyring().owner_of(credential(request.headers))
        request[TENANT_KEY] = key.owner
        return self._tenants()[key.owner]

    async def list_models(self, request: web.Request) -> web.Response:
        headers = {"x-request-id": request[REQUEST_ID_KEY]}
        try:
            tenant = self.tenant(request)
        except GatewayError as err:
            return error_response(err, headers)
        # Every tenant may call every fleet model, so every tenant sees every adapter too.
        adapters = self._adapters.listing()
        names = ("auto", *self._fleet.by_model, *self._aliases(tenant), *adapters)
        data = [_model_object(n, adapters.get(n)) for n in names]
        page = {"object": "list", "data": data, "has_more": False, "first_id": names[0], "last_id": names[-1]}
        return web.json_response(page, headers=headers)

    def _aliases(self, tenant: TenantSettings) -> list[str]:
        """The tenant's model aliases whose target it can call."""
        known = self._fleet.by_model
        return [alias for alias, target in tenant.model_aliases.items() if target == "auto" or target in known]

    async def retrieve_model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}``: one model, in OpenAI's shape (404 ``model_not_found``)."""
        headers = {"x-request-id": request[REQUEST_ID_KEY]}
        name = request.match_info["model"]
        try:
            tenant = self.tenant(request)
            parent = self._adapters.base_of(name)
            known = name == "auto" or name in self._fleet.by_model or name in self._aliases(tenant)
            if not known and parent is None:
                raise NotFound(f"The model '{name}' does not exist.", code="model_not_found", param="model")
        except GatewayError as err:
            return error_response(err, headers)
        return web.json_response(_model_object(name, parent), headers=headers)

    def stored_response(self, action: str = "") -> Handler:
        """``GET``/``DELETE /v1/responses/{id}`` (``action`` ""), ``GET .../input_items``,
        ``POST .../cancel``: the tenant's stored responses (``gateway.responses_state``)."""
        state = self._responses

        async def handler(request: web.Request) -> web.Response:
            headers = {"x-request-id": request[REQUEST_ID_KEY]}
            try:
                tenant = self.tenant(request)
                response_id = request.match_info["response_id"]
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

        return handler

    async def healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, _: web.Request) -> web.Response:
        """Ready: this process can serve (started, its fleet's state known, not draining).

        At start it waits until the fleet's state is known (``replicas.readiness``). From
        then on it is not "a replica is healthy": with none, requests get an OpenAI-shaped
        503 (``no_healthy_replica``) and ``fleetgate_model_healthy_replicas`` says 0, which a
        pod outside the Service could not."""
        why = self._not_ready()
        if why is None:
            return web.json_response({"status": "ready", "healthy_replicas": self._fleet.healthy_count()})
        return error_response(ServiceUnavailable(f"Not ready: {why}."), {})

    async def prometheus(self, _: web.Request) -> web.Response:
        # The gateway's own registry (every package's metrics) plus the process-wide one (process stats).
        body = generate_latest(self._registry) + generate_latest(REGISTRY)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    def not_found(self, app: web.Application) -> Handler:
        """The catch-all of ``app``: 405 on a path one of its routes serves with other
        methods, else 404 listing the paths it serves (read from its routing table once)."""
        served: list[tuple[str, re.Pattern[str]]] = []

        async def handler(request: web.Request) -> web.Response:
            if not served:
                served.extend(_served_paths(app))
            path = request.path
            if any(pattern.fullmatch(path) for _, pattern in served):
                err: GatewayError = MethodNotAllowed(f"Method {request.method} is not allowed on {path}.")
            else:
                paths = ", ".join(sorted({canonical for canonical, _ in served}))
                err = NotFound(f"Unknown path {path}. The gateway serves: {paths}.", code="unknown_url")
            return error_response(err, {"x-request-id": request[REQUEST_ID_KEY]})

        return handler


def _served_paths(app: web.Application) -> list[tuple[str, re.Pattern[str]]]:
    """Every path ``app`` routes (the catch-all aside), and a pattern that matches it."""
    paths = []
    for resource in app.router.resources():
        info = resource.get_info()
        if "pattern" in info:  # a path with variables: aiohttp's own pattern for it
            if resource.canonical == _CATCH_ALL_CANONICAL:
                continue
            paths.append((resource.canonical, info["pattern"]))
        elif "path" in info:
            paths.append((resource.canonical, re.compile(re.escape(info["path"]))))
    return paths


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
