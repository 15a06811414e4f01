"""The exact index: engine hashes mapped onto the gateway's own chain, bounds, gaps and restarts."""

from __future__ import annotations

from replicas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KvEvent
from routing.kv_index import KvIndex, ReplicaBlocks, Sync, chain_hashes

BS = 4


def stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: object) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), BS, medium="GPU", **kw)  # type: ignore[arg-type]


def batch(seq: int, *events: KvEvent) -> EventBatch:
    return EventBatch(seq, float(seq), tuple(events))


PROMPT = list(range(100, 114))  # 3 full blocks of 4 and 2 tokens left over


def test_chain_hashes_cover_full_blocks_and_depend_on_everything_before() -> None:
    a = chain_hashes(PROMPT, BS)
    assert len(a) == 3
    b = chain_hashes([*PROMPT[:4], 0, *PROMPT[5:]], BS)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]
    assert chain_hashes(PROMPT, BS, "sql")[0] != a[0]  # an adapter's blocks are other blocks
    assert chain_hashes(PROMPT[:3], BS) == []


def test_stored_blocks_are_read_exactly_in_tokens() -> None:
    index = KvIndex()
    r = index.replica("r0")
    # The engine stores the first two blocks, then the third as a child of the second.
    assert r.apply(batch(0, stored([11, 12], None, PROMPT[:8])), now=1.0) is Sync.NEXT
    assert index.cached_tokens(PROMPT, "r0") == 8
    r.apply(batch(1, stored([13], 12, PROMPT[8:12])), now=2.0)
    assert index.cached_tokens(PROMPT, "r0") == 12
    assert index.cached_tokens([*PROMPT[:4], 7, 7, 7, 7], "r0") == 4  # shares only the first block
    assert index.cached_tokens(PROMPT, "r0", lora_name="sql") == 0
    assert index.cached_tokens(PROMPT, "other") is None  # no events: the estimate stays


def test_removal_cuts_the_prefix_at_the_hole_and_clear_empties() -> None:
    r = ReplicaBlocks()
    r.apply(batch(0, stored([11, 12, 13], None, PROMPT[:12])), now=0.0)
    r.apply(batch(1, BlockRemoved((12,), "GPU")), now=0.0)
    assert r.cached_blocks(chain_hashes(PROMPT, BS)) == 1
    r.apply(batch(2, AllBlocksCleared()), now=0.0)
    assert len(r) == 0 and r.cached_blocks(chain_hashes(PROMPT, BS)) == 0


def test_blocks_of_an_offloading_tier_or_with_extra_keys_are_not_indexed() -> None:
    r = ReplicaBlocks()
    r.apply(batch(0, BlockStored((11,), None, tuple(PROMPT[:4]), BS, medium="CPU")), now=0.0)
    r.apply(batch(1, stored([21], None, PROMPT[:4], extra_keys=(("img", 0),))), now=0.0)
    assert len(r) == 0


def test_a_child_whose_parent_is_unknown_is_not_indexed() -> None:
    r = ReplicaBlocks()
    r.apply(batch(0, stored([13], 99, PROMPT[8:12])), now=0.0)
    assert len(r) == 0 and r.stats.unlinked == 1


def test_the_memory_bound_drops_the_least_recently_stored() -> None:
    r = ReplicaBlocks(max_blocks=2)
    r.apply(batch(0, stored([11, 12, 13], None, PROMPT[:12])), now=0.0)
    assert len(r) == 2 and r.stats.evicted == 1
    # The first block went: nothing of the prompt reads as cached any more (a prefix from its start).
    assert r.cached_blocks(chain_hashes(PROMPT, BS)) == 0


def test_a_gap_clears_the_replica_and_makes_it_not_exact() -> None:
    index = KvIndex()
    r = index.replica("r0")
    r.apply(batch(0, stored([11], None, PROMPT[:4])), now=0.0)
    assert r.exact
    assert r.apply(batch(2, stored([12], 11, PROMPT[4:8])), now=1.0) is Sync.GAP
    assert not r.exact and r.stats.gaps == 1
    assert index.cached_tokens(PROMPT, "r0") is None  # the estimate is read until a resync
    # A replay from 0 that is whole makes it exact again, with every block.
    exact = r.rebuild(
        [batch(0, stored([11], None, PROMPT[:4])), batch(1, stored([12], 11, PROMPT[4:8])), batch(2)], now=2.0
    )
    assert exact and r.last_seq == 2 and r.stats.resyncs == 1
    assert index.cached_tokens(PROMPT, "r0") == 8
    assert r.apply(batch(3), now=3.0) is Sync.NEXT


def test_a_replay_that_no_longer_starts_at_zero_stays_not_exact() -> None:
    r = ReplicaBlocks()
    assert not r.rebuild([batch(5, stored([11], None, PROMPT[:4])), batch(6)], now=0.0)
    assert len(r) == 1 and r.last_seq == 6
    assert not r.rebuild([batch(0), batch(2)], now=0.0)  # a hole in the replay


