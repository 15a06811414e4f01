"""What each replica's prefix cache holds, exactly, from its KV-cache events.

Why the gateway keeps its own hash chain rather than the engine's hashes: a ``BlockStored``
event carries each block's token ids and the hash of the block before it, so the gateway
maps each engine hash to a hash of its own over the same chain of token ids
(``chain_hashes``), and a request's blocks are hashed the same way from its prompt's token
ids. The engine's hash function, its seed (``PYTHONHASHSEED``, random per process for
xxhash) and its serialisation (pickle or CBOR) then never need to agree with the gateway's:
a replica launched by someone else, with any ``--prefix-caching-hash-algo``, is read
exactly, and a vLLM release that changes how it hashes changes nothing here. What must
agree is what the engine hashed besides the tokens: the block size (carried by every
``BlockStored``), the LoRA adapter (its name, in the event and in the request) and extra
keys (images, a cache salt): blocks stored with extra keys are not indexed, since no
request the gateway hashes can match them.

Per replica (``ReplicaBlocks``): engine hash -> own hash, least recently stored or matched
first, bounded (``max_blocks``: the oldest go when over, as the engine evicts its least
recently used); the batches' sequence numbers, checked for gaps. A gap or an engine
restart (the sequence going back) clears the replica, which is then *not exact* until a
replay from sequence 0 rebuilds it (``routing.kv_subscriber``), or until a clear of the
whole cache (``AllBlocksCleared``: vLLM's ``/reset_prefix_cache``) is seen with no gap
after it; while not exact, routing reads the estimate for it (``exact`` False). Pure and
synchronous: time is passed in.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from replicas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, EventBatch

# Blocks remembered per replica: 16 bytes of key and value plus dict overhead, ~150 bytes a
# block, so 262,144 blocks (4M tokens at 16 a block, more than a replica's KV cache on most
# accelerators) hold about 40 MB.
DEFAULT_MAX_BLOCKS = 262144
# The cache tiers a prefix is reused from at once (vLLM's main KV cache reports "GPU" on
# every backend; "CPU" and "STORAGE" are offloading tiers that need a transfer first).
_RESIDENT_MEDIA = (None, "GPU")
# The chain's root: a request's first block hashes from this (and its LoRA adapter).
_ROOT = b"fleetgate-kv-chain"


def chain_hashes(token_ids: Sequence[int], block_size: int, lora_name: str | None = None) -> list[int]:
    """Own hashes of ``token_ids``' full blocks, each covering every block before it."""
    return [int.from_bytes(d[:8], "little") for d in _chain_from(_root(lora_name), token_ids, block_size)]


def _root(lora_name: str | None) -> bytes:
    return hashlib.blake2b(_ROOT + (lora_name or "").encode(), digest_size=16).digest()


