"""The semantic cache's entries in plain Redis (7.0, no vector search), shared by every process.

Layout: every key sits under one hash tag, so each script touches one slot (and runs on
Redis Cluster, where all semantic traffic then lands on one shard: the price of one
ordered change stream that every process tails; docs/configuration.md weighs it)::

    {fg:s}:e:<id>          hash    scope, text, vec (float16 bytes), key (the answer's exact
                                   key), exp (ms since the epoch, Redis TIME); PX = the TTL
    {fg:s}:lru:<tenant>    zset    id -> last use (µs, Redis TIME): the tenant's bound
    {fg:s}:log             stream  add / del events, XADD MAXLEN ~ stream_max_len
    {fg:s}:seq             string  number of events ever written (a counter)

Redis has no vector search here, so it is a store and a changelog, not an index: each
process searches its own ``SemanticIndex`` and keeps it in sync (``cache.semantic.sync``)
by a full load (SCAN of the hashes) at start, then by tailing the stream. Every write is
one script that changes the hashes *and* appends the events describing the change, each
with the next number of the counter; a reader that sees a number other than the one it
expects has missed events (trimmed away, or Redis restarted empty) and reloads.

An ``add`` event carries the whole entry, so tailing needs no read per event. Entries that
expire in Redis produce no event: each process drops them at their ``exp`` itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster

from cache.config import DEFAULT_STREAM_MAX_LEN
from cache.keys import split_key
from cache.redis_store import RedisStore
from cache.semantic.index import SemanticEntry, decode_vector, encode_vector
from cache.semantic.store import PutResult
from redisconn.factory import RedisClient

DEFAULT_TAG = "{fg:s}"
# Hashes fetched per SCAN page during a full load: big enough to amortise round trips,
# small enough that decoding one page never holds the event loop for long.
SCAN_PAGE = 500
ENTRY_FIELDS = ("scope", "text", "vec", "key", "exp")

# KEYS: entry hash, tenant LRU set, stream, counter.
# ARGV: id, scope, text, vector, answer key, ttl ms, max entries, stream max length, entry-key prefix.
PUT_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local stamp = t[1] .. string.format('%06d', tonumber(t[2]))
local ttl = tonumber(ARGV[6])
local exp = string.format('%.0f', math.floor(now / 1000) + ttl)
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'scope', ARGV[2], 'text', ARGV[3], 'vec', ARGV[4], 'key', ARGV[5], 'exp', exp)
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('ZADD', KEYS[2], stamp, ARGV[1])
-- Last used before now - ttl means stored before that too: the hash is gone already.
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. string.format('%.0f', now - ttl * 1000))
redis.call('PEXPIRE', KEYS[2], ttl)
local evicted = {}
local live = 0
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[7])
if excess > 0 then
  evicted = redis.call('ZRANGE', KEYS[2], 0, excess - 1)
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, excess - 1)
  for _, member in ipairs(evicted) do
    live = live + redis.call('DEL', ARGV[9] .. member)
    local n = redis.call('INCR', KEYS[4])
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[8], '*', 'op', 'del', 'seq', n, 'id', member)
  end
end
local seq = redis.call('INCR', KEYS[4])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[8], '*', 'op', 'add', 'seq', seq, 'id', ARGV[1],
  'scope', ARGV[2], 'text', ARGV[3], 'vec', ARGV[4], 'key', ARGV[5], 'exp', exp)
return {exp, seq, live, evicted}
"""

# KEYS: entry hash, tenant LRU set, stream, counter. ARGV: id, stream max length.
DELETE_SCRIPT = """
local removed = redis.call('DEL', KEYS[1]) + redis.call('ZREM', KEYS[2], ARGV[1])
if removed == 0 then
  return 0
end
local seq = redis.call('INCR', KEYS[4])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*', 'op', 'del', 'seq', seq, 'id', ARGV[1])
return seq
"""

# KEYS: tenant LRU set. ARGV: id.
TOUCH_SCRIPT = """
local t = redis.call('TIME')
return redis.call('ZADD', KEYS[1], 'XX', t[1] .. string.format('%06d', tonumber(t[2])), ARGV[1])
"""

# KEYS: stream, counter. Where the log stands: the last event's id and the counter, read
# together so that a load taken after them plus the events after them misses nothing.
POSITION_SCRIPT = """
local seq = redis.call('GET', KEYS[2]) or '0'
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local id = '0-0'
if last[1] then
  id = last[1][1]
end
return {id, seq}
"""


@dataclass(frozen=True, slots=True)
class SemanticKeys:
    """The Redis key names of the semantic cache, all under one hash tag."""

    tag: str = DEFAULT_TAG

    def entry(self, entry_id: str) -> str:
        return f"{self.tag}:e:{entry_id}"

    @property
    def entry_prefix(self) -> str:
        return f"{self.tag}:e:"

    def lru(self, tenant: str) -> str:
        return f"{self.tag}:lru:{tenant}"

    @property
    def stream(self) -> str:
        return f"{self.tag}:log"

    @property
    def counter(self) -> str:
        return f"{self.tag}:seq"


@dataclass(frozen=True, slots=True)
class Event:
    """One change read from the stream: ``add`` (with the entry) or ``del``."""

    stream_id: str
    seq: int
    op: str
    entry_id: str
    entry: SemanticEntry | None = None


