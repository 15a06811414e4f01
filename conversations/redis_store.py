"""Stored responses in Redis, shared by every gateway pod and kept across gateway restarts.

Layout: each tenant owns keys under one hash tag, so every call touches a single slot and
runs unchanged on Redis Cluster::

    fg:resp:{<tenant>}:r:<id>   string: the record's bytes, with PX = its TTL
    fg:resp:{<tenant>}:exp      sorted set: id -> expiry (ms since the epoch, Redis TIME)
    fg:resp:{<tenant>}:age      sorted set: id -> insertion number (the eviction order)
    fg:resp:{<tenant>}:size     hash: id -> the record's size in bytes
    fg:resp:{<tenant>}:meta     hash: ``bytes`` (the sizes summed), ``seq`` (the last insertion number)

``put`` is one script, so two pods storing for one tenant at once still keep its bound:
drop the records whose expiry has passed from the index (PX already took their values),
take out a record stored again under the same id, evict the oldest (by insertion number,
not by clock, so pods with skewed clocks agree) until the new record fits, store it with
its TTL, then let the index keys expire with the longest-lived record. ``get`` is one
``GET`` (the tenant is in the key: another tenant's id is simply not there); ``delete`` is
one script that removes the value and its index entries together. The scripts read
Redis's clock (``TIME``), the same clock PX counts on.

The bound counts records' bytes, not Redis's overhead (a few hundred bytes per record
across the five keys). Run Redis with ``maxmemory-policy noeviction`` (or size it): a key
Redis evicts on its own leaves the index counting bytes that are gone, until that entry
expires or is evicted in turn.

Failure policy: every call is bounded by ``timeout_s`` (connecting, waiting for a pooled
connection and the reply alike) and any failure is raised as ``StoreUnavailableError``. A
circuit breaker opens after ``breaker_failures`` consecutive failures: while it is open,
calls fail at once without touching the network, so a dead Redis costs no waiting; after
the cool-down one trial call tests it again (``common.breaker``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, NamedTuple

from common.breaker import BreakerConfig, CircuitBreaker
from conversations.config import ResponsesSettings
from conversations.store import StoreUnavailableError, check_put
from redisconn.config import RedisSecurity
from redisconn.factory import ClientOptions, RedisClient, connect
from redisconn.guard import Guard

log = logging.getLogger("fleetgate.conversations")

DEFAULT_PREFIX = "fg:resp"
DEFAULT_MAX_CONNECTIONS = 64

# The characters that would end the hash tag or split the key: percent-escaped, so two
# tenants never share keys and a tenant id never moves its keys out of its own slot.
_TENANT_ESCAPES = str.maketrans({"%": "%25", ":": "%3A", "{": "%7B", "}": "%7D"})

# Numbers go to Redis through string.format('%.0f'): Lua would print them in %.14g.

# KEYS: record, expiry set, age set, sizes hash, meta hash.
# ARGV: record, ttl ms, tenant bound (bytes), response id, record-key prefix.
PUT_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local bound = tonumber(ARGV[3])
local id = ARGV[4]
local size = string.len(ARGV[1])

-- Take one record out of the index and out of Redis; returns its size.
local function forget(member)
  local bytes = tonumber(redis.call('HGET', KEYS[4], member) or 0)
  redis.call('HDEL', KEYS[4], member)
  redis.call('ZREM', KEYS[2], member)
  redis.call('ZREM', KEYS[3], member)
  redis.call('DEL', ARGV[5] .. member)
  return bytes
end

local used = tonumber(redis.call('HGET', KEYS[5], 'bytes') or 0)
-- 1. Past their expiry: out of the index (PX took their values already).
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', string.format('%.0f', now))) do
  used = used - forget(member)
end
-- 2. Stored again under its id: the old record goes, the new one will be the newest.
used = used - forget(id)
-- 3. The oldest go until the new one fits (the caller checked that it fits alone).
local evicted = 0
while used + size > bound do
  local oldest = redis.call('ZRANGE', KEYS[3], 0, 0)
  if #oldest == 0 then
    used = 0  -- nothing left to count: whatever the total said had drifted
    break
  end
  used = used - forget(oldest[1])
  evicted = evicted + 1
end
-- 4. Store it.
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('ZADD', KEYS[2], string.format('%.0f', now + ttl), id)
redis.call('ZADD', KEYS[3], string.format('%.0f', redis.call('HINCRBY', KEYS[5], 'seq', 1)), id)
redis.call('HSET', KEYS[4], id, size)
redis.call('HSET', KEYS[5], 'bytes', string.format('%.0f', used + size))
-- 5. The index lives as long as its longest-lived record, so an idle tenant leaves nothing.
local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')[2]
for i = 2, 5 do
  redis.call('PEXPIREAT', KEYS[i], last)
end
return evicted
"""

# KEYS: record, expiry set, age set, sizes hash, meta hash. ARGV: response id.
DELETE_SCRIPT = """
local live = redis.call('DEL', KEYS[1])
local bytes = redis.call('HGET', KEYS[4], ARGV[1])
if bytes then
  redis.call('HDEL', KEYS[4], ARGV[1])
  redis.call('HINCRBY', KEYS[5], 'bytes', -tonumber(bytes))
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('ZCARD', KEYS[3]) == 0 then
  redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
end
return live
"""


