"""Replica-choice policies: pure decisions over the fleet's state at a given time.

Every policy answers ``pick(replicas, request, now, exclude) -> Decision``. None of them
awaits or reads a clock; the caller passes ``now`` and each policy owns its
``random.Random`` (for ties) or its counter (round robin), so tests need no sleeps.

- ``RoundRobin`` and ``LeastRequests`` are the baselines a benchmark compares against.
- ``LeastOutstandingTokens`` ranks replicas by ``effective_load``: this gateway's own
  outstanding tokens, corrected by what the replica reports about work it got from
  elsewhere (other gateway pods) and about KV-cache pressure.
- ``PrefixAffinity`` (the default) sends requests sharing a leading prefix to the same
  replica, chosen by rendezvous hashing so every gateway pod agrees without sharing state,
  and gives up that affinity when the preferred replica's load gets out of line.

A replica that is draining, down, failed or circuit-open is never chosen
(``Replica.routable(now)``), nor one in ``exclude`` (already tried for this request).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

from replicas.replica import Replica

# vLLM gauges this module reads (names as exposed by current vLLM).
GAUGE_RUNNING = "vllm:num_requests_running"
GAUGE_WAITING = "vllm:num_requests_waiting"
GAUGE_KV_USAGE = "vllm:kv_cache_usage_perc"

# Prefix blocks: 256 characters is ~64 tokens, i.e. four of vLLM's default 16-token KV
# blocks, so a matching block stands for KV the replica can actually reuse.
DEFAULT_BLOCK_CHARS = 256
# Past 32 blocks (~8k characters) a longer match no longer changes where a request goes.
DEFAULT_MAX_BLOCKS = 32

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy needs to know about a request: plain data, built once per request.

    ``prefix_keys[i]`` is a hash of the first ``(i + 1) * block_chars`` characters of the
    prompt, so two requests share ``k`` keys exactly when they share ``k`` full blocks.
    """

    prefix_keys: tuple[int, ...] = ()
    prompt_tokens: int = 0
    max_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen replica (None: nothing routable) and a short reason for logs and headers."""

    replica: Replica | None
    reason: str


class Policy(Protocol):
    """A replica-choice policy."""

    def pick(
        self, replicas: Sequence[Replica], request: RouteRequest, now: float, exclude: Collection[str] = ()
    ) -> Decision: ...


@dataclass(frozen=True, slots=True)
class LoadModel:
    """How scraped vLLM gauges correct this gateway's own view of a replica's load.

    ``effective_load = own_tokens + tokens_per_request * (foreign + waiting) + kv_term``

    - ``own_tokens``: prompt not yet prefilled + completion still owed, for this pod's requests.
    - ``foreign = max(0, running + waiting - own_requests)``: requests the replica holds
      that this pod did not send (other gateway pods). Each is charged a typical
      request's tokens, since their sizes are unknown here.
    - ``waiting`` is charged once more: a queued request means the replica's batch is
      full, so new work waits behind it rather than sharing a decode step.
    - ``kv_term = kv_full_tokens * max(0, kv - kv_knee) / (1 - kv_knee)``: past the knee
      new sequences start to preempt running ones; the penalty grows linearly to
      ``kv_full_tokens`` at a full cache. Below the knee KV usage says nothing useful
      (vLLM keeps cached prefixes resident), so it costs nothing.

    Missing gauges (not scraped yet) count as zero foreign work: the correction only ever
    adds load seen elsewhere, it never hides this pod's own.
    """

    tokens_per_request: int = 512
    kv_knee: float = 0.8
    kv_full_tokens: int = 8192

    def effective_load(self, replica: Replica) -> float:
        gauges = replica.gauges
        own = replica.outstanding_requests
        waiting = gauges.get(GAUGE_WAITING, 0.0)
        running = gauges.get(GAUGE_RUNNING, float(own))
        foreign = max(0.0, running + waiting - own)
        load = replica.outstanding_tokens + self.tokens_per_request * (foreign + waiting)
        kv = gauges.get(GAUGE_KV_USAGE, 0.0)
        if kv > self.kv_knee:
            load += self.kv_full_tokens * min(1.0, (kv - self.kv_knee) / (1.0 - self.kv_knee))
        return load


def _candidates(replicas: Sequence[Replica], now: float, exclude: Collection[str]) -> list[Replica]:
    return [r for r in replicas if r.id not in exclude and r.routable(now)]


class RoundRobin:
    """Each routable replica in turn (baseline). Owns its counter."""

    def __init__(self) -> None:
        self._next = 0

    def pick(
        self, replicas: Sequence[Replica], request: RouteRequest, now: float, exclude: Collection[str] = ()
    ) -> Decision:
        # Walk from the counter over the whole list so skipped replicas do not shift the
        # order of the others; the counter advances past the one chosen.
        n = len(replicas)
        for step in range(n):
            i = (self._next + step) % n
            replica = replicas[i]
            if replica.id not in exclude and replica.routable(now):
                self._next = (i + 1) % n
                return Decision(replica, "round_robin")
        return Decision(None, "no_routable_replica")


class LeastRequests:
    """Fewest in-flight requests from this gateway (baseline); ties at random."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(
        self, replicas: Sequence[Replica], request: RouteRequest, now: float, exclude: Collection[str] = ()
    ) -> Decision:
        best = _argmin(_candidates(replicas, now, exclude), lambda r: r.outstanding_requests, self._rng)
        return Decision(best, "least_requests" if best else "no_routable_replica")


