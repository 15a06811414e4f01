"""The prefix index: where prefixes were sent, deepest matches, LRU forgetting."""

from __future__ import annotations

import pytest

from replicas.replica import Breaker, Replica, ReplicaState
from routing.prefix_index import PrefixIndex


def replica(rid: str) -> Replica:
    return Replica(rid, f"http://{rid}", "m", "default", "m", False, Breaker(2, 10.0), state=ReplicaState.HEALTHY)


def test_depth_is_the_longest_recorded_prefix() -> None:
    index = PrefixIndex()
    index.record((1, 2, 3), "a")
    assert index.depth((1, 2, 3, 4, 5), "a") == 3
    assert index.depth((1, 2, 9), "a") == 2
    assert index.depth((7, 8), "a") == 0
    assert index.depth((1, 2, 3), "b") == 0


def test_warmest_holds_the_deepest_match_of_at_least_min_depth() -> None:
    a, b, c = replica("a"), replica("b"), replica("c")
    index = PrefixIndex()
    index.record((1, 2), "a")
    index.record((1, 2, 3, 4), "b")
    index.record((1, 2, 3, 4), "c")
    assert index.warmest((1, 2, 3, 4, 5), [a, b, c], 1) == ([b, c], 4)
    assert index.warmest((1, 2, 3, 4, 5), [a, b], 1) == ([b], 4)  # only among the candidates
    assert index.warmest((1, 2, 9), [a, b, c], 2) == ([a, b, c], 2)
    assert index.warmest((1, 9), [a, b, c], 2) == ([], 0)  # one shared key is below the minimum
    assert index.warmest((1, 2, 3), [a], 3) == ([], 0)


def test_least_recently_sent_keys_are_forgotten_first() -> None:
    index = PrefixIndex(max_keys=4)
    index.record((1, 2), "a")
    index.record((3, 4), "b")
    index.record((1, 2), "c")  # refreshes 1 and 2
    index.record((5,), "a")  # over the bound: 3 goes first, then nothing else
    assert len(index) == 4
    assert index.depth((3,), "b") == 0 and index.depth((3, 4), "b") == 2  # 4 is still there
    assert index.depth((1, 2), "a") == 2 and index.depth((1, 2), "c") == 2


def test_needs_room_for_one_key() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(max_keys=0)
