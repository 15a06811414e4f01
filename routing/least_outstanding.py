"""Least-outstanding-tokens replica choice.

A replica's outstanding tokens are the prompt tokens it has not prefilled yet plus the
completion tokens it still owes to this gateway's in-flight requests. Tokens, not
requests: one 8k-token prompt loads a GPU more than ten short chats.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence

from replicas.replica import Replica


def pick_least_outstanding(
    replicas: Sequence[Replica],
    now: float,
    rng: random.Random,
    exclude: Collection[str] = (),
) -> Replica | None:
    """The routable replica with the fewest outstanding tokens (then requests); ties at random."""
    best: Replica | None = None
    best_key: tuple[int, int, float] | None = None
    for replica in replicas:
        if replica.id in exclude or not replica.routable(now):
            continue
        key = (replica.outstanding_tokens, replica.outstanding_requests, rng.random())
        if best_key is None or key < best_key:
            best, best_key = replica, key
    return best
