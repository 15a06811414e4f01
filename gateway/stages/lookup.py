"""The ``look_up_cache`` stage: a stored answer replayed, or the answer collected for the
cache (and for the identical requests waiting on this one) on its way to the client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import orjson
from aiohttp import web

from cache.coalesce import Leader, Wake
from cache.keys import CachePlan
from cache.service import CacheHit, ResponseCache
from dialects.answer import Answers, CachedCompletion, StreamCollector
from gateway.client_stream import end_with_error, prepare, with_keepalive
from gateway.exchange import CACHE_HEADER, Exchange, Tap
from gateway.settings import TenantSettings, UpstreamSettings
from gateway.stages import CONTINUE, Reply


class LookUpCache:
    """A stored answer (exact, then semantic) replayed; else, for a cacheable request, the
    answer collected on its way out and, once it ended well, stored and handed to the
    requests that waited on it.

    A request identical to one in flight waits for that one's answer (a streaming client
    gets keep-alives meanwhile) instead of going upstream itself; the request that goes
    upstream leads the flight (``cache.coalesce.Leader``) until its path ends.
    """

    name = "look_up_cache"

    def __init__(self, cache: ResponseCache, upstream: UpstreamSettings, clock: Callable[[], float]) -> None:
        self.cache = cache
        # How long a follower waits on its leader (a first byte's time), and how often a
        # streaming follower is sent a keep-alive meanwhile.
        self.wait_s = upstream.first_byte_timeout_s
        self.keepalive_s = upstream.keepalive_interval_s
        self.clock = clock

    async def __call__(self, ex: Exchange, request: web.Request) -> Reply:
        call, tenant, model = ex.call, ex.tenant, ex.model
        assert tenant is not None and model is not None
        cache = self.cache
        cache_control = request.headers.get("Cache-Control")
        plan = cache.plan(tenant.id, model, ex.dialect, call.body, tenant.cache, cache_control)
        hit: CacheHit | None = None
        leader: Leader | None = None
        if plan.key is not None:
            hit = await cache.find(plan)
            if hit is None and plan.coalesce:
                joining = cache.coalesce(plan.key, self.wait_s)
                if call.stream:
                    joined = await with_keepalive(ex, request, joining, self.keepalive_s, discard=_end_flight)
                else:  # keep-alives are SSE comments: a JSON client just waits
                    joined = await joining
                if isinstance(joined, CachedCompletion):
                    hit = CacheHit("exact", joined)
                else:
                    leader = joined
        if ex.timeline is not None:
            ex.timeline.mark("cache", self.clock())
        if hit is not None:
            response = await self._replay(ex, request, hit)
            ex.charged = ResponseCache.tokens_to_charge(hit.completion, tenant.cache)
            return response
        answers = call.dialect.answers
        if plan.key is not None and answers is not None:
            # Characters never outnumber UTF-8 bytes: a bound on them is a safe, cheap bound on the entry.
            collect = _Collect(answers.collector(tenant.cache.max_entry_bytes), answers)
            ex.taps = (*ex.taps, collect)
            ex.release(_Outcome(cache, ex, plan, tenant, collect, leader))
        elif leader is not None:
            ex.release(leader_released(leader))
        return CONTINUE

    async def _replay(self, ex: Exchange, request: web.Request, hit: CacheHit) -> Reply:
        """Answer from the cache, in the shape the client asked for.

        The exchange's taps see the replayed answer before the client does (a Responses
        answer the client asked to store is kept under the replay's fresh id: a
        ``previous_response_id`` naming it works at once); a tap's refusal answers instead.
        """
        ex.headers[CACHE_HEADER] = hit.kind
        cached, call = hit.completion, ex.call
        answers = call.dialect.answers
        assert answers is not None  # a hit has a key: the dialect's answers are cached
        ex.usage = cached.usage
        ex.status = 200
        ex.first_token_at = self.clock()
        completion_id, created = answers.new_id(), int(time.time())
        answer = answers.replay_object(cached, completion_id=completion_id, created=created, request=call.body)
        for tap in ex.taps:
            refused = await tap.ending(answer)
            if refused is not None:
                if ex.response is None:
                    return refused
                await end_with_error(ex, ex.response, refused)  # keep-alives went out
                return ex.response
        if not call.stream:
            return web.Response(body=orjson.dumps(answer), content_type="application/json", headers=ex.headers)
        events = answers.replay_sse(
            cached,
            completion_id=completion_id,
            created=created,
            include_usage=call.client_wants_usage,
            request=call.body,
        )
        response = ex.response or await prepare(ex, request)
        await response.write(events)
        await response.write_eof()
        return response


class _Collect(Tap):
    """The answer as the cache keeps it, collected on its way to the client."""

    __slots__ = ("_answers", "_body", "_collector")

    def __init__(self, collector: StreamCollector, answers: Answers) -> None:
        self._collector = collector
        self._answers = answers
        self._body: bytes | None = None

    def events(self, out: bytes) -> bytes:
        self._collector.feed(out)
        return out

    def body(self, body: bytes) -> bytes:
        self._body = body
        return body

    def result(self, ex: Exchange) -> CachedCompletion | None:
        """The whole answer once it ended well and is the one the cache key names: not a
        fallback model's, nor a degraded request's; None otherwise."""
        route, replica = ex.route, ex.replica
        if ex.status != 200 or ex.error_code is not None or route is None or replica is None:
            return None
        if route.degraded is not None or replica.model != route.model:
            return None
        if self._body is not None:
            return self._answers.from_json(self._body)
        return self._collector.result(ex.usage, ex.answer)


class _Outcome:
    """When the path ends: a good answer stored and handed to the flight's followers; else
    the flight ended (a handoff when the leader's client left, so a follower leads anew)."""

    __slots__ = ("_cache", "_collect", "_ex", "_leader", "_plan", "_tenant")

    def __init__(
        self,
        cache: ResponseCache,
        ex: Exchange,
        plan: CachePlan,
        tenant: TenantSettings,
        collect: _Collect,
        leader: Leader | None,
    ) -> None:
        self._cache = cache
        self._ex = ex
        self._plan = plan
        self._tenant = tenant
        self._collect = collect
        self._leader = leader

    def __call__(self, exc: BaseException | None) -> None:
        completion = self._collect.result(self._ex) if exc is None else None
        plan, leader = self._plan, self._leader
        if completion is not None:
            if leader is not None:
                leader.publish(completion)
            if plan.store and plan.key is not None:
                self._cache.store_later(plan.key, completion, self._tenant.cache, plan.semantic)
        if leader is not None:
            leader_released(leader)(exc)


def leader_released(leader: Leader) -> Callable[[BaseException | None], None]:
    """What ends ``leader``'s flight when the path ends unpublished: a handoff when its
    client left (cancelled), else solo (``cache.coalesce``); nothing once published."""

    def release(exc: BaseException | None) -> None:
        leader.abandon(Wake.HANDOFF if isinstance(exc, asyncio.CancelledError) else Wake.SOLO)

    return release


def _end_flight(joined: Leader | CachedCompletion) -> None:
    """A flight led by a request that left before it could go upstream: end it."""
    if isinstance(joined, Leader):
        joined.abandon()
