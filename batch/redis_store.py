"""Batches and their work queue in Redis: every gateway pod takes items, under leases.

Layout, all under one hash tag (one slot: the scripts touch several batches' keys, and run
unchanged on Redis Cluster)::

    fg:batch:{b}:rec:<id>      string: the batch record (JSON)
    fg:batch:{b}:tenant:<t>    sorted set: the tenant's batch ids by created_at (listing)
    fg:batch:{b}:active        sorted set: batches not yet ended, oldest first (claim order)
    fg:batch:{b}:q:<id>        hash: total, next (the next item never taken), open (1/0),
                               completed, failed, leased; input_tokens, output_tokens,
                               cached_tokens, reasoning_tokens (the usage of the items
                               answered; absent until an item adds to it)
    fg:batch:{b}:retry:<id>    list: items handed back (admission said later, or a lease expired)
    fg:batch:{b}:res:<id>      hash: item -> "1"/"0" (2xx or not) + its output line
    fg:batch:{b}:leases        sorted set: "<id>|<item>" -> lease expiry (ms, Redis TIME)
    fg:batch:{b}:owners        hash: "<id>|<item>" -> the token of the pod holding it
    fg:batch:{b}:lock:<id>     string: the pod finishing the batch (PX)

Exactly once: a result is written with ``HSETNX`` inside the script that counts it and adds
its tokens to the batch's usage, so an item run twice (its lease expired while a slow pod
still ran it) is still written, counted and its tokens added once; ``claim`` skips an item
handed back that has a result meanwhile. The lease clock is Redis's (``TIME``), so pods with
skewed clocks agree on when a lease expires.

Failure policy: each call is bounded by ``batch.redis_timeout_ms``, behind a breaker; a
failure raises ``BatchStoreUnavailable`` (a client gets a 503, the runner waits and tries again).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from batch.config import BatchSettings
from batch.model import TERMINAL, BatchRecord, Counts, Progress
from batch.store import BatchStoreUnavailable, Claim
from batch.usage import ZERO, Usage
from common.breaker import CircuitBreaker
from redisconn.config import RedisSecurity
from redisconn.factory import ClientOptions, RedisClient, connect
from redisconn.guard import Guard

log = logging.getLogger("fleetgate.batch")

DEFAULT_PREFIX = "fg:batch:{b}:"
# The queue hash's usage fields, in ``Usage``'s order (COMPLETE_SCRIPT names them too).
USAGE_FIELDS = ("input_tokens", "output_tokens", "cached_tokens", "reasoning_tokens")
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: active, leases, owners. ARGV: prefix, lease ms, token.
CLAIM_SCRIPT = (
    _NOW
    + """
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local q = ARGV[1] .. 'q:' .. id
  if redis.call('HGET', q, 'open') == '1' then
    local res = ARGV[1] .. 'res:' .. id
    local index = nil
    while true do
      local candidate = redis.call('LPOP', ARGV[1] .. 'retry:' .. id)
      if not candidate then break end
      if redis.call('HEXISTS', res, candidate) == 0 then
        index = candidate
        break
      end
    end
    if not index then
      local nxt = tonumber(redis.call('HGET', q, 'next'))
      if nxt < tonumber(redis.call('HGET', q, 'total')) then
        redis.call('HSET', q, 'next', string.format('%d', nxt + 1))
        index = string.format('%d', nxt)
      end
    end
    if index then
      local member = id .. '|' .. index
      redis.call('ZADD', KEYS[2], string.format('%.0f', now + tonumber(ARGV[2])), member)
      redis.call('HSET', KEYS[3], member, ARGV[3])
      redis.call('HINCRBY', q, 'leased', 1)
      return {id, index}
    end
  end
end
return false
"""
)

# KEYS: leases, owners. ARGV: token, lease ms, members...
RENEW_SCRIPT = (
    _NOW
    + """
local expiry = string.format('%.0f', now + tonumber(ARGV[2]))
for i = 3, #ARGV do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[1] then
    redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i])
  end
end
return 0
"""
)

# KEYS: leases, owners. ARGV: prefix, token, batch id, item, back in the queue (1/0).
_DROP = """
local function drop(member, q)
  redis.call('ZREM', KEYS[1], member)
  redis.call('HDEL', KEYS[2], member)
  if redis.call('EXISTS', q) == 1 then
    redis.call('HINCRBY', q, 'leased', -1)
  end
end
"""
RELEASE_SCRIPT = (
    _DROP
    + """
local member = ARGV[3] .. '|' .. ARGV[4]
if redis.call('HGET', KEYS[2], member) ~= ARGV[2] then
  return 0
end
local q = ARGV[1] .. 'q:' .. ARGV[3]
drop(member, q)
if redis.call('EXISTS', q) == 1 then
  redis.call('RPUSH', ARGV[1] .. 'retry:' .. ARGV[3], ARGV[4])
end
return 1
"""
)

# KEYS: leases, owners. ARGV: prefix, token, batch id, item, "1"/"0", line, then the item's
# input, output, cached and reasoning tokens.
COMPLETE_SCRIPT = (
    _DROP
    + """
