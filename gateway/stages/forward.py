"""The last stages: ``load_adapter`` (a LoRA adapter no replica serves, loaded on one) and
``forward`` (the proxy's answer)."""

from __future__ import annotations

from aiohttp import web

from gateway.exchange import Exchange
from gateway.lora import AdapterLoader
from gateway.proxy import Proxy
from gateway.stages import CONTINUE, Reply


class LoadAdapter:
    """A LoRA adapter that no routable replica serves is loaded on one first, when its
    configuration says where from (``gateway.lora``): one load for all who ask at once."""

    name = "load_adapter"

    def __init__(self, adapters: AdapterLoader) -> None:
        self.adapters = adapters

    async def __call__(self, ex: Exchange, request: web.Request) -> Reply:
        if ex.adapter is None or ex.pool is None:
            return CONTINUE
        return await self.adapters.ensure(ex.adapter, ex.pool)


class Forward:
    """The proxy's answer: attempts, retries, fallback, the stream relayed."""

    name = "forward"

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy

    async def __call__(self, ex: Exchange, request: web.Request) -> Reply:
        route = ex.route
        assert route is not None
        if ex.call.stream:
            return await self.proxy.stream(ex, route, request)
        return await self.proxy.complete(ex, route)
