"""The HTTP server around the application: what happens before a request reaches a handler.

aiohttp parses each connection's bytes; two things it does not do the gateway's way:

- **Malformed HTTP** (a header line over 8,190 bytes, too many headers, a bad chunk size,
  Content-Length with chunked...) is answered in plain text, logged at error level with a
  traceback, and the logged message quotes up to 100 bytes of the offending line: an
  ``Authorization`` header's API key included. Here it is answered in OpenAI's error shape,
  and logged at info level by the error's class only, never its text.
- aiohttp's own refusals (a request target no route matches, such as ``OPTIONS *``) are
  plain text too; here they are in OpenAI's shape.
- **No header-read timeout**: a client sending its headers a byte at a time holds a
  connection (and a descriptor) as long as it likes. Here a request's line and headers must
  arrive within ``server.header_timeout_s`` of its first byte (of connecting, for a
  connection's first request), else the client gets a 408 and the connection is closed.
  The body has its own timeout (``server.body_timeout_s``, in the handler); an idle
  keep-alive connection is aiohttp's ``keepalive_timeout`` business.

``GatewayRunner`` is ``web.AppRunner`` with this connection handler.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from gateway.errors import (
    BadRequest,
    GatewayError,
    HeadersTooLarge,
    InternalError,
    MethodNotAllowed,
    NotFound,
    RequestTimeout,
    error_response,
)

log = logging.getLogger("fleetgate.server")

_HEADER_TIMEOUT = RequestTimeout("The request's headers did not arrive in time.", code="header_timeout")
_HEADER_TIMEOUT_REPLY = (
    b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_HEADER_TIMEOUT.to_json()), _HEADER_TIMEOUT.to_json())
)


def malformed_http_error(exc: BaseException | None) -> GatewayError:
    """The client's error for a request aiohttp could not parse (never quoting its bytes)."""
    if isinstance(exc, http_exceptions.LineTooLong):
        return HeadersTooLarge("The request line or a header is longer than the server accepts.")
    if isinstance(exc, http_exceptions.BadHttpMessage) and "Too many headers" in str(exc):
        return HeadersTooLarge("The request has more headers than the server accepts.")
    kind = type(exc).__name__ if exc is not None else "BadHttpMessage"
    return BadRequest(f"The request is not valid HTTP/1.1 ({kind}).", code="invalid_http")


def http_exception_error(exc: web.HTTPException) -> GatewayError:
    """aiohttp's refusal ``exc`` as the client's error, same status."""
    err: GatewayError
    if exc.status == 404:
        err = NotFound("Unknown path.", code="unknown_url")
    elif exc.status == 405:
        err = MethodNotAllowed("Method not allowed on this path.")
    else:
        err = BadRequest(f"The request was refused ({exc.status} {exc.reason}).", code="invalid_request")
        err.status = exc.status
    return err


class GatewayRequestHandler(RequestHandler):
    """aiohttp's connection handler, with OpenAI-shaped parse errors and a header timeout."""

    def __init__(self, manager: Server, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        # The first byte of a request starts its clock; a completely parsed head stops it.
        if self._header_timer is None and not self._busy():
            self._arm_header_timer()
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:
            self._disarm_header_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        # Bytes of this request's body may have armed the clock; the next request's first
        # byte arms it afresh.
        self._disarm_header_timer()
        if isinstance(resp, web.HTTPException) and resp.status >= 400:
            # aiohttp's own refusals (a request target no route can match, such as
            # "OPTIONS *") are plain text: answer them in OpenAI's shape too.
            resp = error_response(http_exception_error(resp), {})
        return await super().finish_response(request, resp, start_time)

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if status >= 500:
            # An unexpected error in a handler: a bug, logged with its traceback.
            self.log_exception("unexpected error in a request handler", exc_info=exc)
            err: GatewayError = InternalError("The gateway hit an unexpected error; it has been logged.")
        else:
            # The exception's text quotes the request's bytes (an API key, say): never logged.
            log.info("malformed HTTP request refused", extra={"status": status, "error": type(exc).__name__})
            err = malformed_http_error(exc)
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already under way; the connection is closed")
        response = error_response(err, {})
        response.force_close()
        return response

    def _busy(self) -> bool:
        """Whether a request is being handled or waits for its handler (its body may still
        be arriving: not the header timeout's business)."""
        return bool(self._request_in_progress or self._messages)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self._loop.call_later(self.header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        transport = self.transport
        if self._busy() or transport is None or transport.is_closing():
            return
        log.info("request headers too slow; connection closed", extra={"timeout_s": self.header_timeout_s})
        transport.write(_HEADER_TIMEOUT_REPLY)
        self.force_close()  # closes the transport once the reply is written


class GatewayServer(Server):
    """aiohttp's low-level server, making ``GatewayRequestHandler``s."""

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s

    def __call__(self) -> RequestHandler:
        return GatewayRequestHandler(self, loop=self._loop, header_timeout_s=self.header_timeout_s, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """``web.AppRunner`` whose connections get ``GatewayRequestHandler``."""

    def __init__(self, app: web.Application, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s

    async def _make_server(self) -> Server:
        plain = await super()._make_server()
        return GatewayServer(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=plain._loop,
            header_timeout_s=self._header_timeout_s,
            **plain._kwargs,
        )
