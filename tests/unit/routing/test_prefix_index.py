"""The prefix index: what each replica probably still caches, evicted in tokens like vLLM's cache."""

from __future__ import annotations

import pytest

from routing.prefix_index import PrefixIndex


def test_depth_is_the_longest_recorded_prefix() -> None:
    index = PrefixIndex()
    index.record((1, 2, 3), (10, 10, 10), "a")
    assert index.depth((1, 2, 3, 4, 5), "a") == 3
    assert index.depth((1, 2, 9), "a") == 2
    assert index.depth((7, 8), "a") == 0
    assert index.depth((1, 2, 3), "b") == 0


def test_each_replica_counts_its_own_tokens() -> None:
    index = PrefixIndex()
    index.record((1, 2), (64, 64), "a", rest_tokens=100)
    index.record((1, 2), (64, 64), "b")
    index.record((1, 2, 3), (64, 64, 64), "a", rest_tokens=50)  # 1 and 2 are there already
    assert index.tokens("a") == 64 * 3 + 100 + 50
    assert index.tokens("b") == 128
    assert len(index) == 5 + 2  # a: three keys and two anonymous entries; b: two keys


def test_a_full_cache_evicts_the_least_recently_used_first() -> None:
    index = PrefixIndex()
    capacity = 300
    index.record((1, 2), (100, 100), "a", capacity_tokens=capacity)  # prefix P
    index.record((5, 6), (100, 100), "a", capacity_tokens=capacity)  # prefix Q: 400 > 300, P's tail goes
    assert index.depth((1, 2), "a") == 1 and index.depth((5, 6), "a") == 2
    assert index.tokens("a") == 300
    index.record((1,), (100,), "a", capacity_tokens=capacity)  # P again: its first block is the freshest now
    index.record((8,), (100,), "a", capacity_tokens=capacity)  # evicts Q's tail (6), then nothing more
    assert index.depth((1, 2), "a") == 1
    assert index.depth((5, 6), "a") == 1
    assert index.depth((8,), "a") == 1


def test_what_no_request_shares_still_pushes_prefixes_out() -> None:
    """A request's unkeyed end and completion fill the cache, evicted before its prefix."""
    index = PrefixIndex()
    index.record((1, 2), (100, 100), "a", rest_tokens=150, capacity_tokens=350)
    assert index.depth((1, 2), "a") == 2 and index.tokens("a") == 350
    index.record((3,), (100,), "a", capacity_tokens=350)  # the anonymous 150 go first
    assert index.depth((1, 2), "a") == 2 and index.tokens("a") == 300
    index.record((4,), (100,), "a", capacity_tokens=350)  # then the deepest block of the oldest prefix
    assert index.depth((1, 2), "a") == 1 and index.depth((3,), "a") == 1


def test_without_a_capacity_only_the_key_bound_evicts() -> None:
    index = PrefixIndex(max_keys=4)
    index.record((1, 2), (10**6, 10**6), "a")
    index.record((3, 4), (1, 1), "a")
    index.record((1, 2), (1, 1), "a")  # refreshes 1 and 2
    index.record((5,), (1,), "a")  # over the bound: 4 goes first (deeper than 3)
    assert index.depth((3, 4), "a") == 1 and index.depth((1, 2), "a") == 2 and index.depth((5,), "a") == 1


def test_replicas_that_left_are_forgotten() -> None:
    index = PrefixIndex()
    index.record((1,), (10,), "a")
    index.record((1,), (10,), "b")
    assert index.replicas() == 2
    index.retain({"b"})
    assert index.replicas() == 1 and index.depth((1,), "a") == 0 and index.depth((1,), "b") == 1


def test_sizes_match_keys() -> None:
    with pytest.raises(ValueError):
        PrefixIndex().record((1, 2), (10,), "a")


def test_needs_room_for_one_key() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(max_keys=0)
