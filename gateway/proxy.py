"""Forward one call to the fleet: send, retry before commit, relay. I/O only: which replica
each attempt goes to, and whether there is another attempt, is the request's route's decision
(``Route.next_attempt``); streamed and whole responses share one attempt loop (``_answer``).
What the stages must see of a 200 answer on its way out, they see through the exchange's
taps (``gateway.exchange.Tap``): the proxy runs them and knows none of them.

Retry rule: an attempt that fails before anything reached the client (connect error,
timeout before the first byte, a 5xx) is retried on another replica, then on the model's
fallback chain (the route, ``routing.route.Route``, walks both), up to
``upstream.max_attempts``, while the pool's retry budget allows and the request's deadline
has not passed (then 504). Once a data event has been written, the client owns the
stream: a later failure ends it with an SSE error event, never silently.

Timeouts: ``connect_timeout_s`` to open a connection, ``first_byte_timeout_s`` until the
first token (or the whole response when not streaming, bounded by ``request_timeout_s``).
While a streaming client waits for its first token, an SSE comment is sent every
``keepalive_interval_s``. A deadline the client set (``x-fleetgate-timeout-ms``) cuts the
attempt in flight, stops further attempts, and ends a stream already under way with a
``deadline_exceeded`` error event. When health checks take a replica out of rotation, the
requests still waiting on it for an answer are retried elsewhere at once (``Proxy.abandon``).

A stream under way that goes silent is cut after its model's chunk gap
(``models[].chunk_gap_timeout_s``, else ``upstream.chunk_gap_timeout_s``) only if nothing
vouches for its replica (``Replica.alive``: taken down by its probes, failed, restarted,
or never probed). A replica the health checks still hold alive is merely slow: a stalled
engine finishes its streams afterwards, and a cut there throws away an answer the client
would have had. Such a stream waits, up to ``upstream.stall_timeout_s`` of silence (the
bound for an engine hung for good behind a ``/health`` that still answers), or the
client's deadline.
Every cut is recorded with its reason (``CUT_*``): the access line's ``cut`` and
``fleetgate_stream_cuts_total``.

Preemption (``routing.preemption``): a request of a band that preempts, sent to a replica,
moves the streams of preemptible bands running there to other replicas, each continued
exactly as a drained replica's are (``_preempt``; the continuation's reason
``"preempted"``). A preempted stream spends none of ``upstream.max_continuations`` (its
band's ``max_preemptions`` bounds how often it moves), and when no other replica can take
its continuation it goes back to the replica it left rather than end: preemption never
loses a stream. Non-streamed requests cannot be continued and stay where they run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from enum import StrEnum
from typing import Any, Final, NamedTuple, TypeVar

import orjson
from aiohttp import web

from dialects import continuation
from dialects.stream import SseError, SseScanner
from gateway.client_stream import end_with_error, prepare, with_keepalive
from gateway.errors import BadGateway, GatewayError, GatewayTimeout, ServiceUnavailable
from gateway.exchange import REPLICA_HEADER, TIER_HEADER, Continued, Exchange
from gateway.metrics import GatewayMetrics
from gateway.progress_timeout import DEADLINE, LIMIT, ProgressTimeout
from gateway.settings import UpstreamSettings
from gateway.upstream import (
    ConnectTimeout,
    ReplicaDown,
    ResponseTooLarge,
    UpstreamClient,
    UpstreamError,
    UpstreamResponse,
)
from replicas.replica import Claim, Replica
from routing.preemption import has_haven, has_refuge, may_preempt
from routing.route import EXHAUSTED, NO_REPLICA, Route

CANCELLED = "The response was cancelled (POST /v1/responses/{id}/cancel)."

# Why a stream under way ended before its replica finished it (``Exchange.cut``); the
# gateway adds "client_gone" when the client leaves. Silent past the chunk gap, on a replica
# never probed (nothing says it is alive):
CUT_CHUNK_GAP: Final = "chunk_gap"
# ... on a replica the health checks no longer hold alive (down, failed, restarted):
CUT_REPLICA_DOWN: Final = "replica_down"
# Silent for upstream.stall_timeout_s, though its replica still looked alive:
CUT_STALL_TIMEOUT: Final = "stall_timeout"
# The client's own deadline (x-fleetgate-timeout-ms) passed:
CUT_DEADLINE: Final = "deadline"
# The replica closed or broke the connection, or ended the stream unfinished:
CUT_UPSTREAM_CLOSED: Final = "upstream_closed"
# The replica's stream could not be read as its API's events:
CUT_MALFORMED: Final = "malformed"
# The client cancelled it (POST /v1/responses/{id}/cancel):
CUT_CANCELLED: Final = "cancelled"
# Not a cut: a drained replica's stream, moved to another replica (``Proxy.migrate``).
MIGRATE_DRAIN: Final = "drain"
# Not a cut: a preemptible band's stream, moved off for a higher band's work (``Proxy._preempt``).
PREEMPTED: Final = "preempted"
# The message of the error event a moved stream ends with, should no replica finish it.
_MOVED = {
    MIGRATE_DRAIN: "The replica was drained; the stream was cut.",
    PREEMPTED: "The stream gave way to a higher band's work; the stream was cut.",
}
# The cuts that are the replica's fault (counted against it).
_REPLICA_FAULTS = frozenset({CUT_CHUNK_GAP, CUT_REPLICA_DOWN, CUT_STALL_TIMEOUT, CUT_UPSTREAM_CLOSED, CUT_MALFORMED})
# The most of a stream kept for its continuation: a stream longer than this is cut, as
# before, when its replica fails.
MAX_RELAYED_BYTES = 16 * 1024 * 1024
# While a silent stream's replica is vouched alive, how often to ask again: a health round
# (1 s by default), so a replica the probes take down cuts its silent streams within one.
ALIVE_RECHECK_S = 1.0

log = logging.getLogger("fleetgate.proxy")

T = TypeVar("T")


class Failure(StrEnum):
    """Why one attempt failed (the ``fleetgate_upstream_errors`` label)."""

    CONNECT = "connect"
    CONNECT_TIMEOUT = "connect_timeout"
    TIMEOUT = "timeout"
    REPLICA_DOWN = "replica_down"
    STATUS = "status"  # a 5xx
    AUTH = "auth"  # the replica refused the gateway's own credentials
    EOF = "eof"  # closed before the first token
    MALFORMED = "malformed"
    STREAM = "stream"  # broke after the first byte
    # Not the replica's fault: another would do the same, so no retry.
    DEADLINE = "deadline"
    TOO_LARGE = "too_large"


class UpstreamFailure(Exception):
    """One attempt failed in a way another replica might not."""

    def __init__(self, kind: Failure, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


class Proxy:
    """Owns the pooled keep-alive connections to every replica (``gateway.upstream``)."""

    def __init__(
        self,
        settings: UpstreamSettings,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
        *,
        chunk_gaps: Mapping[str, float] | None = None,
        preemptions: Sequence[int | None] = (),
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        # Model name -> its chunk gap (``gateway.settings.chunk_gaps``); others: the upstream's.
        self._chunk_gaps = dict(chunk_gaps or {})
        self._client: UpstreamClient | None = None
        # Streams under way, by the id of the replica serving them (``migrate``).
        self._legs: dict[str, set[_Leg]] = {}
        # The replicas of a replica's model (``bind_fleet``): where its streams could move.
        self._peers: Callable[[Replica], Sequence[Replica]] = lambda replica: ()
        # Replicas whose streams were moved off (``migrate``): a stream that starts relaying
        # on one while it is still out of rotation moves at once.
        self._moved_off: set[str] = set()
        # By band: how often one of its streams may be preempted (None: never; ``routing.bands``).
        self._max_preemptions = tuple(preemptions)
        # Streams under way of preemptible bands, by replica id (``_preempt``).
        self._yielding: dict[str, set[_Leg]] = {}

    async def __aenter__(self) -> Proxy:
        self._client = UpstreamClient(
            connect_timeout_s=self.settings.connect_timeout_s, max_idle_per_origin=self.settings.pool_size
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    @property
    def client(self) -> UpstreamClient:
        if self._client is None:
            raise RuntimeError("Proxy used outside its 'async with' block")
        return self._client

    def abandon(self, replica: Replica) -> None:
        """Health checks took ``replica`` out of rotation: the requests waiting on it for an
        answer (a whole one, or a stream's first chunk) are failed now and retried on
        another replica, instead of waiting out ``request_timeout_s`` or
        ``first_byte_timeout_s`` on a replica that stopped answering. Streams already under
        way are left to the chunk gap, which no longer finds the replica alive."""
        if self._client is None:
            return
        failed = self._client.abandon_waiting(replica.base_url, "health checks took the replica out of rotation")
        if failed:
            log.warning("requests moved off a replica gone down", extra={"replica": replica.id, "requests": failed})

    # -- shared by both paths -------------------------------------------------------------

    async def _answer(
        self, ex: Exchange, pick: Route, send: Callable[[Exchange, Replica], Awaitable[T]], streamed: bool
    ) -> tuple[Claim, T] | GatewayError:
        """Attempt after attempt until a replica answers: its claim (still held) and what
        ``send`` returned; or, when attempts ran out, the error to give the client.

        An attempt that raises ``UpstreamFailure`` counts against its replica and the next
        one begins, as far as ``pick.next_attempt`` allows (candidates left, the request's
        deadline, the retry budget). A deadline cut ends the attempts: no replica's fault.
        """
        last: UpstreamFailure | None = None
        for _ in range(self.settings.max_attempts):
            replica = self._next(ex, pick)
            if replica is None:
                break
            claim = pick.claim(replica, streamed)
            if claim.preempting:
                self._preempt(replica)
            try:
                if ex.cut_at_deadline:
                    result = await self._before_deadline(ex, send(ex, replica))
                else:
                    result = await send(ex, replica)
            except UpstreamFailure as failure:
                # Nothing but keep-alive comments reached the client: another replica may answer.
                claim.release()
                last = failure
                if failure.kind is Failure.DEADLINE:
                    break
                if failure.kind is Failure.TOO_LARGE:
                    # The request's answer, not the replica's fault: another would send as much.
                    self.metrics.upstream_errors.labels(replica.id, failure.kind).inc()
                    break
                self._failed(replica, failure)
                continue
            except BaseException:
                claim.release()
                raise
            replica.breaker.record_success()
            return claim, result
        return _exhausted(ex, last)

    def _next(self, ex: Exchange, pick: Route) -> Replica | None:
        """The next replica to try (the picker walks the pool, then the fallback models), and
        the attempt's bookkeeping; None when there is none (``ex.stop`` says why, if early)."""
        choice = pick.next_attempt(self.clock(), ex.tried, ex.attempts, ex.deadline)
        if isinstance(choice, str):
            if choice == NO_REPLICA:
                raise ServiceUnavailable(
                    f"No healthy replica is serving '{ex.call.model}' right now.", code="no_healthy_replica"
                )
            if choice != EXHAUSTED:
                ex.stop = choice
            return None
        replica = choice
        if ex.attempts:
            self.metrics.retries.labels(replica.model).inc()
        ex.attempts += 1
        ex.tried.add(replica.id)
        if ex.timeline is not None:
            ex.timeline.attempt(replica.id, replica.base_url, replica.served_model, self.clock())
        ex.replica = replica
        ex.headers[REPLICA_HEADER] = replica.id
        if replica.model != pick.model:
            ex.headers[TIER_HEADER] = replica.tier  # a fallback model answers
        return replica

    async def _before_deadline(self, ex: Exchange, attempt: Awaitable[T]) -> T:
        """``attempt``, cut when the deadline the client asked for passes."""
        assert ex.deadline is not None
        try:
            async with asyncio.timeout(ex.deadline - self.clock()):
                return await attempt
        except TimeoutError as exc:
            raise UpstreamFailure(Failure.DEADLINE, "the request's deadline passed") from exc

    def _failed(self, replica: Replica, failure: UpstreamFailure) -> None:
        self.metrics.upstream_errors.labels(replica.id, failure.kind).inc()
        replica.breaker.record_failure(self.clock())

    def _request_headers(self, ex: Exchange, replica: Replica) -> dict[str, str]:
        headers = {"Content-Type": ex.call.content_type, "X-Request-Id": ex.request_id}
        if ex.upstream_headers:
            headers.update(ex.upstream_headers)
        if ex.trace is not None:
            headers.update(ex.trace.upstream_headers())
        if replica.upstream_headers:
            headers.update(replica.upstream_headers)
        return headers

    # -- non-streaming ----------------------------------------------------------------------

    async def complete(self, ex: Exchange, pick: Route) -> web.Response | GatewayError:
        """The whole answer; an answer a tap refuses (``Tap.ending``) is that refusal instead."""
        answer = await self._answer(ex, pick, self._send, streamed=False)
        if isinstance(answer, GatewayError):
            raise answer
        claim, (status, body, ctype, parsed) = answer
        claim.release()
        ex.status = status
        if status != 200:
            ex.error_code = "upstream_client_error"
            body = ex.dialect.errors.from_upstream(status, body)
            return web.Response(status=status, body=body, content_type="application/json", headers=ex.headers)
        ex.usage = ex.dialect.usage(parsed)
        ex.answer = parsed
        for tap in ex.taps:
            refused = await tap.ending(parsed)
            if refused is not None:
                return refused
        for tap in ex.taps:
            body = tap.body(body)
        return web.Response(status=status, body=body, content_type=ctype, headers=ex.headers)

    async def _send(self, ex: Exchange, replica: Replica) -> tuple[int, bytes, str, dict[str, Any]]:
        """One attempt: the replica's status, body, content type and, for a 200, the body
        parsed (a 200 that is not a JSON object is a failed attempt, like a 5xx)."""
        call = ex.call
        url = replica.base_url + call.dialect.path
        ex.upstream_started = self.clock()
        try:
            status, ctype, body, retry_after = await self.client.fetch(
                "POST",
                url,
                _upstream_body(ex, replica),
                self._request_headers(ex, replica),
                timeout_s=self.settings.request_timeout_s,
                max_bytes=self.settings.max_response_bytes,
            )
            ctype = ctype or "application/json"
        except (TimeoutError, UpstreamError) as exc:
            raise _attempt_failed(replica, exc, "timed out") from exc
        finally:
            ex.upstream_ended = self.clock()
        replica.last_progress_at = ex.upstream_ended  # it answered: alive, however busy
        _check_status(replica, status)
        _pass_retry_after(ex, status, retry_after)
        parsed: Any = None
        if status == 200 and ex.dialect.answers_json:
            with contextlib.suppress(orjson.JSONDecodeError):
                parsed = orjson.loads(body)
            if not isinstance(parsed, dict):
                raise UpstreamFailure(
                    Failure.MALFORMED, f"{replica.id} answered 200 with a body that is not a JSON object"
                )
        return status, body, ctype, parsed or {}

    # -- streaming --------------------------------------------------------------------------

    async def stream(self, ex: Exchange, pick: Route, request: web.Request) -> web.StreamResponse:
        interval_s = self.settings.keepalive_interval_s

        async def open_with_keepalive(ex: Exchange, replica: Replica) -> tuple[UpstreamResponse | web.Response, bytes]:
            return await with_keepalive(ex, request, self._open(ex, replica), interval_s)

        answer = await self._answer(ex, pick, open_with_keepalive, streamed=True)
        if isinstance(answer, GatewayError):
            if ex.response is None:
                raise answer
            # Keep-alives went out, so the status is already 200: end with an error event.
            await end_with_error(ex, ex.response, answer)
            return ex.response
        claim, (upstream, first) = answer
        if isinstance(upstream, web.Response):
            # The replica refused the request (4xx): pass its error through.
            claim.release()
            ex.error_code = "upstream_client_error"
            if ex.response is None:
                return upstream
            await end_with_error(ex, ex.response, _refusal(ex, upstream))
            return ex.response
        leg = _Leg(claim, upstream)
        try:
            return await self._relay(ex, pick, leg, first, request)
        finally:
            self._close_leg(leg)

    async def _open(self, ex: Exchange, replica: Replica) -> tuple[UpstreamResponse | web.Response, bytes]:
        """Send the request and read the first chunk, within ``first_byte_timeout_s``; a
        replica's refusal (a status other than 200 that is no failure) is the response to give."""
        call = ex.call
        ex.upstream_started = self.clock()
        body = _upstream_body(ex, replica)
        refused = functools.partial(self._refused, ex, replica)
        return await self._open_stream(replica, call.dialect.path, body, self._request_headers(ex, replica), refused)

    async def _refused(self, ex: Exchange, replica: Replica, resp: UpstreamResponse) -> web.Response:
        body = await resp.read(self.settings.max_response_bytes)
        status = resp.status
        resp.release()
        _check_status(replica, status)
        _pass_retry_after(ex, status, resp.retry_after)
        ex.status = status
        return web.Response(
            status=status,
            body=ex.dialect.errors.from_upstream(status, body),
            content_type="application/json",
            headers=ex.headers,
        )

    async def _open_stream(
        self,
        replica: Replica,
        path: str,
        body: bytes,
        headers: dict[str, str],
        refused: Callable[[UpstreamResponse], Awaitable[web.Response]] | None,
    ) -> tuple[UpstreamResponse | web.Response, bytes]:
        """Send a streamed request and read its first chunk within ``first_byte_timeout_s``:
        (the response, that chunk); for a status other than 200, what ``refused`` makes of
        the response, or with no ``refused``, a failed attempt."""
        resp: UpstreamResponse | None = None
        try:
            async with asyncio.timeout(self.settings.first_byte_timeout_s):
                resp = await self.client.open("POST", replica.base_url + path, body, headers)
                if resp.status != 200:
                    if refused is not None:
                        return await refused(resp), b""
                    status = resp.status
                    resp.close()
                    raise UpstreamFailure(Failure.STATUS, f"{replica.id} answered {status}", status)
                first = await resp.readany()
                if not first:
                    resp.release()
                    raise UpstreamFailure(Failure.EOF, f"{replica.id} closed the stream before any token")
                return resp, first
        except (TimeoutError, UpstreamError) as exc:
            if resp is not None:
                resp.close()
            raise _attempt_failed(replica, exc, "sent nothing in time") from exc

    async def _relay(
        self, ex: Exchange, pick: Route, leg: _Leg, first: bytes, request: web.Request
    ) -> web.StreamResponse:
        """Relay the stream to the client; when its replica fails (or drains) after the first
        byte, finish it on another replica of the same model where the dialect can continue
        it exactly (``_resume``), else end it with an error event."""
        response = ex.response or await prepare(ex, request)
        scanner = ex.call.dialect.scanner(ex.call)
        leg.bound = self._preemption_bound(ex)
        # What the client was sent, as the replica sent it: what a continuation starts from.
        relayed = _Relayed() if self.settings.max_continuations or leg.bound is not None else None
        gaps = self.metrics.itl.new_gaps()
        clock = self.clock
        out, n = scanner.feed(first)
        now = clock()
        ex.first_token_at = leg.claim.replica.last_progress_at = now
        leg.claim.prefilled()
        leg.claim.generated(n)
        self._track(leg)
        outbound = _Outbound(ex, scanner, leg, response, relayed)
        if relayed is not None:
            leg.plan = functools.partial(self._plan, ex, leg.claim.replica.served_model, relayed)
        await outbound.write(out)
        try:
            first = b""
            while True:
                cut = await self._pump(ex, leg, scanner, outbound, gaps, first)
                if cut is None:
                    break
                if cut.reason in _REPLICA_FAULTS:
                    self._failed(leg.claim.replica, UpstreamFailure(Failure.STREAM, cut.message))
                resumed = None
                if cut.resumable:
                    resumed = await self._resume(ex, pick, leg, cut, request)
                if resumed is None:
                    await self._end(ex, leg, response, cut)
                    break
                scanner.drop_pending()  # the broken event was never sent: the continuation replaces it
                first = resumed
        finally:
            ex.upstream_ended = clock()
            ex.usage = scanner.usage
            ex.answer = scanner.final
            ex.generated = scanner.events
            self.metrics.itl.merge((ex.call.model,), gaps)
        return response

    async def _pump(
        self, ex: Exchange, leg: _Leg, scanner: SseScanner, outbound: _Outbound, gaps: Any, first: bytes
    ) -> _Cut | None:
        """Relay ``leg``'s stream (``first``: a chunk already read from it) until it ends:
        None when it finished, else why it stopped."""
        clock = self.clock
        replica = leg.claim.replica
        upstream = leg.upstream
        splice = leg.splice
        gap = self._chunk_gaps.get(replica.model, self.settings.chunk_gap_timeout_s)
        limit = self.settings.stall_timeout_s
        loop = asyncio.get_running_loop()
        # The client's own deadline bounds the whole stream, not only its first token.
        cut_at = math.inf
        if ex.cut_at_deadline and ex.deadline is not None:
            cut_at = loop.time() + (ex.deadline - clock())
        last = clock()
        try:
            async with ProgressTimeout(
                gap, cut_at, alive=replica.alive, limit_s=limit, recheck_s=ALIVE_RECHECK_S
            ) as deadline:
                while not scanner.done:
                    if first:
                        chunk, first = first, b""
                    else:
                        chunk = await upstream.readany()
                        if not chunk:
                            break
                    deadline.progressed()
                    if splice is not None:  # a continuation: framed, then fitted into the client's stream
                        chunk = splice(chunk)
                        if not chunk:
                            continue
                    out, n = scanner.feed(chunk)
                    if n:
                        now = replica.last_progress_at = clock()
                        gaps.add((now - last) / n, n)
                        last = now
                        leg.claim.generated(n)
                    await outbound.write(out)
        except TimeoutError:
            if deadline.reason == DEADLINE:
                return _Cut(CUT_DEADLINE, "The request's deadline passed; the stream was cut.", resumable=False)
            if deadline.reason == LIMIT:
                message = f"The replica sent nothing for {limit:g} s (upstream.stall_timeout_s); the stream was cut."
                return _Cut(CUT_STALL_TIMEOUT, message)
            why = CUT_CHUNK_GAP if replica.probe == "none" else CUT_REPLICA_DOWN
            return _Cut(why, f"The replica sent nothing for {gap:g} s; the stream was cut.")
        except UpstreamError:
            if ex.stop == "cancelled":  # the client's own cancel: no fault of the replica's
                return _Cut(CUT_CANCELLED, CANCELLED, resumable=False)
            if leg.migrating is not None:
                return _Cut(leg.migrating, _MOVED[leg.migrating])
            return _Cut(CUT_UPSTREAM_CLOSED, "The replica's connection broke mid-stream.")
        except SseError as exc:
            return _Cut(CUT_MALFORMED, f"The replica's stream was cut: {exc}.", resumable=False)
        if splice is None and (tail := scanner.finish()):
            await outbound.response.write(tail)
        if not scanner.done:
            return _Cut(CUT_UPSTREAM_CLOSED, "The replica ended the stream early.")
        return None

    def _plan(
        self, ex: Exchange, served: str, relayed: _Relayed, reason: str | None = None
    ) -> continuation.Continuation | None:
        """The continuation of ``ex``'s stream from what the client has been sent (pure),
        if one more is allowed for ``reason``: a preemption within its band's
        ``max_preemptions``, anything else within ``upstream.max_continuations``."""
        if relayed.full:
            return None
        if reason == PREEMPTED:
            if not may_preempt(_preemptions(ex), self._preemption_bound(ex)):
                return None
        elif not self._continuations_left(ex):
            return None
        sent = orjson.loads(ex.call.upstream_body(ex.adapter or served))
        return continuation.plan(ex.dialect.name, sent, relayed.bytes())

    async def _resume(self, ex: Exchange, pick: Route, leg: _Leg, cut: _Cut, request: web.Request) -> bytes | None:
        """Finish the stream on another replica of the same model (the same adapter): the
        dialect's continuation (``dialects.continuation``) of what the client already has,
        within ``upstream.max_continuations`` and the request's deadline. On success ``leg``
        is the new replica's and its first chunk is returned; None when the stream cannot
        go on.

        A continuation spends no retry budget: the budget stops retries from multiplying
        the load on a failing fleet, and a continuation adds none (the stream's remaining
        tokens move with it; it is bounded per stream). A replica that dies holding a
        hundred streams has all of them continued, not the budget's burst.

        The tokens the client already has are the relayed token events (exact where the
        stream carries token ids or running usage): never more than were generated, so the
        continuation never ends short of the uninterrupted answer's length, and the usage
        the client is told never exceeds its token limit. (Counting them by re-tokenising
        the partial text overcounts wherever it re-tokenises differently.)"""
        old = leg.claim.replica
        plan = leg.plan(cut.reason)
        # The stream runs there no more: the replica's load, and a drain or restart waiting
        # for it to empty, end now, not when the continuation's first token comes.
        self._close_leg(leg)
        # Not the replica it leaves, nor one that refused the continuation just now; a replica
        # the stream left before is a candidate again (undrained after a rolling restart).
        exclude = {old.id}
        # A preempted stream was fine where it ran: it is not bounded by max_continuations
        # (each replica is tried once, then the one it left), nor cut at the gateway's own
        # deadline (only the client's, which would have cut it there too).
        preempted = cut.reason == PREEMPTED
        back = False
        while plan is not None and (preempted or self._continuations_left(ex)):
            now = self.clock()
            if ex.deadline is not None and now >= ex.deadline and (ex.cut_at_deadline or not preempted):
                return None
            # A first attempt to the picker: no retry budget is spent (see above).
            choice = pick.next_attempt(now, exclude, 0, ex.deadline)
            if isinstance(choice, str) or choice.model != old.model:
                if not preempted or back:
                    return None  # none left, or only a fallback model: not the same answer
                # Nothing else can take it: back where it ran, rather than lose it.
                back, choice = True, old
            replica = choice
            served = ex.adapter or replica.served_model
            ex.continued = (*ex.continued, Continued(replica.id, cut.reason, plan.relayed_tokens))
            self.metrics.continuations.labels(ex.call.model, cut.reason).inc()
            ex.attempts += 1
            ex.tried.add(replica.id)
            ex.replica = replica
            if ex.timeline is not None:
                ex.timeline.attempt(replica.id, replica.base_url, replica.served_model, self.clock())
            claim = pick.claim(replica, streamed=True)
            if claim.preempting:
                self._preempt(replica)
            body = orjson.dumps({**plan.body, "model": served, **_priority(ex, replica)})
            try:
                upstream, first = await with_keepalive(
                    ex,
                    request,
                    self._open_continuation(ex, replica, plan.path, body),
                    self.settings.keepalive_interval_s,
                    discard=_close_opened,
                )
            except UpstreamFailure as failure:
                claim.release()
                self._failed(replica, failure)
                exclude.add(replica.id)
                continue
            except BaseException:
                # The client left while the continuation opened: nothing holds the claim
                # (the leg still has the replica it left), so it is handed back here.
                claim.release()
                raise
            log.log(
                logging.DEBUG if preempted else logging.INFO,
                "stream continued on another replica",
                extra={"request_id": ex.request_id, "from": old.id, "to": replica.id, "reason": cut.reason},
            )
            leg.claim, leg.upstream, leg.splice, leg.migrating = claim, upstream, _splicer(plan), None
            claim.prefilled()
            replica.last_progress_at = self.clock()
            self._track(leg)
            return first
        return None

    async def _open_continuation(
        self, ex: Exchange, replica: Replica, path: str, body: bytes
    ) -> tuple[UpstreamResponse, bytes]:
        """Send a continuation and read its first chunk; any answer but a 200 stream is a
        failed attempt (the client's status is already sent)."""
        headers = self._request_headers(ex, replica)
        headers["Content-Type"] = "application/json"
        upstream, first = await self._open_stream(replica, path, body, headers, None)
        assert not isinstance(upstream, web.Response)
        return upstream, first

    async def _end(self, ex: Exchange, leg: _Leg, response: web.StreamResponse, cut: _Cut) -> None:
        """End a stream that cannot go on with its API's error event."""
        ex.cut = cut.reason
        if cut.reason == CUT_DEADLINE:
            ex.stop = "deadline"
            err = GatewayTimeout(cut.message, code="deadline_exceeded")
            await end_with_error(ex, response, err)
            return
        if cut.reason == CUT_CANCELLED:
            await end_with_error(ex, response, GatewayError(CANCELLED, code="response_cancelled"))
            return
        replica = leg.claim.replica
        self.metrics.stream_errors.labels(ex.call.model).inc()
        if cut.reason in (CUT_CHUNK_GAP, CUT_REPLICA_DOWN, CUT_STALL_TIMEOUT):
            log.warning(
                "silent stream cut",
                extra={
                    "request_id": ex.request_id,
                    "replica": replica.id,
                    "cut": cut.reason,
                    "state": replica.state.value,
                },
            )
        await end_with_error(ex, response, BadGateway(cut.message, code="upstream_stream_error"))

    # -- streams under way, by replica (migration on drain) ---------------------------------

    def _track(self, leg: _Leg) -> None:
        replica = leg.claim.replica
        self._legs.setdefault(replica.id, set()).add(leg)
        if replica.id in self._moved_off and not replica.routable(self.clock()):
            # Its first token came after the drain's streams were moved: it moves too.
            asyncio.get_running_loop().call_soon(self._move, leg)
        elif leg.bound is not None:
            self._yielding.setdefault(replica.id, set()).add(leg)
            if replica.preempting and has_haven(replica, self._peers(replica), self.clock()):
                # It began beside preempting work (no replica was free of it when it was
                # sent, or that work came during its prefill) and one is free now: it moves.
                asyncio.get_running_loop().call_soon(self._move_if_on, leg, replica)

    def _close_leg(self, leg: _Leg) -> None:
        """Hand back what ``leg`` holds: its claim and its connection."""
        rid = leg.claim.replica.id
        legs = self._legs.get(rid)
        if legs is not None:
            legs.discard(leg)
        if leg.bound is not None and (yielding := self._yielding.get(rid)) is not None:
            yielding.discard(leg)
        leg.claim.release()
        leg.upstream.release()

    def _move(self, leg: _Leg, reason: str = MIGRATE_DRAIN) -> bool:
        """Close ``leg``'s connection so its relay continues the stream elsewhere, if it can
        be continued (for ``reason``); whether it was."""
        if leg.migrating is not None or leg.plan(reason) is None:
            return False
        leg.migrating = reason
        leg.upstream.fail(UpstreamError(f"the stream was moved off its replica ({reason})"))
        leg.upstream.close()
        return True

    def _move_if_on(self, leg: _Leg, replica: Replica) -> None:
        """Preempt ``leg`` if it still runs on ``replica`` (it may have ended meanwhile)."""
        if leg in self._yielding.get(replica.id, ()):
            self._move(leg, PREEMPTED)

    def _preempt(self, replica: Replica) -> None:
        """A preempting request was just sent to ``replica``: the preemptible bands'
        streams running there move to other replicas (each relay continues its own), if
        another replica can take them. O(1) while none runs there."""
        legs = self._yielding.get(replica.id)
        if not legs or not has_refuge(replica, self._peers(replica), self.clock()):
            return
        moved = sum(self._move(leg, PREEMPTED) for leg in list(legs))
        if moved:
            log.debug("streams preempted", extra={"replica": replica.id, "streams": moved})

    def _preemption_bound(self, ex: Exchange) -> int | None:
        """How often ``ex``'s stream may be preempted (None: its band is not preemptible)."""
        bounds = self._max_preemptions
        route = ex.route
        if not bounds or route is None or route.band >= len(bounds):
            return None
        return bounds[route.band]

    def _continuations_left(self, ex: Exchange) -> bool:
        """Whether ``ex``'s stream may be continued once more after a failure or a drain
        (preemptions are not counted: ``_plan``)."""
        return len(ex.continued) - _preemptions(ex) < self.settings.max_continuations

    def bind_fleet(self, peers: Callable[[Replica], Sequence[Replica]]) -> None:
        """Where a drained replica's streams could move: the replicas of its model."""
        self._peers = peers

    def migrate(self, replica: Replica) -> None:
        """``replica`` is drained or leaves the fleet: its streams still running after
        ``upstream.migrate_after_s`` are moved to other replicas (each one's connection is
        closed, and its relay continues it elsewhere), instead of being waited for to their
        end. A stream that cannot be continued, or that no other replica can take, is left
        to finish where it is (a restart's grace then bounds it: ``Fleet.restart``)."""
        if not self.settings.max_continuations:
            return
        loop = asyncio.get_running_loop()
        loop.call_later(self.settings.migrate_after_s, self._migrate_now, replica)

    def _migrate_now(self, replica: Replica) -> None:
        """Close the connections of ``replica``'s streams that another replica can finish:
        each relay continues its stream there. The others (nothing can take them, or they
        cannot be continued) are left to finish where they are."""
        if not has_refuge(replica, self._peers(replica), self.clock()):
            log.info("a drained replica's streams stay: no other replica can take them", extra={"replica": replica.id})
            return
        self._moved_off.add(replica.id)
        moved = sum(self._move(leg) for leg in list(self._legs.get(replica.id, ())))
        if moved:
            log.info("streams moved off a drained replica", extra={"replica": replica.id, "streams": moved})


def _close_opened(opened: tuple[UpstreamResponse, bytes]) -> None:
    """A continuation's stream opened after its client left: nothing will read it."""
    opened[0].close()


def _preemptions(ex: Exchange) -> int:
    """How often ``ex``'s stream has been preempted so far."""
    return sum(1 for c in ex.continued if c.reason == PREEMPTED)


def _upstream_body(ex: Exchange, replica: Replica) -> bytes:
    """The body an attempt sends ``replica``: the dialect's, with the request's band as
    ``priority`` where the replica runs vLLM's priority scheduler (``routing.bands``). The
    highest band is priority 0, vLLM's default, so its bodies go untouched."""
    body = ex.call.upstream_body(ex.adapter or replica.served_model)
    priority = _priority(ex, replica)
    if not priority:
        return body
    return orjson.dumps({**orjson.loads(body), **priority})


def _priority(ex: Exchange, replica: Replica) -> dict[str, int]:
    """``{"priority": band}`` for a lower band's request to a priority-scheduling replica, else empty."""
    route = ex.route
    if replica.priority_scheduling and route is not None and route.band:
        return {"priority": route.band}
    return {}


def _cancel(ex: Exchange, upstream: UpstreamResponse) -> None:
    """Stop a stream its client cancelled (``POST /v1/responses/{id}/cancel``): the replica's
    connection closes (vLLM aborts the generation) and the relay ends the stream."""
    ex.stop = "cancelled"
    upstream.fail(UpstreamError("the response was cancelled"))
    upstream.close()


def _check_status(replica: Replica, status: int) -> None:
    """Fail the attempt on a status another replica might not give.

    A 5xx, and a 401 or 403: the replica refused the gateway's own credentials (its source's
    ``api_key``), which is no fault of the client's and must not reach it as one.
    """
    if status >= 500:
        raise UpstreamFailure(Failure.STATUS, f"{replica.id} answered {status}", status)
    if status in (401, 403):
        raise UpstreamFailure(Failure.AUTH, f"{replica.id} refused the gateway's credentials ({status})", status)


def _pass_retry_after(ex: Exchange, status: int, value: str) -> None:
    """A 429 passed through keeps the replica's Retry-After: a hosted upstream's rate limit
    says when to come back, and an SDK's retry waits that long."""
    if status == 429 and value:
        ex.headers["Retry-After"] = value


def _attempt_failed(replica: Replica, exc: TimeoutError | UpstreamError, timed_out: str) -> UpstreamFailure:
    """The failure kind of an attempt the replica client gave up on (``timed_out``: what a
    plain timeout says of the replica)."""
    if isinstance(exc, ConnectTimeout):
        return UpstreamFailure(Failure.CONNECT_TIMEOUT, f"{replica.id}: {exc}")
    if isinstance(exc, TimeoutError):
        return UpstreamFailure(Failure.TIMEOUT, f"{replica.id} {timed_out}")
    if isinstance(exc, ResponseTooLarge):
        return UpstreamFailure(Failure.TOO_LARGE, f"{replica.id}: {exc}")
    if isinstance(exc, ReplicaDown):
        return UpstreamFailure(Failure.REPLICA_DOWN, f"{replica.id}: {exc}")
    return UpstreamFailure(Failure.CONNECT, f"{replica.id}: {exc}")


def _exhausted(ex: Exchange, last: UpstreamFailure | None) -> GatewayError:
    kind = last.kind if last is not None else None
    if ex.stop == "deadline" or kind is Failure.DEADLINE:
        return GatewayTimeout(
            f"The request's deadline passed after {ex.attempts} attempt(s).", code="deadline_exceeded"
        )
    if kind is Failure.TIMEOUT:
        return GatewayTimeout(f"The replica did not answer in time after {ex.attempts} attempt(s).")
    if kind is Failure.CONNECT_TIMEOUT:
        return GatewayTimeout(
            f"No replica accepted a connection in time ({ex.attempts} attempt(s)).", code="upstream_connect_timeout"
        )
    if kind is Failure.TOO_LARGE:
        return BadGateway(
            "The replica's answer is larger than the gateway holds for a non-streamed request "
            "(upstream.max_response_bytes); ask for it streamed.",
            code="upstream_response_too_large",
        )
    if ex.stop == "retry_budget":
        return BadGateway(
            f"The replica failed ({ex.attempts} attempt(s)); retries are paused while many requests fail.",
            code="upstream_error",
        )
    return BadGateway(f"All {ex.attempts} attempt(s) to reach a replica failed.", code="upstream_error")


def _refusal(ex: Exchange, upstream: web.Response) -> GatewayError:
    body = upstream.body if isinstance(upstream.body, bytes) else b""
    message = ex.dialect.errors.message_of(body) or f"The replica refused the request ({upstream.status})."
    return BadGateway(message, code="upstream_client_error")


class _Cut(NamedTuple):
    """Why a stream under way stopped before its end: a CUT_* reason (or ``MIGRATE_DRAIN``),
    the message of its error event, and whether another replica may finish it."""

    reason: str
    message: str
    resumable: bool = True


class _Leg:
    """The part of a stream one replica serves: its claim, its connection, and (on a
    continuation) what fits its events into the client's stream."""

    __slots__ = ("bound", "claim", "migrating", "plan", "splice", "upstream")

    def __init__(self, claim: Claim, upstream: UpstreamResponse) -> None:
        self.claim = claim
        self.upstream = upstream
        self.splice: Callable[[bytes], bytes] | None = None
        # Why its connection is being closed on purpose: its replica drains (``Proxy.migrate``)
        # or it gives way to a higher band (``Proxy._preempt``); None while it is not.
        self.migrating: str | None = None
        # Its band's ``max_preemptions`` (None: not preemptible).
        self.bound: int | None = None
        # The stream's continuation from what the client has now, if one more is allowed
        # for the reason given (None: it has none).
        self.plan: Callable[[str | None], continuation.Continuation | None] = _no_plan


class _Relayed:
    """The events the client was sent, as the replica sent them (bounded: past
    ``MAX_RELAYED_BYTES`` the stream is no longer continued, and nothing more is kept)."""

    __slots__ = ("_chunks", "_size", "full")

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        self.full = False

    def add(self, out: bytes) -> None:
        if self.full:
            return
        self._size += len(out)
        if self._size > MAX_RELAYED_BYTES:
            self.full = True
            self._chunks.clear()
            return
        self._chunks.append(out)

    def bytes(self) -> bytes:
        return b"".join(self._chunks)


class _Outbound:
    """Whole events on their way to the client: kept for a continuation, shown to the
    exchange's taps (told the stream's answer once its first event names it, given the
    whole answer before its end goes out, each block), then written."""

    __slots__ = ("_announced", "_ex", "_relayed", "_scanner", "leg", "response")

    def __init__(
        self,
        ex: Exchange,
        scanner: SseScanner,
        leg: _Leg,
        response: web.StreamResponse,
        relayed: _Relayed | None,
    ) -> None:
        self._ex = ex
        self._scanner = scanner
        self.leg = leg
        self.response = response
        self._relayed = relayed
        self._announced = False

    async def write(self, out: bytes) -> None:
        ex, scanner = self._ex, self._scanner
        if self._relayed is not None and out:
            self._relayed.add(out)
        taps = ex.taps
        if taps:
            if not self._announced and scanner.started is not None:
                self._announced = True
                started, leg = scanner.started, self.leg

                def stop() -> None:
                    _cancel(ex, leg.upstream)  # the leg's connection at the time of the cancel

                for tap in taps:
                    tap.started(started, stop)
            if scanner.done:
                for tap in taps:
                    refused = await tap.ending(scanner.final)
                    if refused is not None:
                        ex.error_code = refused.code
                        out = ex.dialect.errors.event(refused.message, refused.code or "upstream_error", refused.type)
                        break
            for tap in taps:
                out = tap.events(out)
        if out:
            await self.response.write(out)


def _no_plan(reason: str | None = None) -> continuation.Continuation | None:
    return None


def _splicer(plan: continuation.Continuation) -> Callable[[bytes], bytes]:
    """What fits a continuation's raw chunks into the client's stream: cut into whole events
    (any API's), then rewritten by the plan's splice."""
    framing = SseScanner(drop_usage=False)

    def splice(chunk: bytes) -> bytes:
        block, _ = framing.feed(chunk)
        return plan.splice(block) if block else b""

    return splice