class LeastOutstandingTokens:
    """Lowest ``LoadModel.effective_load``; ties at random."""

    def __init__(self, rng: random.Random, load: LoadModel | None = None) -> None:
        self._rng = rng
        self._load = load or LoadModel()

    def pick(
        self, replicas: Sequence[Replica], request: RouteRequest, now: float, exclude: Collection[str] = ()
    ) -> Decision:
        best = _argmin(_candidates(replicas, now, exclude), self._load.effective_load, self._rng)
        return Decision(best, "least_tokens" if best else "no_routable_replica")


@dataclass(frozen=True, slots=True)
class AffinityGuard:
    """When affinity is worth keeping: ``load(preferred) <= factor * min_load + margin_tokens``.

    The margin keeps affinity on a lightly loaded fleet, where the factor alone would flap
    on a few hundred tokens; the factor bounds the imbalance under heavy load, where a hot
    prefix would otherwise pile its whole traffic onto one replica (affinity-only routers
    collapse under skew). ``spill_ranks`` more replicas are tried in rendezvous order
    before falling back to the least loaded, so an overflowing prefix still lands on a
    stable second home whose cache warms too.
    """

    factor: float = 1.5
    margin_tokens: int = 2048
    spill_ranks: int = 1

    def allows(self, load: float, min_load: float) -> bool:
        return load <= self.factor * min_load + self.margin_tokens


class PrefixAffinity:
    """Rendezvous-hash the request's prefix to a replica, within the load guard.

    The key is ``prefix_keys[min(len, anchor_blocks) - 1]``: requests sharing the first
    ``anchor_blocks`` blocks go to the same replica; a shorter prompt uses its own longest
    full block. Prompts shorter than one block carry no key and go to the least loaded
    (there is little prefill to save on them).
    """

    def __init__(
        self,
        rng: random.Random,
        load: LoadModel | None = None,
        guard: AffinityGuard | None = None,
        anchor_blocks: int = 4,
    ) -> None:
        if anchor_blocks < 1:
            raise ValueError("anchor_blocks must be at least 1")
        self._rng = rng
        self._load = load or LoadModel()
        self._guard = guard or AffinityGuard()
        self._anchor = anchor_blocks

    def pick(
        self, replicas: Sequence[Replica], request: RouteRequest, now: float, exclude: Collection[str] = ()
    ) -> Decision:
        candidates = _candidates(replicas, now, exclude)
        if not candidates:
            return Decision(None, "no_routable_replica")
        keys = request.prefix_keys
        if not keys:
            return Decision(_argmin(candidates, self._load.effective_load, self._rng), "no_prefix")
        key = keys[min(len(keys), self._anchor) - 1]
        ranked = rendezvous_rank(key, candidates)
        loads = {r.id: self._load.effective_load(r) for r in candidates}
        min_load = min(loads.values())
        for rank, replica in enumerate(ranked[: 1 + self._guard.spill_ranks]):
            if self._guard.allows(loads[replica.id], min_load):
                return Decision(replica, "affinity" if rank == 0 else f"affinity_spill:{rank}")
        # The least loaded, from the loads already measured (same choice as LeastOutstandingTokens).
        return Decision(_argmin(candidates, lambda r: loads[r.id], self._rng), "affinity_overloaded")


def rendezvous_rank(key: int, replicas: Sequence[Replica]) -> list[Replica]:
    """Replicas by descending highest-random-weight for ``key``.

    Removing a replica changes the top choice only for keys whose top choice it was, so
    only that replica's prefixes move (and their caches are cold anywhere anyway).
    """
    return sorted(replicas, key=lambda r: _mix(key ^ _id_hash(r.id)), reverse=True)


@lru_cache(maxsize=4096)
def _id_hash(replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(replica_id.encode(), digest_size=8).digest(), "little")


def _mix(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread 64-bit mix of key and replica."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def prefix_keys(
    body: dict[str, Any], block_chars: int = DEFAULT_BLOCK_CHARS, max_blocks: int = DEFAULT_MAX_BLOCKS
) -> tuple[int, ...]:
    """Cumulative hashes of the prompt's leading full blocks (chat messages or completion prompt).

    Roles are part of the text so a system prompt and the same words as a user turn differ,
    as they do in the replica's chat template. Only the first ``block_chars * max_blocks``
    characters are read.
    """
    limit = block_chars * max_blocks
    parts: list[str] = []
    size = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if size >= limit:
                break
            if not isinstance(message, dict):
                continue
            text = f"{message.get('role', '')}\x1f{_content_text(message.get('content'))}\x1e"
            parts.append(text)
            size += len(text)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            parts.append(prompt)
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            parts.append(prompt[0])
    text = "".join(parts)[:limit]
    hasher = hashlib.blake2b(digest_size=8)
    keys: list[int] = []
    for start in range(0, len(text) - block_chars + 1, block_chars):
        hasher.update(text[start : start + block_chars].encode())
        keys.append(int.from_bytes(hasher.copy().digest(), "little"))
    return tuple(keys)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _argmin(candidates: list[Replica], load: Callable[[Replica], float], rng: random.Random) -> Replica | None:
    best: Replica | None = None
    best_key: tuple[float, int, float] | None = None
    for replica in candidates:
        key = (load(replica), replica.outstanding_tokens, rng.random())
        if best_key is None or key < best_key:
            best, best_key = replica, key
    return best