def test_first_batch_after_subscribing_late_is_a_gap() -> None:
    r = ReplicaBlocks()
    assert r.apply(batch(7, stored([11], None, PROMPT[:4])), now=0.0) is Sync.GAP
    assert not r.exact


def test_a_restarted_engine_clears_the_replica() -> None:
    index = KvIndex()
    r = index.replica("r0")
    for seq in range(5):
        r.apply(
            batch(seq, stored([10 + seq], None if seq == 0 else 10 + seq - 1, PROMPT[4 * seq : 4 * seq + 4])), now=0.0
        )
    assert r.apply(batch(0, stored([77], None, [1, 2, 3, 4])), now=1.0) is Sync.RESTART
    assert r.exact and r.stats.restarts == 1 and len(r) == 1
    assert index.cached_tokens(PROMPT, "r0") == 0
    assert index.cached_tokens([1, 2, 3, 4], "r0") == 4


def test_a_replayed_batch_already_applied_is_ignored() -> None:
    r = ReplicaBlocks()
    r.apply(batch(0, stored([11], None, PROMPT[:4])), now=0.0)
    r.apply(batch(1), now=0.0)
    assert r.apply(batch(1, BlockRemoved((11,), "GPU")), now=0.0) is Sync.STALE
    assert len(r) == 1


def test_describe_reports_each_replica() -> None:
    index = KvIndex()
    index.replica("r0").apply(batch(0, stored([11], None, PROMPT[:4])), now=0.0)
    d = index.describe()["r0"]
    assert d["exact"] is True and d["blocks"] == 1 and d["last_seq"] == 0 and d["block_size"] == BS


def test_a_route_request_reads_exact_numbers_where_events_are_in_use_and_the_estimate_elsewhere() -> None:
    from routing.policies import RouteRequest
    from routing.prefix_index import PrefixIndex

    kv = KvIndex()
    kv.replica("r0").apply(batch(0, stored([11, 12], None, PROMPT[:8])), now=0.0)
    estimate = PrefixIndex()
    estimate.record((1, 2), (7, 7), "r1")
    request = RouteRequest((1, 2), 14, 10, (100, 200), 200, exact=kv.request(PROMPT))
    assert request.cached_on("r0", estimate) == 8  # exact: two blocks of 4
    assert request.uncached_on("r0", estimate) == 14 - 8
    assert request.cached_on("r1", estimate) == 14 - 1  # the estimate: both keys, all but the last token
    assert request.uncached_on("r2", estimate) == 14  # nothing known
    whole = RouteRequest((), 8, 1, exact=kv.request(PROMPT[:8]))
    assert whole.uncached_on("r0", None) == 1  # a whole prompt cached still computes its last token


def test_an_engine_that_published_nothing_is_exact_and_empty() -> None:
    index = KvIndex()
    r = index.replica("r0")
    assert index.cached_tokens(PROMPT, "r0") is None  # nothing known yet
    r.start_empty(now=0.0)
    assert index.cached_tokens(PROMPT, "r0") == 0
    assert r.apply(batch(0, stored([11], None, PROMPT[:4])), now=1.0) is Sync.NEXT
    assert index.cached_tokens(PROMPT, "r0") == 4
    r.start_empty(now=2.0)  # a late empty replay changes nothing once batches were applied
    assert index.cached_tokens(PROMPT, "r0") == 4


def test_a_clear_of_the_whole_cache_makes_a_late_subscriber_exact() -> None:
    """A pod that joined after the buffer moved on is exact again from the engine's cache reset."""
    index = KvIndex()
    r = index.replica("r0")
    assert r.apply(batch(40, stored([11], None, PROMPT[:4])), now=0.0) is Sync.GAP
    assert not r.exact
    assert r.apply(batch(41, AllBlocksCleared(), stored([21], None, PROMPT[:4])), now=1.0) is Sync.NEXT
    assert r.exact and index.cached_tokens(PROMPT, "r0") == 4
    # A gap whose own batch clears first is exact at once; one that does not clear is not.
    assert r.apply(batch(50, AllBlocksCleared(), stored([31], None, PROMPT[:4])), now=2.0) is Sync.GAP
    assert r.exact and len(r) == 1
    assert r.apply(batch(60, stored([32], 31, PROMPT[4:8])), now=3.0) is Sync.GAP
    assert not r.exact


def test_a_replay_is_exact_from_its_last_clear_on_with_no_hole_after_it() -> None:
    r = ReplicaBlocks()
    cleared = [
        batch(5, stored([11], None, PROMPT[:4])),
        batch(6, AllBlocksCleared()),
        batch(7, stored([12], None, PROMPT[:4])),
    ]
    assert r.rebuild(cleared, now=0.0) and len(r) == 1 and r.last_seq == 7
    assert not r.rebuild([batch(5), batch(6, AllBlocksCleared()), batch(8)], now=0.0)  # a hole after the clear
    assert r.rebuild([batch(0), batch(2), batch(3, AllBlocksCleared()), batch(4)], now=0.0)  # the hole is before it