local q = ARGV[1] .. 'q:' .. ARGV[3]
local res = ARGV[1] .. 'res:' .. ARGV[3]
local written = 0
if redis.call('EXISTS', q) == 1 and redis.call('HSETNX', res, ARGV[4], ARGV[5] .. ARGV[6]) == 1 then
  if ARGV[5] == '1' then
    redis.call('HINCRBY', q, 'completed', 1)
  else
    redis.call('HINCRBY', q, 'failed', 1)
  end
  for i, name in ipairs({'input_tokens', 'output_tokens', 'cached_tokens', 'reasoning_tokens'}) do
    local n = tonumber(ARGV[6 + i])
    if n and n ~= 0 then
      redis.call('HINCRBY', q, name, n)
    end
  end
  written = 1
end
local member = ARGV[3] .. '|' .. ARGV[4]
if redis.call('HGET', KEYS[2], member) == ARGV[2] then
  drop(member, q)
end
return written
"""
)

# KEYS: leases, owners. ARGV: prefix.
REAP_SCRIPT = (
    _NOW
    + _DROP
    + """
local n = 0
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now), 'LIMIT', 0, 1000)) do
  local sep = string.find(member, '|', 1, true)
  local id = string.sub(member, 1, sep - 1)
  local index = string.sub(member, sep + 1)
  local q = ARGV[1] .. 'q:' .. id
  drop(member, q)
  if redis.call('EXISTS', q) == 1 and redis.call('HEXISTS', ARGV[1] .. 'res:' .. id, index) == 0 then
    redis.call('RPUSH', ARGV[1] .. 'retry:' .. id, index)
  end
  n = n + 1
end
return n
"""
)

# KEYS: record. ARGV: expected status, new record.
REPLACE_SCRIPT = """
local raw = redis.call('GET', KEYS[1])
if not raw or cjson.decode(raw)['status'] ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""

# KEYS: the batch's queue hash.
CLOSE_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'open', '0')
end
return 0
"""

# KEYS: the lock. ARGV: token, ttl ms.
LOCK_SCRIPT = """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""


