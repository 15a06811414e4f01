"""Replica-choice policies: pure decisions over the fleet's state at a given time.

Every policy answers ``pick(replicas, request, now, exclude) -> Decision``. None of them
awaits or reads a clock; the caller passes ``now`` and each policy owns its
``random.Random`` (for ties) or its counter (round robin), so tests need no sleeps.

- ``RoundRobin`` and ``LeastRequests`` are the baselines a benchmark compares against.
- ``LeastOutstandingTokens`` ranks replicas by ``effective_load``: this gateway's own
  outstanding tokens, corrected by what the replica reports about work it got from
  elsewhere (other gateway pods) and about KV-cache pressure.
- ``PrefixAffinity`` (the default) gives every prompt prefix a home replica by rendezvous
  hashing, so the replicas' prefix caches split the working set and every gateway pod
  agrees on the split; a request spills to the next replica in its prefix's order only
  when those before it are past a load bound (consistent hashing with bounded loads).

A replica that is draining, down, failed or circuit-open is never chosen
(``Replica.routable(now)``), nor one in ``exclude`` (already tried for this request).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dialects.base import ROLE_END
from replicas.replica import GAUGE_KV_USAGE, Replica, ReplicaState
from routing.kv_index import RequestBlocks
from routing.prefix_index import PrefixIndex
from routing.prefix_placement import AnchorPlacement, hash64

# Prefix blocks: 256 characters is ~64 tokens, i.e. four of vLLM's default 16-token KV
# blocks, so a matching block stands for KV the replica can actually reuse.
DEFAULT_BLOCK_CHARS = 256
# Fine blocks cover the first 32 x 256 characters (~2k tokens: system prompts, tool lists);
# past them blocks are coarser, 4,096 characters, up to 256k characters (~64k tokens).
DEFAULT_MAX_BLOCKS = 32
DEFAULT_COARSE_BLOCK_CHARS = 4096
DEFAULT_MAX_PREFIX_CHARS = 262144


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy needs to know about a request: plain data, built once per request.

    ``prefix_keys[i]`` is a hash of the prompt's first ``prefix_ends[i]`` characters, so two
    requests share ``k`` keys exactly when they share ``k`` full blocks. ``prompt_chars``
    is the length of the text the keys were cut from (the whole prompt, up to the hashing
    limit), so ``prefix_ends[k - 1] / prompt_chars`` is the share of the prompt a replica
    holding ``k`` keys has cached.
    """

    prefix_keys: tuple[int, ...] = ()
    prompt_tokens: int = 0
    max_tokens: int = 0
    prefix_ends: tuple[int, ...] = ()
    prompt_chars: int = 0
    # Which of a hot prefix's homes serves it: a hash of the client's session key, else of
    # its conversation's opening turn (``conversation_key``); 0 when there is none.
    session: int = 0
    conversation: int = 0
    # The leading keys that cover the system prompt alone (``opening``): a replica holding
    # more of them holds this conversation's own history.
    preamble_blocks: int = 0
    # Whether the prompt is a conversation's first turn, not a later one that resends it.
    opens: bool = True
    # The prompt's blocks against the replicas' KV-cache events (``routing.kv_index``): what a
    # replica that publishes them holds, exactly; None where no replica of the model does.
    exact: RequestBlocks | None = None

    def block_tokens(self) -> tuple[tuple[int, ...], int]:
        """Tokens of each keyed block (at least one each), and what else the request puts in a KV cache.

        The blocks' share of ``prompt_tokens`` by characters; the rest is the prompt's unkeyed
        end and the completion (``max_tokens``).
        """
        if not self.prefix_keys or self.prompt_chars <= 0:
            return (), self.prompt_tokens + self.max_tokens
        per_char = self.prompt_tokens / self.prompt_chars
        sizes: list[int] = []
        start = 0
        for end in self.prefix_ends:
            sizes.append(max(1, round((end - start) * per_char)))
            start = end
        return tuple(sizes), max(0, self.prompt_tokens - sum(sizes)) + self.max_tokens

    def cached_on(self, replica_id: str, index: PrefixIndex | None) -> int:
        """Prompt tokens ``replica_id`` holds cached: exactly where its KV events are in use,
        else by the prefix index's estimate (0 without one)."""
        if self.exact is not None:
            cached = self.exact.cached_tokens(replica_id)
            if cached is not None:
                return min(cached, self.prompt_tokens)
        if index is None or not self.prefix_keys:
            return 0
        return self.prompt_tokens - self.uncached_tokens(index.depth(self.prefix_keys, replica_id))

    def uncached_on(self, replica_id: str, index: PrefixIndex | None) -> int:
        """Prompt tokens left to prefill on ``replica_id`` (``cached_on``); at least one, as
        an engine holding the whole prompt still computes its last token."""
        return max(1, self.prompt_tokens - self.cached_on(replica_id, index)) if self.prompt_tokens else 0

    def preamble_tokens(self) -> int:
        """The system prompt's share of ``prompt_tokens`` (by characters)."""
        if self.preamble_blocks <= 0 or self.prompt_chars <= 0:
            return 0
        return round(self.prompt_tokens * min(1.0, self.prefix_ends[self.preamble_blocks - 1] / self.prompt_chars))

    def uncached_tokens(self, depth: int) -> int:
        """Prompt tokens left to prefill on a replica holding the first ``depth`` keys."""
        if depth <= 0 or self.prompt_chars <= 0:
            return self.prompt_tokens
        cached = min(1.0, self.prefix_ends[depth - 1] / self.prompt_chars)
        return max(1, round(self.prompt_tokens * (1.0 - cached)))


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen replica (None: nothing routable) and a short reason for logs and headers."""

    replica: Replica | None
    reason: str


class Policy(Protocol):
    """A replica-choice policy.

    ``keeps_prefixes``: whether the policy places prompts where their prefix is cached, so
    that the pool, diverting its requests away from full replicas, must count the caches.
    """

    keeps_prefixes: bool

    def pick(
        self, replicas: Sequence[Replica], request: RouteRequest, now: float, exclude: Collection[str] = ()
    ) -> Decision: ...


@dataclass(frozen=True, slots=True)
class LoadModel:
    """How scraped vLLM gauges correct this gateway's own view of a replica's load.

    ``effective_load = own_tokens + tokens_per_request * (foreign + foreign_waiting) + kv_term``

    - ``own_tokens``: prompt not yet prefilled + completion still owed, for this pod's requests.
    - ``foreign``: requests the replica held at the last scrape beyond this pod's own at
      that moment (``Replica.observe``): work from other gateway pods. Each is charged a
      typical request's tokens, since their sizes are unknown here.
    - ``foreign_waiting``, those of them still waiting, is charged once more: a queued
      request means the replica's batch is full, so new work waits behind it rather than
      sharing a decode step. (This pod's own waiting requests are in ``own_tokens``.)
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

    def requests(self, replica: Replica) -> float:
        """Requests in flight on ``replica``: this pod's, plus those it reported that are not ours."""
        return replica.outstanding_requests + replica.foreign_requests

    def effective_load(self, replica: Replica) -> float:
        foreign = replica.foreign_requests + replica.foreign_waiting
        load = replica.outstanding_tokens + self.tokens_per_request * foreign
        kv = replica.gauges.get(GAUGE_KV_USAGE, 0.0)
        if kv > self.kv_knee:
            load += self.kv_full_tokens * min(1.0, (kv - self.kv_knee) / (1.0 - self.kv_knee))
        return load


def _candidates(replicas: Sequence[Replica], now: float, exclude: Collection[str]) -> list[Replica]:
    return [r for r in replicas if r.id not in exclude and r.routable(now)]


class RoundRobin:
    """Each routable replica in turn (baseline). Owns its counter."""

    keeps_prefixes = False

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

    keeps_prefixes = False

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(
        self, replicas: Sequence[Replica], request: RouteRequest, now: float, exclude: Collection[str] = ()
    ) -> Decision:
        best = _argmin(
            _candidates(replicas, now, exclude), lambda r: (r.outstanding_requests, r.outstanding_tokens), self._rng
        )
        return Decision(best, "least_requests" if best else "no_routable_replica")


class LeastOutstandingTokens:
    """Lowest ``LoadModel.effective_load``; ties at random."""

    keeps_prefixes = False

    def __init__(self, rng: random.Random, load: LoadModel | None = None) -> None:
        self._rng = rng
        self._load = load or LoadModel()

    def pick(
        self, replicas: Sequence[Replica], request: RouteRequest, now: float, exclude: Collection[str] = ()
    ) -> Decision:
        load = self._load.effective_load
        best = _argmin(_candidates(replicas, now, exclude), lambda r: (load(r), r.outstanding_tokens), self._rng)
        return Decision(best, "least_tokens" if best else "no_routable_replica")


@dataclass(frozen=True, slots=True)
class LoadBound:
    """Consistent hashing with bounded loads: how busy a replica may be and still take a request.

    A replica takes the request while ``requests + 1 <= factor * (total + 1) / n + margin``:
    with it, its requests in flight stay within ``factor`` times the pool's mean (this
    request included) plus a margin (Mirrokni, Thorup and Zadimoghaddam, "Consistent
    Hashing with Bounded Loads", SODA 2018; HAProxy's ``hash-balance-factor``). Requests,
    not tokens: a new request's prefill stalls the decode step of every sequence on its
    replica, and the prefill a replica still owes is bounded apart from this
    (``routing.capacity``). The margin keeps a prefix home on a quiet fleet, where one
    request more or less is most of the mean; the factor bounds the imbalance under load,
    where a hot prefix would otherwise pile its whole traffic onto one replica. With a
    margin of at least one, the least busy replica always qualifies.

    Every gateway pod computes the bound from the same figures (each replica's requests:
    its own in flight plus the others' as of the last scrape), so pods spill alike.
    """

    factor: float = 1.25
    margin_requests: int = 4

    def allows(self, requests: float, total: float, n: int) -> bool:
        return requests + 1 <= self.factor * (total + 1) / n + self.margin_requests


class PrefixAffinity:
    """Give each prompt prefix a home replica its pods agree on; spill in its hash order past a load bound.

    Each request's *anchor* is its ``anchor_blocks``-th prefix key: the hash of its first
    ``anchor_blocks`` blocks (by default ~1,000 characters, e.g. the opening of a system
    prompt). The replicas are ranked by a hash of the anchor and each replica's address
    (rendezvous hashing), with the prefix's homes first: ``AnchorPlacement`` homes the
    prefixes in use on their first choices, except where a hash would split the working
    set between the replicas' caches unevenly, and gives a hot prefix as many homes as its
    share of the traffic calls for. Among a hot prefix's homes, a conversation goes on to
    the home the pool's prefix index (``index``) says holds its own earlier turns (more of
    its blocks than its system prompt fills), so a spill or a change of the homes' parts
    does not move it away from its history (where the replicas publish KV events, the
    index is exact and a replica a spill took the conversation to counts as one of its homes
    while it holds more of the conversation than they do: ``affinity_history``, so pods that
    read the same events keep it there alike); a conversation new to the pod is placed by its
    ``session``, by weighted rendezvous hashing: every turn of a conversation (or every
    request of a client's session key) goes to the same home, on every pod, and
    conversations spread over the homes by their parts. The request goes to the first
    replica of that order within the ``LoadBound`` (``affinity``), or to a later one when
    those before it are over the bound (``affinity_spill``). A prompt shorter than the
    anchor goes to the least busy replica (``no_prefix``): fewest requests in flight, then
    least ``effective_load``; with a session, to the first of the session's own order
    within the bound (``session``). So does a prefix seen for the first time in a pool where new
    prefixes seldom come back (``new_prefix``, ``AnchorPlacement.reuse``).

    A *stalled* replica (``Replica.stalled``: holding requests, none of which got a byte
    for a while) is passed over while another can take the request: a prefix homed there
    goes to the next replica of its order (``stall_spill``) and comes home once the
    replica moves again. The router does not record a stall spill in the pool's prefix
    index, so the prefix stays homed where it was.

    Why homes computed from hashes and not "where it was sent before": the order depends
    only on the prefixes in use and the set of replicas, so every gateway pod places a
    prefix on the same replica and spills it to the same next one, without talking; the
    replicas' prefix caches then split the working set instead of each caching all of it.
    A spill leaves no trace: the next request of that prefix goes home once home is within
    the bound again, so overflow never makes a prefix resident everywhere (under KV
    pressure that is what thrashes every cache). Ranking by address rather than replica id
    keeps the order the same in pods that name the replicas differently.

    A replica full for its prefill backlog (``routing.capacity``) is passed over only where
    the first token comes sooner, the prefill of a prefix cached elsewhere counted
    (``keeps_prefixes``, ``routing.pool.Pool``).

    ``members`` is the pool's replica list (homes are spread over its healthy replicas,
    whichever of them a given pick may choose from); without it, the replicas passed to
    ``pick`` are the members.
    """

    keeps_prefixes = True

    def __init__(
        self,
        rng: random.Random,
        load: LoadModel | None = None,
        bound: LoadBound | None = None,
        anchor_blocks: int = 4,
        placement: AnchorPlacement | None = None,
        members: Sequence[Replica] | None = None,
        index: PrefixIndex | None = None,
    ) -> None:
        if anchor_blocks < 1:
            raise ValueError("anchor_blocks must be at least 1")
        self._rng = rng
        self._load = load or LoadModel()
        self._bound = bound or LoadBound()
        self._anchor = anchor_blocks
        self.placement = placement if placement is not None else AnchorPlacement()
        self._members = members
        self._index = index

    def pick(
        self, replicas: Sequence[Replica], request: RouteRequest, now: float, exclude: Collection[str] = ()
    ) -> Decision:
        candidates = _candidates(replicas, now, exclude)
        if not candidates:
            return Decision(None, "no_routable_replica")
        stalled = {r.base_url for r in candidates if r.stalled(now)}
        if stalled and len(stalled) < len(candidates):  # a stalled replica only when every one is
            candidates = [r for r in candidates if r.base_url not in stalled]
        keys = request.prefix_keys
        weight = self.placement.weight
        if len(keys) < self._anchor:
            if request.session:
                best = self._first_within_bound(candidates, lambda r: weight(request.session, r.base_url))
                return Decision(best, "session")
            return Decision(self._least_busy(candidates), "no_prefix")
        anchor = keys[self._anchor - 1]
        members = self._members if self._members is not None else replicas
        addresses = [r.base_url for r in members if r.state is ReplicaState.HEALTHY]
        # A retry (``exclude``) is the same request, not one more use of the prefix.
        homes = self.placement.homes_of(
            anchor, addresses or [r.base_url for r in candidates], now, seen=not exclude, opens=request.opens
        )
        if not homes:  # seen once, where new prefixes seldom come back: by load
            return Decision(self._least_busy(candidates), "new_prefix")
        session = request.session or request.conversation or anchor
        history = self._history if len(homes) > 1 else None
        # Where the replicas' KV events say exactly how much of a conversation's own turns
        # each one holds, one that holds more than every home (a spill took it there) ranks
        # with the homes, above them: its next turn stays with its history. Not for a first
        # turn, which has no history: its prefix stays home, or it would drift to wherever a
        # spill left a copy that the home has since evicted, and be cached twice.
        held: dict[str, int] = {}
        at_home = 0
        if request.exact is not None and not request.opens:
            held = {r.id: self._history(request, r) for r in candidates}
            at_home = max((held[r.id] for r in candidates if r.base_url in homes), default=0)

        def rank(replica: Replica) -> tuple[int, int, float]:
            """Homes first (the one holding the conversation's history, else by the session's
            weighted order among them), then the prefix's order."""
            address = replica.base_url
            part = homes.get(address)
            if part is None:
                more = held.get(replica.id, 0) if held else 0
                return (1, more, 0.0) if more > at_home else (0, 0, weight(anchor, address))
            if history is None:
                return 1, at_home, 0.0
            return 1, history(request, replica), part / -math.log((weight(session, address) + 0.5) / _TWO_64)

        best = self._first_within_bound(candidates, rank)
        if best.base_url in homes:
            return Decision(best, "affinity")
        if held and held.get(best.id, 0) > at_home:
            return Decision(best, "affinity_history")
        # Not at home: past the bound, home stalled, or home not a candidate (tried already, or full).
        return Decision(best, "stall_spill" if stalled.intersection(homes) else "affinity_spill")

    def _history(self, request: RouteRequest, replica: Replica) -> int:
        """How many tokens of the conversation, its own turns past its system prompt, ``replica``
        holds (0 for none): exactly where its KV events are in use, else by the pool's prefix
        index (0 without one)."""
        exact = request.exact.cached_tokens(replica.id) if request.exact is not None else None
        if exact is not None:
            return exact if exact > request.preamble_tokens() else 0
        if self._index is None:
            return 0
        depth = self._index.depth(request.prefix_keys, replica.id)
        if depth <= request.preamble_blocks:
            return 0
        return request.prompt_tokens - request.uncached_tokens(depth)

    def _first_within_bound(self, candidates: list[Replica], rank: Callable[[Replica], Any]) -> Replica:
        """The highest-ranked candidate within the ``LoadBound`` (the least busy when none is)."""
        requests = [self._load.requests(r) for r in candidates]
        total, n = sum(requests), len(candidates)
        allowed = [i for i in range(n) if self._bound.allows(requests[i], total, n)]
        if not allowed:  # only with a zero margin: take the least busy
            allowed = [min(range(n), key=requests.__getitem__)]
        return candidates[max(allowed, key=lambda i: rank(candidates[i]))]

    def _least_busy(self, candidates: list[Replica]) -> Replica | None:
        model = self._load
        return _argmin(candidates, lambda r: (model.requests(r), model.effective_load(r)), self._rng)


def prefix_keys(
    segments: Sequence[str],
    block_chars: int = DEFAULT_BLOCK_CHARS,
    max_blocks: int = DEFAULT_MAX_BLOCKS,
    coarse_block_chars: int = DEFAULT_COARSE_BLOCK_CHARS,
    max_chars: int = DEFAULT_MAX_PREFIX_CHARS,
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Cumulative hashes of the prompt's leading full blocks, where each ends, and the prompt's length.

    ``segments`` is the prompt as its dialect renders it (``dialects.base.PromptView``): roles
    are part of the text, so a system prompt and the same words as a user turn differ, as they
    do in the replica's chat template. ``max_blocks`` blocks of ``block_chars`` characters,
    then blocks of ``coarse_block_chars`` up to ``max_chars`` (the rest is neither hashed nor
    counted).
    """
    text = "".join(segments)[:max_chars]
    hasher = hashlib.blake2b(digest_size=8)
    keys: list[int] = []
    ends: list[int] = []
    start, step, size = 0, block_chars, len(text)
    while start + step <= size:
        hasher.update(text[start : start + step].encode())
        keys.append(int.from_bytes(hasher.copy().digest(), "little"))
        start += step
        ends.append(start)
        if len(keys) == max_blocks:
            step = coarse_block_chars
    return tuple(keys), tuple(ends), size


# Rendezvous weights are 64-bit: divided by this, a uniform number in (0, 1).
_TWO_64 = float(1 << 64)


def session_hash(session: str) -> int:
    """A session key's 64-bit hash (never 0, which means no session)."""
    return hash64(session) or 1


# Segments that open a conversation before its first turn (PromptView's role-tagged form).
_PREAMBLE_ROLES = (f"system{ROLE_END}", f"developer{ROLE_END}")


@dataclass(frozen=True, slots=True)
class Opening:
    """Where a prompt's conversation begins: its system prompt, and its first other turn."""

    # Characters of the leading system (and developer) segments.
    preamble_chars: int
    # The index of the first other segment (``len(segments)`` when there is none).
    first_turn: int
    # Whether nothing follows that turn: the prompt is the conversation's first request.
    opens: bool


def opening(segments: Sequence[str]) -> Opening:
    """The system prompt's length and the first turn of ``segments`` (a prompt's role-tagged form)."""
    chars = 0
    for i, segment in enumerate(segments):
        if not segment.startswith(_PREAMBLE_ROLES):
            return Opening(chars, i, i == len(segments) - 1)
        chars += len(segment)
    return Opening(chars, len(segments), True)


def conversation_key(segments: Sequence[str], max_chars: int = 4096, first_turn: int | None = None) -> int:
    """What stands for a conversation's session when the client names none: a hash of its
    opening, up to and with its first turn that is not a system prompt (the last
    ``max_chars`` characters of that: the turn, and the end of the system prompt), so every
    later turn of it gets the same key; 0 for no prompt. ``first_turn``: that turn's index,
    when the caller has it (``opening``)."""
    if not segments:
        return 0
    i = opening(segments).first_turn if first_turn is None else first_turn
    if i < len(segments):
        return session_hash("".join(segments[: i + 1])[-max_chars:])
    return session_hash(segments[-1][:max_chars])


def _argmin(
    candidates: list[Replica], key: Callable[[Replica], tuple[float, float]], rng: random.Random
) -> Replica | None:
    """The candidate with the smallest ``key``; exact ties at random."""
    best: Replica | None = None
    best_key: tuple[float, float, float] | None = None
    for replica in candidates:
        first, second = key(replica)
        k = (first, second, rng.random())
        if best_key is None or k < best_key:
            best, best_key = replica, k
    return best
