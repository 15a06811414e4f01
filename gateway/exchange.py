"""One request's context on its way through the gateway: the ``Exchange``.

Every stage of ``gateway.stages`` reads and fills it, the proxy records its attempts in it,
and ``gateway.accounting`` settles and logs from it once the response has ended. Also here:
the request id, the header names the gateway reads and sets, and the tokens a request
settles. Routing is seen through the ``Picker`` protocol (``routing.router.Route``
implements it), so the proxy never depends on the router.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from dialects.base import Call, Dialect

if TYPE_CHECKING:
    from cache.coalesce import Leader
    from cache.keys import CachePlan
    from dialects.answer import Answers, CachedCompletion
    from gateway.responses_state import Keeper
    from gateway.settings import TenantSettings
    from gateway.spans import Timeline
    from gateway.tracing import TraceContext
    from limits.decision import Lease
    from replicas.replica import Claim, Replica
    from routing.router import Stop

# Request headers: the request's id (honoured if sent), a forced tier (where the tenant
# allows it), the request's own time bound, a lower queueing priority.
REQUEST_ID_HEADER = "x-request-id"
TIER_HEADER = "x-fleetgate-tier"
TIMEOUT_HEADER = "x-fleetgate-timeout-ms"
PRIORITY_HEADER = "x-fleetgate-priority"
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


def request_id(request: web.Request) -> str:
    """The client's ``x-request-id`` when it is usable, else a fresh one."""
    sent = request.headers.get(REQUEST_ID_HEADER)
    # Printable ASCII only: it goes back out in headers (to the client, to replicas).
    if sent and len(sent) <= _MAX_REQUEST_ID and sent.isascii() and sent.isprintable():
        return sent
    return f"{_ID_PREFIX}{next(_ID_SERIAL):012x}"


class Picker(Protocol):
    """Chooses the replicas of one request, attempt by attempt (``routing.router.Route``)."""

    @property
    def model(self) -> str:
        """The model whose pool serves the request (the one the cache key names)."""
        ...

    def next_attempt(self, now: float, tried: Collection[str], attempts: int, deadline: float | None) -> Replica | Stop:
        """The replica for the next attempt (none of ``tried``), or why there is none: the
        one retry decision (candidates left, the request's deadline, the retry budget)."""
        ...

    def claim(self, replica: Replica, streamed: bool) -> Claim:
        """The load one attempt puts on ``replica``, released when the attempt ends."""
        ...

    def finished(self) -> None:
        """The request is over: the slots it held may go to waiting requests."""
        ...

    def annotate(self, entry: dict[str, Any]) -> None:
        """Add what routing decided to the request's access-log entry."""
        ...


@dataclass(slots=True)
class Exchange:
    """What one request carries and learns on its way (for the stages, logs, metrics, limits).

    Filled in stage order: ``tenant`` by authentication, ``call`` by parsing (unset before:
    see ``parsed``), ``model`` and ``route`` by classification, ``lease`` by admission,
    ``plan`` and ``leader`` by the cache; the rest by the proxy.
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
    # The model whose pool serves it (``model``, or the base model of its ``adapter``): its
    # pending tokens count there.
    pool: str | None = None
    # The LoRA adapter the request names (routing.adapters): sent upstream as ``model``.
    adapter: str | None = None
    # Tokens counted in the model's pending gauge for this request (autoscaling).
    pending: int = 0
    lease: Lease | None = None
    # Tokens a cache hit charges (None: settle on the replica's usage).
    charged: int | None = None
    plan: CachePlan | None = None
    # This request goes upstream for a cache key others may wait on.
    leader: Leader | None = None
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
    # Keeps a stored Responses answer before the client sees its end (``gateway.responses_state``).
    keep: Keeper | None = None
    # Makes a Responses stream cancellable once its id is known (its first event), returning
    # what undoes that (``untrack``, run when the stream ends).
    on_start: Callable[[dict[str, Any], Callable[[], None]], Callable[[], None]] | None = None
    untrack: Callable[[], None] | None = None
    # Restores in the replica's answer what the gateway took out of the request (a Responses
    # answer's ``previous_response_id``), applied to whole events or the whole body.
    rewrite: Callable[[bytes], bytes] | None = None
    # Request headers the dialect passes on to the replica (``anthropic-version``...).
    forward: dict[str, str] | None = None
    # A stored Responses conversation's id: its first response's (its routing session).
    chain: str | None = None
    first_token_at: float | None = None
    upstream_started: float | None = None
    upstream_ended: float | None = None
    tried: set[str] = field(default_factory=set)
    # The client's stream, once prepared (keep-alives or the first event sent).
    response: web.StreamResponse | None = None
    # Set when the answer may be cached: its kind (the dialect's ``answers``, which folds it)
    # and, once the response ended well, the answer itself.
    cache_kind: Answers | None = None
    cache_max_chars: int = 0
    completion: CachedCompletion | None = None
    # Token events relayed (settles limits when a broken stream never reported usage).
    generated: int = 0
    # How the request is routed (tier, policy decisions, fallback; for the log line).
    route: Picker | None = None
    # No new attempt starts past this time (gateway clock); with ``cut_at_deadline`` (the
    # client asked for a deadline) an attempt in flight is cut there too.
    deadline: float | None = None
    cut_at_deadline: bool = False
    # Why attempts stopped early: "deadline" or "retry_budget".
    stop: str | None = None
    # Why a stream under way ended before its replica finished it (``gateway.proxy``, CUT_*;
    # "client_gone" when its client left): the access line's ``cut`` and fleetgate_stream_cuts_total.
    cut: str | None = None
    # W3C trace context, forwarded to the replica as its parent.
    trace: TraceContext | None = None
    # Stage and attempt times for OpenTelemetry spans (None: tracing off).
    timeline: Timeline | None = None

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
                return total
        if self.generated and self.parsed:
            return self.call.prompt_tokens_estimate + self.generated
        return None
