"""The first stages of every path: ``authenticate`` (API key -> tenant) and ``parse`` (the
body read, bounded in size and time, and validated once by the request's dialect)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from aiohttp import web

from dialects.base import Dialect
from gateway.auth import KeyRing, credential
from gateway.errors import PayloadTooLarge, RequestTimeout
from gateway.exchange import Exchange
from gateway.request import parse_call
from gateway.settings import ServerSettings, TenantSettings
from gateway.stages import CONTINUE, Reply


class Authenticate:
    """The tenant that owns the request's API key (401 ``Unauthorized`` otherwise)."""

    name = "authenticate"

    def __init__(self, keyring: KeyRing, tenants: Mapping[str, TenantSettings], clock: Callable[[], float]) -> None:
        self.keyring = keyring
        self.tenants = tenants
        self.clock = clock

    async def __call__(self, ex: Exchange, request: web.Request) -> Reply:
        key = self.keyring.owner_of(credential(request.headers))
        ex.tenant = self.tenants[key.owner]
        ex.key_id = key.key_id
        if ex.timeline is not None:
            ex.timeline.mark("auth", self.clock())
        return CONTINUE


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """How large a body may be (``server.max_body_bytes``; ``max_audio_bytes`` for an upload)
    and how long it may take to arrive (``server.body_timeout_s``)."""

    max_bytes: int
    max_upload_bytes: int
    timeout_s: float

    @classmethod
    def from_settings(cls, server: ServerSettings) -> BodyLimits:
        return cls(server.max_body_bytes, server.max_audio_bytes, server.body_timeout_s)


class Parse:
    """Read the body (bounded in size and time) and validate it, once."""

    name = "parse"

    def __init__(self, limits: BodyLimits) -> None:
        self.limits = limits

    async def __call__(self, ex: Exchange, request: web.Request) -> Reply:
        dialect = ex.dialect
        raw = await self._read_body(request, dialect)
        ex.call = parse_call(dialect, raw, request.headers.get("Content-Type"))
        if dialect.forward_headers:
            headers = request.headers
            ex.upstream_headers = {name: headers[name] for name in dialect.forward_headers if name in headers}
        return CONTINUE

    async def _read_body(self, request: web.Request, dialect: Dialect) -> bytes:
        limits = self.limits
        limit = limits.max_upload_bytes if dialect.multipart else limits.max_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _too_large(limit)
        try:
            if request.content.is_eof():  # all of it arrived with the headers: nothing to wait for
                raw = await request.read()
            else:
                async with asyncio.timeout(limits.timeout_s):
                    raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise _too_large(limit) from exc
        except TimeoutError as exc:
            raise RequestTimeout("The request body did not arrive in time.") from exc
        if len(raw) > limit:  # a chunked body, read within the application's larger bound
            raise _too_large(limit)
        return raw


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The request body is larger than the {limit}-byte limit.")
