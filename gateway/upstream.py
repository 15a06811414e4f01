"""A lean HTTP/1.1 client for the gateway's calls to its replicas.

Every request through the gateway makes one upstream call, so that call's cost is paid on
every request: aiohttp's client spends about as long preparing, sending and reading one
small exchange as the whole rest of the gateway does. The replicas are few, known and
speak plain HTTP/1.1 (vLLM behind uvicorn, or the simulator), so this client does only
what they need: POST (and GET) with a body of bytes, keep-alive connections pooled per
origin, responses parsed by ``httptools`` (llhttp, in C) and bodies read whole or as
chunks arrive.

- A connection taken from the pool that turns out dead before any byte of the response
  arrived (the replica closed it while idle) is replaced and the request sent once more, on
  a new connection (the rest of the pool may have gone stale at the same time); any other
  failure is the caller's to retry (the proxy's retry rule decides).
- ``fetch`` bounds the whole exchange with one timer; ``open`` returns at the headers and
  leaves the stream's timing to the caller (first byte, gaps between chunks).
- A stream's reader pauses the socket when unread data piles up (``_HIGH_WATER``), so a
  slow client slows the replica's connection instead of filling memory.
- Errors are ``UpstreamError`` (connection refused, reset, closed early, bad HTTP; its
  ``ResponseTooLarge``: a body read whole past the caller's bound; its ``ReplicaDown``: an
  exchange still waiting for its answer when the replica was declared down) or
  ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from typing import Any, NamedTuple, cast
from urllib.parse import urlsplit

import httptools

# Unread stream data past which the socket stops reading until the reader drains it.
_HIGH_WATER = 256 * 1024
# Passes of the event loop (each polls I/O once) a timed-out wait gives its task before the
# timeout counts: I/O read late because the loop was held up is not the replica's delay.
_POLLS_BEFORE_TIMEOUT = 4


class UpstreamError(Exception):
    """The replica could not be reached or broke the exchange."""


class ResponseTooLarge(UpstreamError):
    """A body to be read whole grew past the caller's bound (``fetch(max_bytes=...)``)."""


class ReplicaDown(UpstreamError):
    """The exchange was abandoned because health checks took its replica out of rotation
    (``UpstreamClient.abandon_waiting``): nothing of the answer had arrived, so another
    replica can be asked at once instead of waiting out the timeout."""


class ConnectTimeout(TimeoutError):
    """No connection to the replica within ``connect_timeout_s``: a host that is gone or
    unreachable, where a plain ``TimeoutError`` is a replica that took too long to answer."""


@dataclass(frozen=True, slots=True)
class _Origin:
    host: str
    port: int
    tls: bool
    host_header: bytes


