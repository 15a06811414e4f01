"""One request's context on its way through the gateway: the ``Exchange``.

Every stage of ``gateway.stages`` reads and fills it with what it learns of the request
(its tenant, its parsed call, its model and route), the proxy records its attempts in it,
and ``gateway.accounting`` counts and logs from it once the response has ended. What a stage
takes (a lease, a pool's slot, a coalescing flight) it hands back through the exchange's
releases (``Exchange.release``), run in reverse order when the request's path ends; what a
stage must see of the answer on its way out, it sees through a ``Tap``. Also here: the
request id and the header names the gateway reads and sets.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

from aiohttp import web

from dialects.base import Call, Dialect

if TYPE_CHECKING:
    from gateway.errors import GatewayError
    from gateway.settings import TenantSettings
    from gateway.spans import Timeline
    from gateway.tracing import TraceContext
    from replicas.replica import Replica
    from routing.route import Route

log = logging.getLogger("fleetgate.app")

# Request headers: the request's id (honoured if sent), a forced tier (where the tenant
# allows it), the request's own time bound, a lower queueing priority.
REQUEST_ID_HEADER = "x-request-id"
TIER_HEADER = "x-fleetgate-tier"
TIMEOUT_HEADER = "x-fleetgate-timeout-ms"
PRIORITY_HEADER = "x-fleetgate-priority"
# A lower priority band than the tenant's (request); the band the request got (response).
BAND_HEADER = "x-fleetgate-band"
# Response headers: the tier and replica that answered, where the answer came from, and
# (debug) how the request was classified.
CACHE_HEADER = "x-fleetgate-cache"
REPLICA_HEADER = "x-fleetgate-replica"
ROUTE_HEADER = "x-fleetgate-route"
# nginx's "client closed request": the client left before the response ended.
CLIENT_CLOSED = 499
_MAX_REQUEST_ID = 128
# Generated request ids: a random prefix per process and a counter (unique across pods,
# and cheaper than fresh random bytes for every request).
_ID_PREFIX = os.urandom(6).hex()
_ID_SERIAL = itertools.count(1)

# What a stage hands back when the request's path ends: called with the exception that
# ended it (None when it ended with a response, a refusal included).
Release = Callable[[BaseException | None], None]


@dataclass(frozen=True, slots=True)
class Continued:
    """One continuation of a stream: the replica that took it over, why the one before
    stopped (a CUT_* reason, "drain" or "preempted"), and how many tokens the client had by then."""

    replica: str
    reason: str
    relayed_tokens: int


def request_id(request: web.Request) -> str:
    """The client's ``x-request-id`` when it is usable, else a fresh one."""
    sent = request.headers.get(REQUEST_ID_HEADER)
    # Printable ASCII only: it goes back out in headers (to the client, to replicas).
    if sent and len(sent) <= _MAX_REQUEST_ID and sent.isascii() and sent.isprintable():
        return sent
    return f"{_ID_PREFIX}{next(_ID_SERIAL):012x}"


class Tap:
    """A stage's view of a 200 answer on its way to the client (``Exchange.taps``).

    The proxy, and the cache stage when it replays, run every tap of the exchange in the
    order the stages installed them. The defaults see nothing and change nothing.
    """

    __slots__ = ()

    def started(self, answer: dict[str, Any], stop: Callable[[], None]) -> None:
        """A stream's first event named its answer (its id); ``stop`` ends the stream."""

    async def ending(self, final: dict[str, Any] | None) -> GatewayError | None:
        """The whole answer (``final``: the parsed body, or the last event's answer), before
        its end reaches the client: None lets it go, else the error to answer instead."""
        return None

    def events(self, out: bytes) -> bytes:
        """Whole events of a stream on their way to the client."""
        return out

    def body(self, body: bytes) -> bytes:
        """A whole JSON answer on its way to the client."""
        return body


