"""The request path as a declared list of stages, run in order by ``Gateway.handle``.

    authenticate   API key -> tenant                                  401
    parse          read the body, validate it -> Call                 400 / 408 / 413
    recall         (Responses) previous_response_id expanded into     404 / 503
                   the whole input; the answer kept, the stream
                   cancellable (``gateway.responses_state``)
    classify       model ("auto" -> a tier's model; its text embedded 400 / 404
                   first when the embedding head scores it), context
                   length, the request's priority band and its Route
    admit          rate limits, concurrency, token quotas             429 (503: limit store down)
    look_up_cache  exact then semantic answer, or the same request    hit: replayed here
                   in flight; on a miss the answer is collected,
                   published and stored (only when some tenant uses the cache)
    load_adapter   a LoRA adapter no replica serves loaded on one     (only when adapters load)
    queue          deadline; a slot in the model's pool: degrade,     400 / 429 / 503 / 504
                   then wait fairly when every replica is full
    forward        the proxy: attempts, retries, fallback, relay      the replica's answer

Classification runs before admission: an unknown model needs no admission, and the model
that answers is part of the cache key. So the embedding an ``auto`` request's semantic
lookup needs is computed there, for the classifier, and the lookup finds it in the
semantic cache's memo. After the path, ``gateway.accounting`` counts and logs the request,
however it ended.

Each stage is an object with a ``name``, called with the request's ``Exchange``; it returns
``CONTINUE`` (None) or a local reply: a response (a cache hit, the proxy's answer), or a
``GatewayError`` that carries the refusal's reason, as an Envoy filter stops its chain with
a local reply. What a stage takes (a lease, a pool's slot, a coalescing flight) it hands
back itself, through ``Exchange.release``: the releases run in reverse order when the path
ends, however it ends. What a stage must see of the answer on its way out, it sees through
a ``Tap`` it installs on the exchange. ``gateway.build`` builds the stages, each from its own
parts, and the path of each API; again on a reload of tenants.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol, TypeAlias

from aiohttp import web

from gateway.errors import GatewayError
from gateway.exchange import Exchange

# What a stage returns: CONTINUE, or the local reply that ends the request's path here.
Reply: TypeAlias = web.StreamResponse | GatewayError | None
CONTINUE = None


class Stage(Protocol):
    """One step of the request path."""

    # The stage's name (the list above; tests and the docs read it).
    name: str

    def __call__(self, ex: Exchange, request: web.Request) -> Awaitable[Reply]: ...
