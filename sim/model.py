"""The pure model of one vLLM engine: scheduler, paged KV cache with prefix caching, step time.

No asyncio and no clock: ``EngineModel.step()`` schedules one batch the way vLLM's V1
scheduler does, advances every scheduled request by the tokens it computed, and returns how
long that step takes on the profiled GPU with the tokens it produced. The caller owns time
(``sim.batched_engine`` sleeps it, ``bench.sim_calibration`` adds it up).

What is modelled, after vLLM (``vllm/v1/core/sched/scheduler.py``, ``kv_cache_manager.py``):

* a token budget per step (chunked prefill); running requests are served first, in order;
* when a running request needs a block and none is free, the youngest running request is
  preempted by recompute: its blocks are freed and it goes back to the head of the queue;
* waiting requests are admitted FCFS while blocks, the budget and ``max_num_seqs`` allow,
  and only in a step without preemption;
* KV blocks of ``block_size`` tokens, ref-counted; full prompt blocks are registered under a
  chained hash as soon as they are allocated; freed blocks keep their contents and go to the
  tail of an LRU free queue, tail blocks of a sequence first, so a later request with the same
  prefix can take them back until they are evicted by an allocation;
* a request whose whole prompt is cached still recomputes its last token.
"""

from __future__ import annotations

import random
import zlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from replicas.replica import GAUGE_KV_USAGE, GAUGE_RUNNING, GAUGE_WAITING
from sim.engine import CHARS_PER_TOKEN
from sim.profiles import SimProfile

# Parent of the first block in the hash chain (vLLM seeds its chain the same way, with a constant).
ROOT_BLOCK_HASH = 0
# Step times never shrink below half the model's value, whatever the jitter draws.
MIN_JITTER_FACTOR = 0.5
FINISH_LENGTH = "length"  # hit max_tokens or the context window
FINISH_STOP = "stop"  # the answer ended on its own (EOS)


