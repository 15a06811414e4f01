"""The client's side of a streamed answer: its SSE response opened, kept alive while the
answer is awaited, and ended with an error event when the answer cannot be finished.

The proxy (a live stream) and the cache stage (a replay, a wait on a coalesced flight) both
write to a client's stream; this is the one place that knows how.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp
from aiohttp import web

from gateway.errors import GatewayError
from gateway.exchange import Exchange

KEEPALIVE = b": keep-alive\n\n"

T = TypeVar("T")


async def prepare(ex: Exchange, request: web.Request) -> web.StreamResponse:
    """Open the client's SSE response (status 200, the exchange's headers)."""
    headers = dict(ex.headers)
    headers["Content-Type"] = "text/event-stream"
    headers["Cache-Control"] = "no-cache"
    headers["X-Accel-Buffering"] = "no"
    response = web.StreamResponse(status=200, headers=headers)
    await response.prepare(request)
    ex.status = 200
    ex.response = response
    return response


async def with_keepalive(
    ex: Exchange,
    request: web.Request,
    work: Awaitable[T],
    interval_s: float,
    discard: Callable[[T], None] | None = None,
) -> T:
    """Await ``work``; meanwhile send a streaming client an SSE comment every ``interval_s``.

    If the client leaves (a failed write, a cancellation), ``work`` is cancelled; a result
    it produced all the same goes to ``discard``, which releases what it holds.
    """
    task = asyncio.ensure_future(work)
    returned = False
    try:
        while True:
            done, _ = await asyncio.wait((task,), timeout=interval_s)
            if done:
                returned = True
                return task.result()
            response = ex.response or await prepare(ex, request)
            await response.write(KEEPALIVE)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if not returned and discard is not None and not task.cancelled() and task.exception() is None:
            discard(task.result())


async def end_with_error(ex: Exchange, response: web.StreamResponse, err: GatewayError) -> None:
    """End a stream already under way with ``err`` as its API's error event (the exchange's
    ``error_code`` records it)."""
    ex.error_code = err.code
    with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
        await response.write(ex.dialect.errors.event(err.message, err.code or "upstream_error", err.type))
        await response.write_eof()