@dataclass(slots=True)
class Exchange:
    """What one request carries and learns on its way (for the stages, logs, metrics, limits).

    Filled in stage order: ``tenant`` by authentication, ``call`` by parsing (unset before:
    see ``parsed``), ``model`` and ``route`` by classification; the rest by the proxy.
    ``with exchange:`` runs the releases the stages added (``release``) when the path ends.
    """

    # The API the request speaks (its route).
    dialect: Dialect
    request_id: str
    headers: dict[str, str]
    started: float
    call: Call = field(init=False)
    tenant: TenantSettings | None = None
    key_id: str | None = None
    # The model the request is counted, limited, cached and logged as: the name it asked for
    # (an alias resolved), a LoRA ``adapter``'s own name included.
    model: str | None = None
    # The priority band it waits in when its pool is saturated (``routing.bands``; None:
    # refused before classification).
    band: str | None = None
    # The model whose pool serves it (``model``, or the base model of its ``adapter``).
    pool: str | None = None
    # The LoRA adapter the request names (routing.adapters): sent upstream as ``model``.
    adapter: str | None = None
    # Tokens a cache hit charges (None: settle on the replica's usage).
    charged: int | None = None
    replica: Replica | None = None
    attempts: int = 0
    # The response's status, and why it failed (the access log's ``error``).
    status: int = 0
    error_code: str | None = None
    # The usage the replica reported, normalised by the dialect (``prompt_tokens``...).
    usage: dict[str, Any] | None = None
    # The replica's whole answer, parsed: a JSON body, or the final event of a stream that
    # carries one (a Responses stream's ``response``); None otherwise.
    answer: dict[str, Any] | None = None
    # Request headers the dialect passes on to the replica (``anthropic-version``...).
    upstream_headers: dict[str, str] | None = None
    # A stored Responses conversation's id: its first response's (its routing session).
    chain: str | None = None
    first_token_at: float | None = None
    upstream_started: float | None = None
    upstream_ended: float | None = None
    tried: set[str] = field(default_factory=set)
    # The client's stream, once prepared (keep-alives or the first event sent).
    response: web.StreamResponse | None = None
    # Token events relayed (settles limits when a broken stream never reported usage).
    generated: int = 0
    # How the request is routed (tier, policy decisions, fallback; for the log line).
    route: Route | None = None
    # No new attempt starts past this time (gateway clock); with ``cut_at_deadline`` (the
    # client asked for a deadline) an attempt in flight is cut there too.
    deadline: float | None = None
    cut_at_deadline: bool = False
    # Why attempts stopped early: "deadline", "retry_budget" or "cancelled".
    stop: str | None = None
    # Why a stream under way ended before its replica finished it (``gateway.proxy``, CUT_*;
    # "client_gone" when its client left): the access line's ``cut`` and fleetgate_stream_cuts_total.
    cut: str | None = None
    # Each time the stream was finished on another replica (``gateway.proxy``): where, why
    # the one before stopped, and the tokens the client already had then.
    continued: tuple[Continued, ...] = ()
    # W3C trace context, forwarded to the replica as its parent.
    trace: TraceContext | None = None
    # Stage and attempt times for OpenTelemetry spans (None: tracing off).
    timeline: Timeline | None = None
    # What the stages see of a 200 answer on its way out, in the order they were installed.
    taps: tuple[Tap, ...] = ()
    _releases: list[Release] = field(default_factory=list)

    @property
    def parsed(self) -> bool:
        """Whether the body was parsed into ``call`` (a request refused before has none)."""
        return hasattr(self, "call")

    def used_tokens(self) -> int | None:
        """Tokens to settle: a cache hit's charge; else the replica's usage; else what was
        seen streaming; None releases the reservation."""
        if self.charged is not None:
            return self.charged
        if self.usage:
            total = self.usage.get("total_tokens")
            if isinstance(total, int):
                # A continued stream also charges each continuation's prompt once: the
                # original prompt again, plus the text the client already had.
                prompt = self.usage.get("prompt_tokens")
                again = prompt if isinstance(prompt, int) else 0
                return total + sum(again + c.relayed_tokens for c in self.continued)
        if self.generated and self.parsed:
            return self.call.prompt_tokens + self.generated
        return None

    def release(self, undo: Release) -> None:
        """Run ``undo`` when the request's path ends, before what was added earlier."""
        self._releases.append(undo)

    def __enter__(self) -> Exchange:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        releases = self._releases
        while releases:
            undo = releases.pop()
            try:
                undo(exc)
            except Exception:  # one stage's fault must not keep the others' from being released
                log.exception("a stage's release failed", extra={"request_id": self.request_id})
