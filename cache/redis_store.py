"""The response cache in Redis, shared by every gateway process and kept across restarts.

Layout: each scope (tenant) owns keys under one hash tag, so every script touches a single
slot and runs unchanged on Redis Cluster::

    fg:c:{<scope>}:e:<digest>   string: a CachedCompletion's bytes, with PX = the tenant's TTL
    fg:c:{<scope>}:lru          sorted set: digest -> last use (µs since the epoch, Redis TIME)

``set`` is one script: store the value with its TTL, stamp it in the LRU set, drop members
whose values must have expired (last use older than the TTL), then evict the least recently
used past ``max_entries`` and return how many live entries that removed. ``get`` is one
script too: read the value and, on a hit, refresh its LRU stamp (not its TTL: an entry
expires a fixed time after it was stored, however popular it is).

Failure policy: every call is bounded (``lookup_timeout_s`` for ``get``, which sits on the
request path; ``store_timeout_s`` for ``set``, which does not), and any failure is raised
as ``CacheUnavailable``. A circuit breaker opens after ``breaker_failures`` consecutive
failures: while it is open, calls fail at once without touching the network, so a dead
Redis costs a request nothing; after the cool-down one trial call tests it again (``common.breaker``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from cache.config import CacheServiceSettings
from cache.keys import split_key
from cache.store import CacheUnavailable
from common.breaker import BreakerConfig, CircuitBreaker
from redisconn.config import RedisSecurity
from redisconn.factory import ClientOptions, RedisClient, connect
from redisconn.guard import Guard

log = logging.getLogger("fleetgate.cache")

DEFAULT_PREFIX = "fg:c"
DEFAULT_MAX_CONNECTIONS = 64

# Scores are written as digit strings: Lua would print a 16-digit number in %.14g and lose
# the microseconds that order entries used within the same millisecond.

# KEYS: value key, LRU set. ARGV: member (digest).
GET_SCRIPT = """
local value = redis.call('GET', KEYS[1])
if value then
  local t = redis.call('TIME')
  redis.call('ZADD', KEYS[2], 'XX', t[1] .. string.format('%06d', tonumber(t[2])), ARGV[1])
end
return value
"""

# KEYS: value key, LRU set. ARGV: value, ttl ms, max entries, member (digest), value-key prefix.
SET_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl = tonumber(ARGV[2])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('ZADD', KEYS[2], t[1] .. string.format('%06d', tonumber(t[2])), ARGV[4])
-- Last used before now - ttl means stored before that too: the value is gone already.
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. string.format('%.0f', now - ttl * 1000))
redis.call('PEXPIRE', KEYS[2], ttl)
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
local evicted = 0
if excess > 0 then
  for _, member in ipairs(redis.call('ZRANGE', KEYS[2], 0, excess - 1)) do
    evicted = evicted + redis.call('DEL', ARGV[5] .. member)
  end
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, excess - 1)
end
return evicted
"""


class RedisStore:
    """Cached answers in Redis, bounded per scope, behind timeouts and a circuit breaker."""

    def __init__(
        self,
        client: RedisClient,
        *,
        lookup_timeout_s: float,
        store_timeout_s: float,
        breaker: CircuitBreaker | None = None,
        prefix: str = DEFAULT_PREFIX,
        clock: Callable[[], float] = time.monotonic,
        owns_client: bool = True,
        max_in_flight: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self._client = client
        self._lookup_timeout_s = lookup_timeout_s
        self._store_timeout_s = store_timeout_s
        self.breaker = breaker or CircuitBreaker()
        self._guard = Guard(
            breaker=self.breaker,
            clock=clock,
            max_in_flight=max_in_flight,
            unavailable=lambda message, reason: CacheUnavailable(message, reason=reason),
            log=log,
            down_message="cache store unreachable; requests go on uncached",
            up_message="cache store reachable again",
        )
        self._prefix = prefix
        self._owns_client = owns_client
        self._get = client.register_script(GET_SCRIPT)
        self._set = client.register_script(SET_SCRIPT)
        self._closed = False

    @classmethod
    def from_url(
        cls,
        url: str,
        settings: CacheServiceSettings,
        *,
        prefix: str = DEFAULT_PREFIX,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        clock: Callable[[], float] = time.monotonic,
        security: RedisSecurity | None = None,
    ) -> RedisStore:
        """A store with its own connections (any scheme of ``redisconn``), tuned to fail fast."""
        options = ClientOptions(
            socket_timeout_s=max(settings.lookup_timeout_s, settings.store_timeout_s),
            connect_timeout_s=settings.lookup_timeout_s,
            max_connections=max_connections,
            # Waiting for a free connection counts against the lookup's deadline.
            pool_timeout_s=settings.lookup_timeout_s,
            # No client-side retries: the breaker decides when Redis is tried again; a retry
            # loop would multiply every request's latency while Redis is down.
            connection_retries=0,
        )
        breaker = CircuitBreaker(
            BreakerConfig(failures=settings.breaker_failures, cooldown_s=settings.breaker_cooldown_s)
        )
        return cls(
            connect(url, options, security),
            lookup_timeout_s=settings.lookup_timeout_s,
            store_timeout_s=settings.store_timeout_s,
            breaker=breaker,
            prefix=prefix,
            clock=clock,
            max_in_flight=max_connections,
        )

    def redis_keys(self, key: str) -> tuple[str, str, str]:
        """``(value key, LRU set, value-key prefix)`` of a cache key, under the scope's hash tag."""
        scope, digest = split_key(key)
        base = f"{self._prefix}:{{{scope}}}"
        return f"{base}:e:{digest}", f"{base}:lru", f"{base}:e:"

    @property
    def degraded(self) -> bool:
        """True while the breaker keeps calls away from Redis (open or probing)."""
        return self.breaker.degraded

    async def get(self, key: str) -> bytes | None:
        value_key, lru, _ = self.redis_keys(key)
        _, digest = split_key(key)
        value = await self.guarded(lambda: self._get(keys=[value_key, lru], args=[digest]), self._lookup_timeout_s)
        return bytes(value) if value is not None else None

    async def set(self, key: str, value: bytes, *, ttl_s: float, max_entries: int) -> int:
        value_key, lru, value_prefix = self.redis_keys(key)
        _, digest = split_key(key)
        ttl_ms = max(1, round(ttl_s * 1000))
        args: list[Any] = [value, ttl_ms, max_entries, digest, value_prefix]
        evicted = await self.guarded(lambda: self._set(keys=[value_key, lru], args=args), self._store_timeout_s)
        return int(evicted)

    @property
    def client(self) -> RedisClient:
        """The shared client (the semantic cache's store runs its scripts on the same pool)."""
        return self._client

    @property
    def lookup_timeout_s(self) -> float:
        return self._lookup_timeout_s

    @property
    def store_timeout_s(self) -> float:
        return self._store_timeout_s

    async def guarded(self, call: Callable[[], Awaitable[Any]], timeout_s: float) -> Any:
        """Run ``call`` within ``timeout_s`` behind the breaker; failures raise ``CacheUnavailable``."""
        if self._closed:
            raise RuntimeError("RedisStore is closed")
        return await self._guard.run(call, timeout_s)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            await self._client.aclose()
