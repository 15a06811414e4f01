"""Pick the response store ``redis_url`` asks for: Redis when it is set, else memory."""

from __future__ import annotations

import time
from collections.abc import Callable

from conversations.config import ResponsesSettings
from conversations.memory_store import MemoryResponseStore
from conversations.redis_store import RedisResponseStore
from conversations.store import ResponseStore
from redisconn.config import RedisSecurity


def create_response_store(
    redis_url: str | None,
    settings: ResponsesSettings | None = None,
    security: RedisSecurity | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> ResponseStore:
    """The Redis store when ``redis_url`` is set (shared by all gateway pods), else memory.

    ``clock`` drives the memory store's expiry, or the Redis store's breaker (records in
    Redis expire on Redis's own clock).
    """
    settings = settings or ResponsesSettings()
    if redis_url is None:
        return MemoryResponseStore(clock)
    return RedisResponseStore.from_url(redis_url, settings, clock=clock, security=security)