def escape_tenant(tenant: str) -> str:
    """The tenant as it appears in keys: no ``:``, ``{`` or ``}`` (percent-escaped)."""
    if not tenant:
        # An empty hash tag ``{}`` hashes the whole key name: the tenant's keys would land
        # on different cluster slots.
        raise ValueError("tenant must not be empty")
    return tenant.translate(_TENANT_ESCAPES)


class TenantKeys(NamedTuple):
    """One tenant's keys, all under its hash tag."""

    record_prefix: str
    expiry: str
    age: str
    size: str
    meta: str

    def record(self, response_id: str) -> str:
        return self.record_prefix + response_id

    def script_keys(self, response_id: str) -> list[str]:
        """The KEYS of both scripts, in their order."""
        return [self.record(response_id), self.expiry, self.age, self.size, self.meta]


class RedisResponseStore:
    """Stored responses in Redis, bounded per tenant, behind a deadline and a circuit breaker."""

    def __init__(
        self,
        client: RedisClient,
        *,
        timeout_s: float,
        breaker: CircuitBreaker | None = None,
        prefix: str = DEFAULT_PREFIX,
        clock: Callable[[], float] = time.monotonic,
        owns_client: bool = True,
        max_in_flight: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self._client = client
        self._timeout_s = timeout_s
        self.breaker = breaker or CircuitBreaker()
        self._guard = Guard(
            breaker=self.breaker,
            clock=clock,
            max_in_flight=max_in_flight,
            unavailable=lambda message, reason: StoreUnavailableError(message, reason=reason),
            log=log,
            down_message="response store unreachable; stored responses are unavailable",
            up_message="response store reachable again",
        )
        self._prefix = prefix
        self._owns_client = owns_client
        self._put = client.register_script(PUT_SCRIPT)
        self._delete = client.register_script(DELETE_SCRIPT)
        self._closed = False

    @classmethod
    def from_url(
        cls,
        url: str,
        settings: ResponsesSettings,
        *,
        prefix: str = DEFAULT_PREFIX,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        clock: Callable[[], float] = time.monotonic,
        security: RedisSecurity | None = None,
    ) -> RedisResponseStore:
        """A store with its own connections (any scheme of ``redisconn``), tuned to fail fast."""
        timeout_s = settings.redis_timeout_s
        options = ClientOptions(
            socket_timeout_s=timeout_s,
            connect_timeout_s=timeout_s,
            max_connections=max_connections,
            # Waiting for a free connection counts against the same deadline.
            pool_timeout_s=timeout_s,
            # One immediate reconnect on a broken connection, so the pooled connections a
            # Redis restart or a failover left stale do not fail requests. Safe: a put
            # replayed stores the same record again. No retry on timeouts: the breaker
            # decides when to try a slow Redis again.
            connection_retries=1,
        )
        breaker = CircuitBreaker(
            BreakerConfig(failures=settings.breaker_failures, cooldown_s=settings.breaker_cooldown_s)
        )
        return cls(
            connect(url, options, security),
            timeout_s=timeout_s,
            breaker=breaker,
            prefix=prefix,
            clock=clock,
            max_in_flight=max_connections,
        )

    def keys(self, tenant: str) -> TenantKeys:
        """The tenant's keys, sharing one hash tag."""
        base = f"{self._prefix}:{{{escape_tenant(tenant)}}}"
        return TenantKeys(f"{base}:r:", f"{base}:exp", f"{base}:age", f"{base}:size", f"{base}:meta")

    @property
    def degraded(self) -> bool:
        """True while the breaker keeps calls away from Redis (open or probing)."""
        return self.breaker.degraded

    async def put(self, tenant: str, response_id: str, record: bytes, ttl_s: float, max_tenant_bytes: int) -> None:
        check_put(record, ttl_s, max_tenant_bytes)
        keys = self.keys(tenant)
        ttl_ms = max(1, round(ttl_s * 1000))
        args: list[Any] = [record, ttl_ms, max_tenant_bytes, response_id, keys.record_prefix]
        await self._guarded(lambda: self._put(keys=keys.script_keys(response_id), args=args))

    async def get(self, tenant: str, response_id: str) -> bytes | None:
        key = self.keys(tenant).record(response_id)
        value = await self._guarded(lambda: self._client.get(key))
        return bytes(value) if value is not None else None

    async def delete(self, tenant: str, response_id: str) -> bool:
        keys = self.keys(tenant)
        removed = await self._guarded(lambda: self._delete(keys=keys.script_keys(response_id), args=[response_id]))
        return bool(removed)

    async def _guarded(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``call`` within the deadline behind the breaker; failures raise ``StoreUnavailableError``."""
        if self._closed:
            raise RuntimeError("RedisResponseStore is closed")
        return await self._guard.run(call, self._timeout_s)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> RedisResponseStore:
        if self._closed:
            raise RuntimeError("RedisResponseStore is closed")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
