"""Where each prompt prefix was sent recently: the gateway's estimate of the replicas' prefix caches.

vLLM keeps the KV blocks of finished requests resident and reuses them for a later request
that starts with the same tokens, so a request sent where its prefix was sent before skips
most of its prefill. The replicas do not say which prefixes they hold; the gateway knows
where it sent each one. ``PrefixIndex`` remembers, for the most recent ``max_keys`` prefix
keys (``routing.policies.prefix_keys``), the replicas each was sent to, and answers two
questions for a request and a replica:

- how many leading characters of the prompt that replica has probably cached (``matched``);
- which replicas hold the longest such prefix (``warmest``), for prefix affinity.

An estimate, not a mirror: a replica evicts under KV pressure what the index still lists,
and another gateway pod's requests warm replicas this index never hears of. Both errors
only cost some prefill, never correctness. Pure and synchronous; one per pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from replicas.replica import Replica

# Remembered keys per pool. A request contributes one key per leading block (at most
# ``max_blocks`` fine blocks plus the coarse ones), so this covers some thousands of
# recent prompts: the working set of prefixes that can still be in the replicas' caches.
DEFAULT_MAX_KEYS = 65536


class PrefixIndex:
    """Recently sent prefix keys -> the ids of the replicas they were sent to (LRU)."""

    __slots__ = ("_keys", "max_keys")

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be at least 1")
        self.max_keys = max_keys
        self._keys: OrderedDict[int, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def record(self, keys: Sequence[int], replica_id: str) -> None:
        """``replica_id`` was sent a prompt with these keys: it holds them now (and they are the freshest)."""
        index = self._keys
        for key in keys:
            holders = index.get(key)
            if holders is None:
                index[key] = {replica_id}
            else:
                holders.add(replica_id)
                index.move_to_end(key)
        while len(index) > self.max_keys:
            index.popitem(last=False)

    def depth(self, keys: Sequence[int], replica_id: str) -> int:
        """How many leading keys of ``keys`` ``replica_id`` holds (0: none)."""
        index = self._keys
        for i in range(len(keys) - 1, -1, -1):
            holders = index.get(keys[i])
            if holders is not None and replica_id in holders:
                return i + 1
        return 0

    def warmest(self, keys: Sequence[int], candidates: Sequence[Replica], min_depth: int) -> tuple[list[Replica], int]:
        """The candidates holding the deepest prefix of ``keys`` at least ``min_depth`` keys long, and that depth.

        Walks from the deepest key down and stops at the first one some candidate holds:
        one dict lookup per key for a prompt nobody has seen.
        """
        index = self._keys
        for i in range(len(keys) - 1, max(min_depth, 1) - 2, -1):
            holders = index.get(keys[i])
            if holders:
                warm = [r for r in candidates if r.id in holders]
                if warm:
                    return warm, i + 1
        return [], 0