def prompt_token_ids(text: str) -> list[int]:
    """The simulator's tokens: one per ``CHARS_PER_TOKEN`` characters, id = CRC-32 of the chunk.

    Equal prefixes of text give equal prefixes of ids, which is all prefix caching needs; the
    count matches ``sim.engine.count_tokens``.
    """
    if not text:
        return [zlib.crc32(b"")]
    step = CHARS_PER_TOKEN
    return [zlib.crc32(text[i : i + step].encode()) for i in range(0, len(text), step)]


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks: each covers its tokens and every block before it."""
    hashes: list[int] = []
    parent = ROOT_BLOCK_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, *token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


# vLLM publishes block hashes as unsigned 64-bit ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES);
# Python's hash is signed.
_U64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class CacheEvent:
    """A change to the prefix cache, as vLLM's KV events tell it (``sim.kv_publisher``):
    ``stored`` a block (its hash, its parent's, its tokens), ``removed`` one, or ``cleared``."""

    kind: str
    block_hash: int = 0
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockPool:
    """Ref-counted KV blocks; unreferenced blocks sit in an LRU queue with their cached contents.

    ``events``: a list the pool appends ``CacheEvent``s to (None, the default: nothing is kept).
    """

    def __init__(self, num_blocks: int) -> None:
        self.events: list[CacheEvent] | None = None
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        # Front = least recently freed = evicted first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Share of blocks referenced by requests (cached but free blocks count as free, as in vLLM)."""
        return 1.0 - len(self._free) / self.num_blocks if self.num_blocks else 0.0

    def lookup(self, hashes: list[int]) -> list[int]:
        """The cached blocks for the longest prefix of ``hashes``."""
        hits: list[int] = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_evictable(self, blocks: list[int]) -> int:
        return sum(1 for b in blocks if self._refs[b] == 0)

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks from the LRU end, evicting whatever they cached."""
        taken: list[int] = []
        for _ in range(count):
            block, _unused = self._free.popitem(last=False)
            old = self._hash_of[block]
            if old is not None:
                self._hash_of[block] = None
                if self._by_hash.get(old) == block:
                    del self._by_hash[old]
                    if self.events is not None:
                        self.events.append(CacheEvent("removed", old & _U64))
            self._refs[block] = 1
            taken.append(block)
        return taken

    def release(self, blocks: list[int]) -> None:
        # Tail blocks first: they are the least likely to be shared by a later request.
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None

    def reset(self) -> bool:
        """Forget every cached block, as vLLM's ``reset_prefix_cache``; False while blocks are in use."""
        if any(self._refs):
            return False
        self._by_hash.clear()
        self._hash_of = [None] * self.num_blocks
        if self.events is not None:
            self.events.append(CacheEvent("cleared"))
        return True

    def cache(self, block: int, block_hash: int, parent_hash: int | None = None, token_ids: Sequence[int] = ()) -> None:
        if block_hash not in self._by_hash and self._hash_of[block] is None:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash
            if self.events is not None:
                parent = None if parent_hash is None else parent_hash & _U64
                self.events.append(CacheEvent("stored", block_hash & _U64, parent, tuple(token_ids)))


class TokenEvent(NamedTuple):
    """One token produced for a request; ``position`` 0 is the first token."""

    request_id: str
    position: int
    finish_reason: str | None


@dataclass(frozen=True)
class StepResult:
    """What one engine step did: how long it took and which tokens came out at its end."""

    duration_s: float
    events: list[TokenEvent]
    preempted: list[str]
    num_scheduled_tokens: int
    kv_usage: float  # as vLLM's gauge reads it: after scheduling, before finished requests free


@dataclass
class EngineCounters:
    """Monotonic counters, named after vLLM's (prefix-cache figures are in tokens)."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0


@dataclass(eq=False, slots=True)
class _Seq:
    request_id: str
    prompt_len: int
    hashes: list[int]
    max_tokens: int
    eos_after: int | None
    num_computed: int = 0
    num_output: int = 0
    num_cached_blocks: int = 0
    blocks: list[int] = field(default_factory=list)
    # The prompt's ids: what a stored block's KV event carries.
    token_ids: list[int] = field(default_factory=list)


class EngineModel:
    """One vLLM engine on the profiled GPU: queues, KV blocks, and the cost of each step."""

    def __init__(self, profile: SimProfile, rng: random.Random) -> None:
        self.profile = profile
        self.pool = BlockPool(profile.num_blocks)
        self.counters = EngineCounters()
        self._rng = rng
        self._coeff = profile.coefficients()
        self._bs = profile.block_size
        self._max_len = profile.max_model_len
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._seqs: dict[str, _Seq] = {}

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def add_request(self, request_id: str, token_ids: list[int], max_tokens: int, eos_after: int | None = None) -> None:
        """Queue a request; it stops after ``max_tokens``, or after ``eos_after`` with "stop"."""
        if request_id in self._seqs:
            raise ValueError(f"duplicate request id {request_id!r}")
        if not token_ids or max_tokens < 1:
            raise ValueError("a request needs at least one prompt token and max_tokens >= 1")
        if len(token_ids) >= self._max_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens leaves no room in the {self._max_len}-token context")
        seq = _Seq(request_id, len(token_ids), block_hashes(token_ids, self._bs), max_tokens, eos_after)
        if self.pool.events is not None:
            seq.token_ids = token_ids
        self._seqs[request_id] = seq
        self._waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks; False if it is not here."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq in self._running:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self.pool.release(seq.blocks)
        seq.blocks = []
        return True

    def metrics(self) -> dict[str, float]:
        """The engine's state under vLLM's metric names."""
        c = self.counters
        return {
            GAUGE_RUNNING: float(len(self._running)),
            GAUGE_WAITING: float(len(self._waiting)),
            GAUGE_KV_USAGE: self.pool.usage,
            "vllm:prefix_cache_queries_total": float(c.prefix_cache_queries_total),
            "vllm:prefix_cache_hits_total": float(c.prefix_cache_hits_total),
            "vllm:num_preemptions_total": float(c.num_preemptions_total),
            "vllm:prompt_tokens_total": float(c.prompt_tokens_total),
            "vllm:generation_tokens_total": float(c.generation_tokens_total),
        }

    def step(self) -> StepResult:
        """Schedule one batch, run it, and return its duration and the tokens it produced."""
        budget = self.profile.max_num_batched_tokens
        scheduled: list[tuple[_Seq, int]] = []
        preempted: list[str] = []
        running = self._running
        bs = self._bs
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(seq.prompt_len + seq.num_output - seq.num_computed, budget)
            total = seq.num_computed + n
            # Fast path: most decode steps fit in the last block and register nothing.
            needs_work = total > len(seq.blocks) * bs or seq.num_cached_blocks < len(seq.hashes)
            if needs_work and not self._grow(seq, total) and not self._make_room(seq, total, preempted):
                break  # seq itself was the youngest: preempted
            scheduled.append((seq, n))
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit(budget, scheduled)
        return self._run(scheduled, preempted, self.profile.max_num_batched_tokens - budget)

    def _grow(self, seq: _Seq, total_tokens: int) -> bool:
        need = -(-total_tokens // self._bs) - len(seq.blocks)
        if need > 0:
            if need > self.pool.num_free:
                return False
            seq.blocks.extend(self.pool.allocate(need))
        if seq.num_cached_blocks < len(seq.hashes):
            # A prefill chunk may complete a block allocated by the previous chunk.
            self._register(seq, total_tokens)
        return True

    def _make_room(self, seq: _Seq, total_tokens: int, preempted: list[str]) -> bool:
        """Preempt the youngest running requests until ``seq`` fits; False if ``seq`` went too."""
        while True:
            victim = self._running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is seq:
                return False
            if self._grow(seq, total_tokens):
                return True

    def _register(self, seq: _Seq, total_tokens: int) -> None:
        full = min(total_tokens // self._bs, len(seq.hashes))
        events = self.pool.events is not None
        for j in range(seq.num_cached_blocks, full):
            if events:
                bs = self._bs
                parent = seq.hashes[j - 1] if j else None
                self.pool.cache(seq.blocks[j], seq.hashes[j], parent, seq.token_ids[j * bs : (j + 1) * bs])
            else:
                self.pool.cache(seq.blocks[j], seq.hashes[j])
        seq.num_cached_blocks = max(seq.num_cached_blocks, full)

    def _preempt(self, seq: _Seq) -> None:
        self.pool.release(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.num_cached_blocks = 0
        self._waiting.appendleft(seq)
        self.counters.num_preemptions_total += 1

    def _admit(self, budget: int, scheduled: list[tuple[_Seq, int]]) -> int:
        bs, pool = self._bs, self.pool
        while self._waiting and budget > 0 and len(self._running) < self.profile.max_num_seqs:
            seq = self._waiting[0]
            num_tokens = seq.prompt_len + seq.num_output
            # At least the last token is recomputed: its logits are what the step samples from.
            hits = pool.lookup(seq.hashes[: (num_tokens - 1) // bs])
            computed = len(hits) * bs
            n = min(num_tokens - computed, budget)
            need = -(-(computed + n) // bs) - len(hits)
            if need > pool.num_free - pool.num_evictable(hits):
                break
            pool.touch(hits)
            seq.blocks = hits + pool.allocate(need)
            seq.num_computed = computed
            seq.num_cached_blocks = len(hits)
            self._register(seq, computed + n)
            self.counters.prefix_cache_queries_total += num_tokens
            self.counters.prefix_cache_hits_total += computed
            self._waiting.popleft()
            self._running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        return budget

    def _run(self, scheduled: list[tuple[_Seq, int]], preempted: list[str], num_tokens: int) -> StepResult:
        kv_usage = self.pool.usage
        kv_read = 0
        pairs = 0.0
        events: list[TokenEvent] = []
        finished = False
        counters = self.counters
        for seq, n in scheduled:
            start = seq.num_computed
            kv_read += start
            pairs += n * start + n * (n + 1) / 2
            seq.num_computed = start + n
            if seq.num_computed < seq.prompt_len + seq.num_output:
                continue  # a prefill chunk that did not reach the end of the prompt
            seq.num_output += 1
            if seq.num_output == 1:
                counters.prompt_tokens_total += seq.prompt_len
            counters.generation_tokens_total += 1
            reason: str | None = None
            if seq.eos_after is not None and seq.num_output >= seq.eos_after:
                reason = FINISH_STOP
            elif seq.num_output >= seq.max_tokens or seq.prompt_len + seq.num_output >= self._max_len:
                reason = FINISH_LENGTH
            if reason is not None:
                finished = True
                self.pool.release(seq.blocks)
                seq.blocks = []
                del self._seqs[seq.request_id]
            events.append(TokenEvent(seq.request_id, seq.num_output - 1, reason))
        if finished:
            self._running = [s for s in self._running if s.request_id in self._seqs]
        duration = self._coeff.seconds(len(scheduled), num_tokens, kv_read, pairs)
        jitter = self.profile.efficiency.step_jitter
        if jitter and duration:
            duration *= max(MIN_JITTER_FACTOR, self._rng.gauss(1.0, jitter))
        return StepResult(duration, events, preempted, num_tokens, kv_usage)