class RedisBatchStore:
    """``BatchStore`` in Redis (see the module's docstring for the layout)."""

    def __init__(
        self,
        client: RedisClient,
        *,
        timeout_s: float,
        prefix: str = DEFAULT_PREFIX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._timeout_s = timeout_s
        self._p = prefix
        self._guard = Guard(
            breaker=CircuitBreaker(),
            clock=clock,
            max_in_flight=64,
            unavailable=lambda message, reason: BatchStoreUnavailable(message),
            log=log,
            down_message="batch store unreachable; batches wait",
            up_message="batch store reachable again",
        )
        self._claim = client.register_script(CLAIM_SCRIPT)
        self._renew = client.register_script(RENEW_SCRIPT)
        self._release = client.register_script(RELEASE_SCRIPT)
        self._complete = client.register_script(COMPLETE_SCRIPT)
        self._reap = client.register_script(REAP_SCRIPT)
        self._replace = client.register_script(REPLACE_SCRIPT)
        self._close = client.register_script(CLOSE_SCRIPT)
        self._lock = client.register_script(LOCK_SCRIPT)

    @classmethod
    def from_url(cls, url: str, settings: BatchSettings, security: RedisSecurity | None = None) -> RedisBatchStore:
        timeout_s = settings.redis_timeout_ms / 1000
        options = ClientOptions(
            socket_timeout_s=timeout_s, connect_timeout_s=timeout_s, pool_timeout_s=timeout_s, connection_retries=1
        )
        return cls(connect(url, options, security), timeout_s=timeout_s)

    async def __aenter__(self) -> RedisBatchStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    async def _run(self, call: Callable[[], Awaitable[Any]]) -> Any:
        return await self._guard.run(call, self._timeout_s)

    def _rec(self, batch_id: str) -> str:
        return f"{self._p}rec:{batch_id}"

    def _tenant(self, tenant: str) -> str:
        return f"{self._p}tenant:{tenant.encode().hex()}"

    @property
    def _active(self) -> str:
        return f"{self._p}active"

    @property
    def _lease_keys(self) -> list[str]:
        return [f"{self._p}leases", f"{self._p}owners"]

    async def create(self, record: BatchRecord) -> None:
        async def call() -> None:
            pipe = self._client.pipeline(transaction=True)
            pipe.set(self._rec(record.id), record.to_bytes())
            pipe.zadd(self._tenant(record.tenant), {record.id: record.created_at})
            if record.status not in TERMINAL:
                queue: dict[Any, Any] = {"total": record.counts.total, "next": 0, "open": 1}
                queue.update(completed=0, failed=0, leased=0)
                pipe.hset(f"{self._p}q:{record.id}", mapping=queue)
                pipe.zadd(self._active, {record.id: time.time()})
            await pipe.execute()

        await self._run(call)

    async def get_any(self, batch_id: str) -> BatchRecord | None:
        raw = await self._run(lambda: self._client.get(self._rec(batch_id)))
        return BatchRecord.from_bytes(raw) if raw is not None else None

    async def get(self, tenant: str, batch_id: str) -> BatchRecord | None:
        record = await self.get_any(batch_id)
        return record if record is not None and record.tenant == tenant else None

    async def listing(self, tenant: str, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        key = self._tenant(tenant)
        start = 0
        if after is not None:
            rank = await self._run(lambda: self._client.zrevrank(key, after))
            if rank is None:
                return [], False
            start = rank + 1
        ids = await self._run(lambda: self._client.zrevrange(key, start, start + limit))
        records = []
        for raw_id in ids[:limit]:
            record = await self.get(tenant, raw_id.decode() if isinstance(raw_id, bytes) else raw_id)
            if record is not None:
                records.append(record)
        return records, len(ids) > limit

    async def replace(self, record: BatchRecord, expect_status: str) -> bool:
        keys, args = [self._rec(record.id)], [expect_status, record.to_bytes()]
        args_any: list[Any] = args
        return bool(await self._run(lambda: self._replace(keys=keys, args=args_any)))

    async def close(self, batch_id: str) -> None:
        await self._run(lambda: self._close(keys=[f"{self._p}q:{batch_id}"]))

    async def active(self) -> list[str]:
        ids = await self._run(lambda: self._client.zrange(self._active, 0, -1))
        return [i.decode() if isinstance(i, bytes) else i for i in ids]

    async def claim(self, token: str, lease_s: float) -> Claim | None:
        args: list[Any] = [self._p, round(lease_s * 1000), token]
        got = await self._run(lambda: self._claim(keys=[self._active, *self._lease_keys], args=args))
        if not got:
            return None
        batch_id, index = (v.decode() if isinstance(v, bytes) else v for v in got)
        return Claim(batch_id, int(index))

    async def renew(self, token: str, claims: list[Claim], lease_s: float) -> None:
        if claims:
            args: list[Any] = [token, round(lease_s * 1000), *(c.member for c in claims)]
            await self._run(lambda: self._renew(keys=self._lease_keys, args=args))

    async def release(self, token: str, claim: Claim) -> None:
        args: list[Any] = [self._p, token, claim.batch_id, claim.index]
        await self._run(lambda: self._release(keys=self._lease_keys, args=args))

    async def complete(self, token: str, claim: Claim, ok: bool, line: bytes, usage: Usage = ZERO) -> bool:
        tokens = (usage.input, usage.output, usage.cached, usage.reasoning)
        args: list[Any] = [self._p, token, claim.batch_id, claim.index, "1" if ok else "0", line, *tokens]
        return bool(await self._run(lambda: self._complete(keys=self._lease_keys, args=args)))

    async def reap(self) -> int:
        return int(await self._run(lambda: self._reap(keys=self._lease_keys, args=[self._p])))

    async def progress(self, batch_id: str) -> Progress:
        fields = ("total", "completed", "failed", "leased", *USAGE_FIELDS)
        values = await self._run(lambda: self._client.hmget(f"{self._p}q:{batch_id}", fields))
        if values[0] is None:
            record = await self.get_any(batch_id)
            if record is None:
                return Progress(Counts())
            return Progress(record.counts, 0, record.usage or ZERO)
        total, completed, failed, leased, *tokens = (int(v or 0) for v in values)
        return Progress(Counts(total, completed, failed), leased, Usage(*tokens))

    async def results(self, batch_id: str) -> tuple[dict[int, tuple[bool, bytes]], Usage]:
        async def call() -> tuple[dict[Any, Any], list[Any]]:
            pipe = self._client.pipeline(transaction=True)
            pipe.hgetall(f"{self._p}res:{batch_id}")
            pipe.hmget(f"{self._p}q:{batch_id}", USAGE_FIELDS)
            raw, tokens = await pipe.execute()
            return raw, tokens

        raw, tokens = await self._run(call)
        results = {int(k): (bytes(v[:1]) == b"1", bytes(v[1:])) for k, v in raw.items()}
        return results, Usage(*(int(v or 0) for v in tokens))

    async def lock(self, batch_id: str, token: str, ttl_s: float) -> bool:
        args: list[Any] = [token, round(ttl_s * 1000)]
        return bool(await self._run(lambda: self._lock(keys=[f"{self._p}lock:{batch_id}"], args=args)))

    async def forget(self, batch_id: str) -> None:
        async def call() -> None:
            pipe = self._client.pipeline(transaction=True)
            for kind in ("q", "retry", "res", "lock"):
                pipe.delete(f"{self._p}{kind}:{batch_id}")
            pipe.zrem(self._active, batch_id)
            await pipe.execute()

        await self._run(call)

    async def queue_depth(self) -> int:
        ids = await self.active()

        async def call() -> int:
            pipe = self._client.pipeline(transaction=False)
            for batch_id in ids:
                pipe.hmget(f"{self._p}q:{batch_id}", ("total", "next", "open"))
                pipe.llen(f"{self._p}retry:{batch_id}")
            replies = await pipe.execute()
            depth = 0
            for (total, nxt, is_open), retry in zip(replies[::2], replies[1::2], strict=True):
                if is_open in (b"1", "1"):
                    depth += int(total or 0) - int(nxt or 0) + int(retry)
            return depth

        return int(await self._run(call)) if ids else 0