class _Connection(asyncio.Protocol):
    """One keep-alive connection; serves one exchange at a time."""

    def __init__(self, pool: UpstreamClient, origin: _Origin) -> None:
        self._pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        self.response: UpstreamResponse | None = None
        self.received_any = False
        self._content_type = b""
        self._retry_after = b""
        self._sized = False

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes on an idle connection: it cannot be trusted with the next exchange
            self.close()
            return
        self.received_any = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"invalid HTTP from the replica: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        response = self.response
        if response is not None and not response.complete:
            if response.status and not self._sized:
                response.finish()  # a body delimited by the end of the connection
            else:
                self._fail(UpstreamError("the replica closed the connection" + (f": {exc}" if exc else "")))

    def pause_writing(self) -> None:  # request bodies are small; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks ---------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-type":
            self._content_type = value
        elif lower in (b"content-length", b"transfer-encoding"):
            self._sized = True
        elif lower == b"retry-after":
            self._retry_after = value

    def on_headers_complete(self) -> None:
        response = self.response
        if response is not None:
            response.status = self._parser.get_status_code()
            response.content_type = self._content_type.split(b";", 1)[0].strip().decode("latin-1")
            response.retry_after = self._retry_after.strip().decode("latin-1")
            if not response.headers_ready.done():
                response.headers_ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response.feed(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response is None:
            return
        response.keep_alive = self._parser.should_keep_alive()
        response.finish()

    # -- the client's side ---------------------------------------------------------------

    def send(self, response: UpstreamResponse, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self._reset()
        self.response = response
        response.connection = self
        self.transport.write(head + body if len(body) < 16384 else head)
        if len(body) >= 16384:
            self.transport.write(body)

    def _fail(self, exc: Exception) -> None:
        if self.response is not None:
            self.response.fail(exc)

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._pool.forget(self)
            if self.transport is not None:
                self.transport.close()


class Fetched(NamedTuple):
    """A whole answer (``UpstreamClient.fetch``)."""

    status: int
    content_type: str
    body: bytes
    # The Retry-After header ("" when absent).
    retry_after: str = ""


class UpstreamResponse:
    """A replica's answer: status and content type at once, the body whole or in chunks."""

    __slots__ = (
        "_chunks",
        "_error",
        "_paused",
        "_size",
        "_waiter",
        "body_seen",
        "complete",
        "connection",
        "content_type",
        "headers_ready",
        "keep_alive",
        "retry_after",
        "status",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.status = 0
        self.content_type = ""
        # The replica's Retry-After header ("" when absent), passed on with a 429.
        self.retry_after = ""
        self.headers_ready: asyncio.Future[None] = loop.create_future()
        self.connection: _Connection | None = None
        self.complete = False
        self.keep_alive = False
        # Whether any of the body arrived (a stream's first chunk, a whole answer's bytes).
        self.body_seen = False
        # A list, not a deque: the reader takes every chunk at once, and an empty deque
        # already holds a 64-slot block (528 bytes) for each open stream.
        self._chunks: list[bytes] = []
        self._size = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: Exception | None = None
        self._paused = False

    # -- fed by the connection ----------------------------------------------------------------

    def feed(self, chunk: bytes) -> None:
        self.body_seen = True
        self._chunks.append(chunk)
        self._size += len(chunk)
        if self._size > _HIGH_WATER and not self._paused and self.connection is not None:
            self._paused = True
            self.connection.pause()
        self._wake()

    def finish(self) -> None:
        self.complete = True
        if not self.headers_ready.done():
            self.headers_ready.set_exception(UpstreamError("the replica sent no response headers"))
        self._wake()

    def fail(self, exc: Exception) -> None:
        if self.complete:
            return
        self._error = exc
        if not self.headers_ready.done():
            self.headers_ready.set_exception(exc)
            self.headers_ready.exception()  # retrieved: a caller that left must not log it
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- read by the proxy ------------------------------------------------------------------

    async def readany(self) -> bytes:
        """The data received so far (at least one byte), or b"" once the body has ended."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        if self._paused and self.connection is not None:
            self._paused = False
            self.connection.resume()
        return data

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body; ``ResponseTooLarge`` as soon as more than ``max_bytes`` arrived."""
        while not self.complete:
            if self._error is not None:
                raise self._error
            if max_bytes is not None and self._size > max_bytes:
                raise ResponseTooLarge(f"the answer is larger than {max_bytes} bytes")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
            if self._paused and self.connection is not None:
                self._paused = False
                self.connection.resume()
        if self._error is not None:
            raise self._error
        if max_bytes is not None and self._size > max_bytes:
            raise ResponseTooLarge(f"the answer is larger than {max_bytes} bytes")
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data

    def release(self) -> None:
        """Done with this response: its connection goes back to the pool, or is closed."""
        connection, self.connection = self.connection, None
        if connection is None:
            return
        connection.response = None
        if self.complete and self.keep_alive and self._error is None and not connection.closed:
            connection._pool.put_back(connection)
        else:
            connection.close()

    def close(self) -> None:
        """Abandon the exchange (the connection cannot be reused mid-body)."""
        connection, self.connection = self.connection, None
        if connection is not None:
            connection.response = None
            connection.close()


class UpstreamClient:
    """Pooled keep-alive connections to the replicas, one pool per origin."""

    def __init__(self, *, connect_timeout_s: float, max_idle_per_origin: int = 1024) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle_per_origin
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._active: set[_Connection] = set()
        self._origins: dict[str, tuple[_Origin, bytes]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    def _target(self, url: str) -> tuple[_Origin, bytes]:
        """The origin and request target of ``url``, parsed once per distinct URL."""
        known = self._origins.get(url)
        if known is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise UpstreamError(f"not an http(s) URL: {url}")
            tls = parts.scheme == "https"
            port = parts.port or (443 if tls else 80)
            default = (tls and port == 443) or (not tls and port == 80)
            host = parts.hostname if default else f"{parts.hostname}:{port}"
            if ":" in parts.hostname and not default:  # IPv6 literal
                host = f"[{parts.hostname}]:{port}"
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            known = (_Origin(parts.hostname, port, tls, host.encode("idna")), target.encode("latin-1"))
            if len(self._origins) < 4096:
                self._origins[url] = known
        return known

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        context: ssl.SSLContext | None = None
        if origin.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        connecting = asyncio.ensure_future(
            loop.create_connection(lambda: _Connection(self, origin), origin.host, origin.port, ssl=context)
        )
        try:
            await _within(connecting, self.connect_timeout_s)
        except TimeoutError:
            _abandon(connecting)
            raise ConnectTimeout(
                f"no connection to {origin.host}:{origin.port} within {self.connect_timeout_s} s"
            ) from None
        except BaseException:
            _abandon(connecting)
            raise
        try:
            transport, protocol = connecting.result()
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        # uvloop may return before it has called connection_made.
        if protocol.transport is None:
            protocol.transport = transport
        return protocol

    def _idle_connection(self, origin: _Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if not connection.closed:
                return connection
        return None

    def put_back(self, connection: _Connection) -> None:
        self._active.discard(connection)
        if self._closed:
            connection.close()
            return
        idle = self._idle.setdefault(connection.origin, [])
        if len(idle) >= self.max_idle:
            connection.close()
        else:
            idle.append(connection)

    def forget(self, connection: _Connection) -> None:
        self._active.discard(connection)
        idle = self._idle.get(connection.origin)
        if idle and connection in idle:
            idle.remove(connection)

    async def open(
        self, method: str, url: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> UpstreamResponse:
        """Send the request; return once the response's status and headers arrived."""
        if self._closed:
            raise RuntimeError("UpstreamClient is closed")
        origin, target = self._target(url)
        head = _head(method, target, origin, body, headers)
        loop = asyncio.get_running_loop()
        fresh = False
        for _ in range(2):
            # After a stale one, a new connection: the others in the pool may be stale too.
            connection = None if fresh else self._idle_connection(origin)
            reused = connection is not None
            if connection is None:
                connection = await self._connect(origin)
            self._active.add(connection)
            response = UpstreamResponse(loop)
            connection.send(response, head, body)
            try:
                await response.headers_ready
            except ReplicaDown:
                response.close()
                raise
            except UpstreamError:
                stale = reused and not connection.received_any
                response.close()
                if stale:
                    fresh = True
                    continue  # the replica had closed it while idle: once more, on a new one
                raise
            except BaseException:
                response.close()
                raise
            return response
        raise UpstreamError("the replica closed every connection")  # pragma: no cover - loop returns or raises

    async def fetch(
        self,
        method: str,
        url: str,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        *,
        timeout_s: float | None = None,
        max_bytes: int | None = None,
    ) -> Fetched:
        """The whole exchange, within ``timeout_s``; a body of more than ``max_bytes`` is
        ``ResponseTooLarge`` (the connection is closed, not read to its end)."""
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        fired = False

        def expire() -> None:
            nonlocal fired
            fired = True
            task.cancel()

        timer = loop.call_later(timeout_s, expire) if timeout_s is not None else None
        response: UpstreamResponse | None = None
        try:
            response = await self.open(method, url, body, headers)
            data = await response.read(max_bytes)
            fetched = Fetched(response.status, response.content_type, data, response.retry_after)
            response.release()
            response = None
            return fetched
        except asyncio.CancelledError:
            if fired and task.uncancel() == 0:
                raise TimeoutError(f"no complete answer from {url} within {timeout_s} s") from None
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if response is not None:
                response.close()

    def abandon_waiting(self, base_url: str, reason: str) -> int:
        """Fail every exchange with ``base_url``'s origin that has none of its body yet, with
        ``ReplicaDown(reason)``, and close their connections and the idle ones; the number
        failed. Exchanges whose body is arriving are left alone: a stream under way belongs
        to its client, and the chunk-gap timeout judges it."""
        origin, _ = self._target(base_url)
        for connection in self._idle.pop(origin, []):
            connection.close()
        failed = 0
        for connection in [c for c in self._active if c.origin == origin]:
            response = connection.response
            if response is None or response.body_seen or response.complete:
                continue
            connection.response = None  # its connection_lost must not finish or fail it again
            response.fail(ReplicaDown(reason))
            connection.close()
            failed += 1
        return failed

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for connection in list(idle):
                connection.close()
        self._idle.clear()
        for connection in list(self._active):
            connection.close()
        self._active.clear()


async def _within(task: asyncio.Future[Any], timeout_s: float) -> None:
    """Wait for ``task`` up to ``timeout_s``; TimeoutError if it is not done by then.

    A timer that comes due while the event loop was held up (a starved machine, a long
    callback) runs before the I/O that arrived meanwhile is read: uvloop runs due timers
    first in each pass, and asyncio wakes the waiting task only a pass after reading. A
    connection the kernel completed in a millisecond would then count as the replica's
    timeout, and against its circuit breaker. So the verdict waits for the loop to poll
    its I/O a few times (``_POLLS_BEFORE_TIMEOUT``, each a pass of the loop, not a delay).
    """
    done, _ = await asyncio.wait((task,), timeout=timeout_s)
    for _ in range(_POLLS_BEFORE_TIMEOUT):
        if done or task.done():
            return
        await asyncio.sleep(0)
    if not task.done():
        raise TimeoutError(f"not done within {timeout_s} s")


def _abandon(connecting: asyncio.Future[tuple[asyncio.Transport, _Connection]]) -> None:
    """Give up a connection attempt: cancel it, or close what it made all the same."""
    if not connecting.done():
        connecting.cancel()
    elif not connecting.cancelled() and connecting.exception() is None:
        connecting.result()[0].close()


def _head(method: str, target: bytes, origin: _Origin, body: bytes, headers: dict[str, str] | None) -> bytes:
    lines = [
        method.encode("ascii"),
        b" ",
        target,
        b" HTTP/1.1\r\nHost: ",
        origin.host_header,
        b"\r\nContent-Length: ",
        str(len(body)).encode("ascii"),
        b"\r\n",
    ]
    if headers:
        for name, value in headers.items():
            if "\r" in value or "\n" in value:
                raise UpstreamError(f"header {name} holds a line break")
            lines += (name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)
