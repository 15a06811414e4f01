"""What each replica probably still holds in its prefix cache: the gateway's model of it, evicted like vLLM's.

vLLM keeps the KV blocks of finished requests resident and reuses them for a later request
that starts with the same tokens, until a new allocation evicts them, least recently used
first. The replicas do not say which prefixes they hold; the gateway knows what it sent
where. ``PrefixIndex`` keeps, per replica, the prefix keys (``routing.policies.prefix_keys``)
of what it was sent, in least-recently-used order, each with its size in tokens, and
evicts from the old end once the replica's KV cache (``capacity_tokens``) would overflow:

- each request also fills the cache with what no later request shares (the rest of its
  prompt and its completion): counted as one anonymous entry, so it pushes old prefixes
  out as it does in vLLM, but never matches;
- vLLM frees a finished sequence's blocks tail first, so its deepest blocks are evicted
  before its first ones: a request's entries are refreshed from the tail to the first
  key, and a prefix's first blocks outlive its extensions.

It answers one question: how many leading blocks of a request a replica has probably
cached (``depth``), which is the prefill the request's claim charges that replica, and
what sending it away from a full replica would cost (``routing.pool.Pool``). Placement
does not read it
(``routing.policies.PrefixAffinity`` places by hash, so that pods agree without sharing
this index).

An estimate, not a mirror: another gateway pod's requests fill a replica's cache this index
never hears of, so it errs towards "still cached". With no capacity known, only the key
bound evicts. Pure and synchronous; one per pool.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

# Keys remembered per replica, whatever its capacity: a memory bound. A request contributes
# one key per leading block (up to ``max_blocks`` fine blocks plus the coarse ones), so this
# covers the prefixes of some thousands of recent prompts per replica.
DEFAULT_MAX_KEYS = 16384


class _Held:
    """One replica's cache as the index sees it: key -> tokens, least recently used first."""

    __slots__ = ("entries", "tokens")

    def __init__(self) -> None:
        self.entries: OrderedDict[int, int] = OrderedDict()
        self.tokens = 0


class PrefixIndex:
    """Per replica, the prefix keys it was sent, LRU, bounded by its KV capacity in tokens."""

    __slots__ = ("_anonymous", "_held", "max_keys")

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be at least 1")
        self.max_keys = max_keys
        self._held: dict[str, _Held] = {}
        # Keys of anonymous entries: negative, so they never equal a prefix key (those are >= 0).
        self._anonymous = itertools.count(-1, -1)

    def __len__(self) -> int:
        return sum(len(h.entries) for h in self._held.values())

    def tokens(self, replica_id: str) -> int:
        """Tokens the index counts as resident on ``replica_id``."""
        held = self._held.get(replica_id)
        return held.tokens if held is not None else 0

    def record(
        self,
        keys: Sequence[int],
        sizes: Sequence[int],
        replica_id: str,
        *,
        rest_tokens: int = 0,
        capacity_tokens: int | None = None,
    ) -> None:
        """``replica_id`` was sent a prompt with these keys (``sizes[i]``: tokens of block ``i``).

        ``rest_tokens`` is what else the request leaves in the cache (the unkeyed end of its
        prompt, its completion). Then entries are evicted, oldest first, while the replica
        holds more than ``capacity_tokens`` (None: unknown) or ``max_keys`` keys.
        """
        held = self._held.get(replica_id)
        if held is None:
            held = self._held[replica_id] = _Held()
        entries = held.entries
        if rest_tokens > 0:
            entries[next(self._anonymous)] = rest_tokens
            held.tokens += rest_tokens
        for key, size in zip(reversed(keys), reversed(sizes), strict=True):
            old = entries.get(key)
            if old is None:
                entries[key] = size
                held.tokens += size
            else:
                entries.move_to_end(key)
        while entries and (
            len(entries) > self.max_keys or (capacity_tokens is not None and held.tokens > capacity_tokens)
        ):
            _key, size = entries.popitem(last=False)
            held.tokens -= size

    def depth(self, keys: Sequence[int], replica_id: str) -> int:
        """How many leading keys of ``keys`` ``replica_id`` probably holds (0: none).

        Eviction takes a prefix's deeper blocks first, so the deepest key held stands for
        every key before it.
        """
        held = self._held.get(replica_id)
        if held is None:
            return 0
        entries = held.entries
        for i in range(len(keys) - 1, -1, -1):
            if keys[i] in entries:
                return i + 1
        return 0

    def replicas(self) -> int:
        """How many replicas the index holds entries for."""
        return len(self._held)

    def retain(self, replica_ids: set[str]) -> None:
        """Forget the replicas not in ``replica_ids`` (they left the pool)."""
        for replica_id in [r for r in self._held if r not in replica_ids]:
            del self._held[replica_id]