def _chain_from(parent: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chain's 16-byte states after each full block of ``token_ids``, from ``parent``."""
    tokens = array("q", token_ids).tobytes()
    width = 8 * block_size
    digests: list[bytes] = []
    for start in range(0, len(tokens) - width + 1, width):
        parent = hashlib.blake2b(parent + tokens[start : start + width], digest_size=16).digest()
        digests.append(parent)
    return digests


class Sync(Enum):
    """How a batch's sequence number relates to the last one applied."""

    NEXT = "next"  # the one expected: applied
    GAP = "gap"  # one or more batches missing: cleared, a replay from 0 is needed
    RESTART = "restart"  # the sequence went back: the engine restarted, cleared
    STALE = "stale"  # already applied (a replay overlapping the stream): ignored


@dataclass(slots=True)
class ReplicaStats:
    batches: int = 0
    gaps: int = 0
    restarts: int = 0
    resyncs: int = 0
    unlinked: int = 0  # stored blocks whose parent the index did not hold: not indexed
    evicted: int = 0  # dropped for the memory bound


class ReplicaBlocks:
    """One replica's cached blocks as its events tell them."""

    __slots__ = ("_digests", "_own", "block_size", "exact", "last_seq", "max_blocks", "stats", "updated")

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        # engine hash -> own digest (16 bytes, the chain's state), LRU first.
        self._digests: OrderedDict[EngineHash, bytes] = OrderedDict()
        # own hash (the digest's first 8 bytes as an int) -> engine hashes holding it.
        self._own: dict[int, int] = {}
        self.block_size: int | None = None
        self.last_seq: int | None = None
        # Whether the set is the replica's whole cache: only once it was built from sequence 0.
        self.exact = False
        self.updated: float | None = None
        self.stats = ReplicaStats()

    def __len__(self) -> int:
        return len(self._digests)

    def check(self, seq: int) -> Sync:
        """Where ``seq`` stands against the last batch applied (nothing changes)."""
        last = self.last_seq
        if last is None:
            return Sync.NEXT if seq == 0 else Sync.GAP
        if seq == last + 1:
            return Sync.NEXT
        if seq > last + 1:
            return Sync.GAP
        if seq == 0 or seq < last - _RESTART_SLACK:
            return Sync.RESTART
        return Sync.STALE

    def apply(self, batch: EventBatch, now: float) -> Sync:
        """Apply ``batch`` if it is the next one; on a gap or a restart clear the set, then
        apply it when it starts the sequence (a restarted engine's batch 0)."""
        sync = self.check(batch.seq)
        if sync is Sync.STALE:
            return sync
        if sync is Sync.GAP:
            self.stats.gaps += 1
            self.clear(exact=False)
            self.last_seq = batch.seq
            self.updated = now
            # The batch is still applied: it is what the replica holds now, only not all of it;
            # all of it again from a clear in it on.
            self.exact = self._apply_events(batch)
            return sync
        if sync is Sync.RESTART:
            self.stats.restarts += 1
            self.clear(exact=batch.seq == 0)
        elif self.last_seq is None:  # seq 0, first seen: the set starts complete
            self.exact = True
        self.last_seq = batch.seq
        self.updated = now
        self.stats.batches += 1
        if self._apply_events(batch):
            self.exact = True
        return sync

    def clear(self, *, exact: bool) -> None:
        self._digests.clear()
        self._own.clear()
        self.exact = exact
        if not exact:
            self.last_seq = None

    def start_empty(self, now: float) -> None:
        """The engine's replay buffer is empty: it has published nothing, so its cache holds
        nothing the gateway could match, exactly; its first batch (sequence 0) is next."""
        if self.last_seq is None:
            self.clear(exact=True)
            self.updated = now

    def rebuild(self, batches: Sequence[EventBatch], now: float) -> bool:
        """Replace the set with a replay of the engine's buffer; exact when the replay has no
        hole from sequence 0, or from its last clear (``AllBlocksCleared``) on: a replica
        that ran longer than its buffer is exact again after a cache reset. Returns whether
        it is exact."""
        self.clear(exact=False)
        if not batches:
            return False
        self.stats.resyncs += 1
        exact = batches[0].seq == 0
        previous = batches[0].seq - 1
        for batch in batches:
            if batch.seq != previous + 1:
                exact = False
            if self._apply_events(batch):
                exact = True
            previous = batch.seq
        self.last_seq = batches[-1].seq
        self.updated = now
        self.exact = exact
        return self.exact

    def _apply_events(self, batch: EventBatch) -> bool:
        """Apply the batch's events in order; whether one cleared the whole cache (from it
        on, what the batches say is all the replica holds)."""
        cleared = False
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                if event.medium in _RESIDENT_MEDIA:
                    for h in event.block_hashes:
                        self._remove(h)
            elif isinstance(event, AllBlocksCleared):
                self._digests.clear()
                self._own.clear()
                cleared = True
        return cleared

    def _stored(self, event: BlockStored) -> None:
        if event.medium not in _RESIDENT_MEDIA or event.block_size < 1:
            return
        if event.extra_keys and any(k for k in event.extra_keys):
            return  # hashed with inputs no gateway request carries
        self.block_size = event.block_size
        if event.parent_block_hash is None:
            parent: bytes | None = _root(event.lora_name)
        else:
            parent = self._digests.get(event.parent_block_hash)
        if parent is None:
            self.stats.unlinked += len(event.block_hashes)
            return
        digests = _chain_from(parent, event.token_ids, event.block_size)
        for engine_hash, digest in zip(event.block_hashes, digests, strict=False):
            self._remove(engine_hash)
            self._digests[engine_hash] = digest
            own = int.from_bytes(digest[:8], "little")
            self._own[own] = self._own.get(own, 0) + 1
        while len(self._digests) > self.max_blocks:
            _old, digest = self._digests.popitem(last=False)
            self._drop_own(digest)
            self.stats.evicted += 1

    def _remove(self, engine_hash: EngineHash) -> None:
        digest = self._digests.pop(engine_hash, None)
        if digest is not None:
            self._drop_own(digest)

    def _drop_own(self, digest: bytes) -> None:
        own = int.from_bytes(digest[:8], "little")
        n = self._own.get(own, 0)
        if n <= 1:
            self._own.pop(own, None)
        else:
            self._own[own] = n - 1

    def cached_blocks(self, own_hashes: Sequence[int]) -> int:
        """How many leading blocks of a request (``chain_hashes``) the replica holds."""
        held = self._own
        n = 0
        for h in own_hashes:
            if h not in held:
                break
            n += 1
        return n


# A sequence lower than the last by more than this is a restart, not a replay's overlap.
_RESTART_SLACK = 0


class RequestBlocks:
    """One request's prompt against the exact index: its chain hashed once per block size."""

    __slots__ = ("_chains", "_kv", "_lora", "_token_ids")

    def __init__(self, kv: KvIndex, token_ids: Sequence[int], lora_name: str | None = None) -> None:
        self._kv = kv
        self._token_ids = token_ids
        self._lora = lora_name
        self._chains: dict[int, list[int]] = {}

    def cached_tokens(self, replica_id: str) -> int | None:
        """Tokens of the prompt ``replica_id`` holds; None where its events are not in use or not exact."""
        blocks = self._kv.exact_replica(replica_id)
        if blocks is None:
            return None
        size = blocks.block_size
        if size is None:  # nothing stored since the engine started: an empty cache
            return 0
        chain = self._chains.get(size)
        if chain is None:
            chain = self._chains[size] = chain_hashes(self._token_ids, size, self._lora)
        return blocks.cached_blocks(chain) * size


class KvIndex:
    """Every replica's ``ReplicaBlocks`` that publishes events, by replica id (one per gateway)."""

    __slots__ = ("_replicas", "max_blocks")

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._replicas: dict[str, ReplicaBlocks] = {}

    def replica(self, replica_id: str) -> ReplicaBlocks:
        blocks = self._replicas.get(replica_id)
        if blocks is None:
            blocks = self._replicas[replica_id] = ReplicaBlocks(self.max_blocks)
        return blocks

    def forget(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    def exact_replica(self, replica_id: str) -> ReplicaBlocks | None:
        """``replica_id``'s blocks when they are its whole cache (None: no events, or not exact now)."""
        blocks = self._replicas.get(replica_id)
        if blocks is None or not blocks.exact:
            return None
        return blocks

    def cached_tokens(self, token_ids: Sequence[int], replica_id: str, lora_name: str | None = None) -> int | None:
        """Tokens of the prompt ``token_ids`` the replica holds cached, or None when its
        events are not in use or not exact now (the caller then reads the estimate)."""
        return RequestBlocks(self, token_ids, lora_name).cached_tokens(replica_id)

    def request(self, token_ids: Sequence[int], lora_name: str | None = None) -> RequestBlocks:
        return RequestBlocks(self, token_ids, lora_name)

    def describe(self) -> dict[str, dict[str, object]]:
        """Per replica, for ``/admin/fleet``."""
        return {
            rid: {
                "exact": b.exact,
                "blocks": len(b),
                "block_size": b.block_size,
                "last_seq": b.last_seq,
                "batches": b.stats.batches,
                "gaps": b.stats.gaps,
                "restarts": b.stats.restarts,
                "resyncs": b.stats.resyncs,
                "unlinked": b.stats.unlinked,
                "evicted": b.stats.evicted,
            }
            for rid, b in self._replicas.items()
        }