class RedisSemanticStore:
    """Semantic entries in Redis, through the exact store's pool, timeouts and breaker."""

    def __init__(
        self,
        store: RedisStore,
        *,
        keys: SemanticKeys | None = None,
        stream_max_len: int = DEFAULT_STREAM_MAX_LEN,
    ) -> None:
        self._store = store
        self.keys = keys or SemanticKeys()
        self._max_len = stream_max_len
        client = store.client
        self._put = client.register_script(PUT_SCRIPT)
        self._delete = client.register_script(DELETE_SCRIPT)
        self._touch = client.register_script(TOUCH_SCRIPT)

    @property
    def available(self) -> bool:
        return not self._store.degraded

    def _keys_of(self, entry: SemanticEntry) -> list[str]:
        tenant = split_key(entry.scope)[0]
        k = self.keys
        return [k.entry(entry.id), k.lru(tenant), k.stream, k.counter]

    async def put(self, entry: SemanticEntry, *, ttl_s: float, max_entries: int) -> PutResult:
        ttl_ms = max(1, round(ttl_s * 1000))
        args: list[Any] = [
            entry.id,
            entry.scope,
            entry.text,
            encode_vector(entry.vector),
            entry.answer_key,
            ttl_ms,
            max_entries,
            self._max_len,
            self.keys.entry_prefix,
        ]
        keys = self._keys_of(entry)
        reply = await self._store.guarded(lambda: self._put(keys=keys, args=args), self._store.store_timeout_s)
        exp, seq, live, evicted = reply
        return PutResult(int(exp) / 1000, int(seq), tuple(_text(e) for e in evicted), int(live))

    async def delete(self, entry: SemanticEntry) -> None:
        keys, args = self._keys_of(entry), [entry.id, str(self._max_len)]
        await self._store.guarded(lambda: self._delete(keys=keys, args=args), self._store.store_timeout_s)

    async def touch(self, entry: SemanticEntry) -> None:
        keys = [self._keys_of(entry)[1]]
        await self._store.guarded(lambda: self._touch(keys=keys, args=[entry.id]), self._store.store_timeout_s)

    async def close(self) -> None:
        """Nothing of its own to release: the exact store owns the connections."""


class SemanticLog:
    """The reading side, for ``SemanticSync``: where the log stands, every entry, what changed.

    Runs on a connection of its own whose socket timeout allows for blocking reads (the
    request path's pool fails fast, in tens of milliseconds).
    """

    def __init__(self, client: RedisClient, dimension: int, *, keys: SemanticKeys | None = None) -> None:
        self._client = client
        self._dimension = dimension
        self.keys = keys or SemanticKeys()
        self._position = client.register_script(POSITION_SCRIPT)

    async def position(self) -> tuple[str, int]:
        """``(last stream id, counter)``; ``("0-0", 0)`` on an empty Redis."""
        stream_id, seq = await self._position(keys=[self.keys.stream, self.keys.counter])
        return _text(stream_id), int(seq)

    async def entries(self) -> AsyncIterator[list[SemanticEntry]]:
        """Every stored entry, a SCAN page at a time (a page may be empty; malformed ones skipped)."""
        cursor = 0
        match = self.keys.entry_prefix + "*"
        while True:
            cursor, names = await self._scan(cursor, match)
            if names:
                async with self._client.pipeline(transaction=False) as pipe:
                    for name in names:
                        pipe.hmget(name, ENTRY_FIELDS)
                    rows = await pipe.execute()
                prefix = len(self.keys.entry_prefix)
                page = [self._decode(_text(name)[prefix:], row) for name, row in zip(names, rows, strict=True)]
                yield [entry for entry in page if entry is not None]
            if cursor == 0:
                return

    async def _scan(self, cursor: int, match: str) -> tuple[int, list[Any]]:
        client = self._client
        if not isinstance(client, RedisCluster):
            found: tuple[int, list[Any]] = await client.scan(cursor, match=match, count=SCAN_PAGE)
            return found
        # SCAN walks one node. Every entry shares the tag's slot, so only that slot's primary
        # is asked; redis-py answers per node: ({node: cursor}, names).
        await client.initialize()
        node = client.get_node_from_key(self.keys.tag)
        reply: Any = await client.scan(cursor, match=match, count=SCAN_PAGE, target_nodes=node)
        cursors, names = reply
        return int(next(iter(cursors.values()), 0)), list(names)

    async def read(self, after: str, *, count: int, block_ms: int) -> list[Event]:
        """Events after stream id ``after``, waiting at most ``block_ms`` for the first."""
        reply: Any = await self._client.xread({self.keys.stream: after}, count=count, block=block_ms)
        events: list[Event] = []
        for _, items in reply or []:
            for stream_id, fields in items:
                events.append(self._event(_text(stream_id), fields))
        return events

    async def close(self) -> None:
        """Close the connection (the log owns its client)."""
        await self._client.aclose()

    async def counter(self) -> int:
        """Events ever written (0 after Redis lost its data)."""
        return int(await self._client.get(self.keys.counter) or 0)

    def _event(self, stream_id: str, fields: dict[bytes, bytes]) -> Event:
        op = _text(fields.get(b"op", b""))
        entry_id = _text(fields.get(b"id", b""))
        seq = int(fields.get(b"seq", b"0"))
        entry = None
        if op == "add":
            row = [fields.get(name.encode()) for name in ENTRY_FIELDS]
            entry = self._decode(entry_id, row)
            if entry is None:
                op = "del"  # an add we cannot read is safest as a removal
        return Event(stream_id, seq, op, entry_id, entry)

    def _decode(self, entry_id: str, row: list[Any]) -> SemanticEntry | None:
        scope, text, vec, key, exp = row
        if scope is None or text is None or vec is None or key is None or exp is None:
            return None  # expired between SCAN and HMGET, or not an entry
        try:
            vector = decode_vector(bytes(vec), self._dimension)
            return SemanticEntry(entry_id, _text(scope), _text(text), vector, _text(key), int(exp) / 1000)
        except (ValueError, UnicodeDecodeError):
            return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
