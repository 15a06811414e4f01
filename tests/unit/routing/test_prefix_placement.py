"""Homes for the prefixes in use: balanced, a function of the set alone, and moving little."""

from __future__ import annotations

import random

import pytest

from routing.prefix_placement import AnchorPlacement, address_seed, rendezvous_weight

TWO = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
FOUR = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


def use(placement: AnchorPlacement, anchors: list[int], members: list[str], now: float, times: int = 2) -> None:
    for _ in range(times):
        for anchor in anchors:
            placement.home(anchor, members, now)


def keys(n: int) -> list[int]:
    return [random.Random(i).getrandbits(64) for i in range(n)]


def test_the_order_is_by_rendezvous_weight() -> None:
    order = AnchorPlacement().order(42, FOUR)
    weights = [rendezvous_weight(42, address_seed(m)) for m in order]
    assert weights == sorted(weights, reverse=True) and sorted(order) == sorted(FOUR)


def test_a_prefix_seen_once_goes_to_its_first_choice_and_is_not_kept() -> None:
    placement = AnchorPlacement(refresh_s=0.0)
    assert placement.home(7, TWO, 0.0) == placement.order(7, TWO)[0]
    assert placement.homes() == {}
    placement.home(7, TWO, 1.0)  # the second use: in use, homed
    assert placement.homes() == {7: placement.order(7, TWO)[0]}


def test_a_retry_is_not_one_more_use() -> None:
    placement = AnchorPlacement(refresh_s=0.0)
    placement.home(7, TWO, 0.0)
    placement.home(7, TWO, 1.0, seen=False)
    assert placement.homes() == {}


def test_the_working_set_is_split_evenly_where_a_hash_would_not() -> None:
    anchors = list(range(1000, 1032))
    placement = AnchorPlacement(refresh_s=0.0, slack=0.0)
    firsts = [placement.order(a, TWO)[0] for a in anchors]
    assert sorted(firsts.count(m) for m in TWO) == [13, 19]
    use(placement, anchors, TWO, 0.0)
    use(placement, anchors[:1], TWO, 5.0)  # a last pass with every prefix in use
    homes = placement.homes()
    assert sorted(list(homes.values()).count(m) for m in TWO) == [16, 16]
    # Only the excess of the replica the hash favoured moved.
    assert sum(homes[a] != f for a, f in zip(anchors, firsts, strict=True)) == 19 - 16


def test_the_default_splits_evenly_and_a_slack_corrects_only_what_a_hash_rarely_does() -> None:
    """By default 16 of 32 on each of 2 replicas; with slack 0.5, the mean plus half a hash's spread: 18."""
    anchors = list(range(1000, 1032))
    for slack, split in ((None, [16, 16]), (0.5, [14, 18])):
        placement = AnchorPlacement(refresh_s=0.0) if slack is None else AnchorPlacement(refresh_s=0.0, slack=slack)
        use(placement, anchors, TWO, 0.0)
        use(placement, anchors[:1], TWO, 5.0)
        assert sorted(list(placement.homes().values()).count(m) for m in TWO) == split, slack


def test_pods_that_saw_the_same_prefixes_in_another_order_agree() -> None:
    anchors = keys(200)
    pod1, pod2 = AnchorPlacement(refresh_s=0.0), AnchorPlacement(refresh_s=0.0)
    use(pod1, anchors, FOUR, 0.0)
    shuffled = list(anchors)
    random.Random(1).shuffle(shuffled)
    use(pod2, shuffled, list(reversed(FOUR)), 0.0)
    for pod in (pod1, pod2):
        pod.home(anchors[0], FOUR, 5.0)  # a pass over the same set
    assert pod1.homes() == pod2.homes()
    counts = [list(pod1.homes().values()).count(m) for m in FOUR]
    assert max(counts) <= 50 + 0.5 * 50**0.5 + 1


def test_one_more_prefix_moves_at_most_one_other() -> None:
    anchors = keys(41)
    placement = AnchorPlacement(refresh_s=0.0, slack=0.0)
    use(placement, anchors[:40], FOUR, 0.0)
    use(placement, anchors[:1], FOUR, 1.0)
    before = placement.homes()
    use(placement, anchors[40:], FOUR, 2.0)
    use(placement, anchors[:1], FOUR, 3.0)
    after = placement.homes()
    assert sum(before[a] != after[a] for a in before) <= 1


def test_between_passes_a_new_prefix_in_use_goes_to_its_first_choice() -> None:
    """Passes wait ``refresh_s``; meanwhile a new prefix takes its first choice, full or not.

    The pass then moves the least attached of a full replica's prefixes, by weight, which is
    what every pod computes alike whatever order it saw the prefixes in.
    """
    placement = AnchorPlacement(refresh_s=2.0, slack=0.0)
    first = {a: placement.order(a, TWO)[0] for a in range(100)}
    a, b = [k for k in range(100) if first[k] == TWO[0]][:2]
    placement.home(a, TWO, 0.0)  # a pass at once (new members), before a was in use
    placement.home(a, TWO, 0.1)  # in use: homed on its first choice until the next pass
    placement.home(b, TWO, 0.2)
    assert placement.home(b, TWO, 0.3) == TWO[0]  # in use, on its first choice, over the bound
    assert placement.homes() == {a: TWO[0], b: TWO[0]}
    placement.home(a, TWO, 2.5)  # the pass: one each, the lighter of the two moved
    homes = placement.homes()
    assert sorted(homes.values()) == sorted(TWO)
    lighter = min((a, b), key=lambda k: placement.weight(k, TWO[0]))
    assert homes[lighter] == TWO[1]


def test_two_pods_that_saw_the_same_prefixes_in_other_orders_agree() -> None:
    anchors = keys(40)
    pods = [AnchorPlacement(refresh_s=1.0), AnchorPlacement(refresh_s=1.0)]
    orders = [anchors, anchors[::-1]]
    for pod, order in zip(pods, orders, strict=True):
        for t, anchor in enumerate(order + order):
            pod.home(anchor, FOUR, t * 0.01)  # all within one refresh: homes between passes
    assert pods[0].homes() == pods[1].homes()
    for pod in pods:
        pod.home(anchors[0], FOUR, 5.0)  # the pass
    assert pods[0].homes() == pods[1].homes()


def test_new_replicas_take_their_share_and_a_departed_ones_prefixes_spread() -> None:
    anchors = keys(90)
    placement = AnchorPlacement(refresh_s=0.0)
    use(placement, anchors, FOUR[:3], 0.0)
    three = placement.homes()
    placement.home(anchors[0], FOUR, 1.0)  # the pool grew: placed again at once
    four = placement.homes()
    counts = sorted(list(four.values()).count(m) for m in FOUR)
    assert sum(counts) == 90 and counts[-1] <= 25  # 22.5 + 0.5 * sqrt(22.5), rounded up
    # Consistent hashing: mostly the prefixes whose first choice is the new replica moved.
    assert sum(three[a] != four[a] for a in anchors) <= 30
    placement.home(anchors[0], FOUR[1:], 2.0)  # 10.0.0.1 left
    assert set(placement.homes().values()) == set(FOUR[1:])


def test_prefixes_out_of_use_are_forgotten() -> None:
    placement = AnchorPlacement(refresh_s=0.0, window_s=60.0)
    use(placement, [1, 2], TWO, 0.0)
    use(placement, [3], TWO, 100.0)  # 1 and 2 last seen 100 s ago
    assert set(placement.homes()) == {3}
    assert len(placement) == 1


def test_memory_is_bounded() -> None:
    placement = AnchorPlacement(refresh_s=0.0, max_anchors=10)
    use(placement, list(range(100)), TWO, 0.0, times=1)
    assert len(placement) == 10


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        AnchorPlacement(factor=0.5)
    with pytest.raises(ValueError):
        AnchorPlacement(slack=-1)


# --- hot prefixes ----------------------------------------------------------------------


def test_a_hot_prefix_gets_as_many_homes_as_its_share_calls_for() -> None:
    """Shares over 8 replicas: 40% of placements -> ceil(0.4 x 8 / 0.5) = 7 homes; 5% -> 1."""
    placement = AnchorPlacement(hot_share=0.5, refresh_s=0.0)  # parts worked out at every call
    hot, *cold = keys(13)
    eight = [f"http://10.0.1.{i}:8000" for i in range(8)]
    for step in range(40):  # 8 hot placements for every 12 cold ones
        now = step * 0.01
        for _ in range(8):
            placement.homes_of(hot, eight, now)
        for anchor in cold:
            placement.homes_of(anchor, eight, now)
    share = placement.share(hot, 0.4)
    assert share == pytest.approx(8 / 20, abs=0.01)
    homes = placement.homes_of(hot, eight, 0.4, seen=False)
    assert len(homes) == 7
    # The first home is the pass's; the others follow the prefix's rendezvous order.
    first = placement.homes()[hot]
    assert list(homes) == [first, *[m for m in placement.order(hot, eight) if m != first][:6]]
    # Its parts fill what the cold prefixes (12 x 5%) leave of each home's fair share (1/8).
    loads = {m: 0.0 for m in eight}
    for anchor in cold:
        (home,) = placement.homes_of(anchor, eight, 0.4, seen=False)
        loads[home] += placement.share(anchor, 0.4)
    rooms = {m: max(1 / 8 - loads[m], 0.05 / 8) for m in homes}
    assert homes == pytest.approx({m: r / sum(rooms.values()) for m, r in rooms.items()})
    assert sum(homes.values()) == pytest.approx(1.0)


def test_pods_with_the_same_traffic_in_another_order_agree_on_the_homes() -> None:
    traffic = [a for a, n in zip(keys(6), (30, 10, 5, 5, 3, 3), strict=True) for _ in range(n)]
    shuffled = list(traffic)
    random.Random(3).shuffle(shuffled)
    pods = [AnchorPlacement(), AnchorPlacement()]
    for pod, order in zip(pods, (traffic, shuffled), strict=True):
        for i, anchor in enumerate(order):
            pod.homes_of(anchor, FOUR, i * 0.001)
        pod.homes_of(order[0], FOUR, 10.0, seen=False)  # a pass after the same set
    for anchor in set(traffic):
        ours, theirs = (pod.homes_of(anchor, FOUR, 10.0, seen=False) for pod in pods)
        # The same homes in the same order; parts as alike as the decayed counts (the same
        # placements, decayed from other moments).
        assert list(ours) == list(theirs) and ours == pytest.approx(theirs, abs=1e-3)
    assert max(len(pods[0].homes_of(a, FOUR, 10.0, seen=False)) for a in traffic) > 1


def test_the_spread_follows_the_share_both_ways() -> None:
    """Two replicas: a share above 1/4 spreads a prefix to both; below it, one home again."""
    placement = AnchorPlacement(hot_share=0.5, rate_window_s=1e9)  # no decay: shares are counts
    hot, a, b, c, d = keys(5)
    for _ in range(12):
        for anchor in (hot, a, b):
            placement.homes_of(anchor, TWO, 0.0)
    assert len(placement.homes_of(hot, TWO, 0.0)) == 2  # 13 of 37
    for _ in range(12):
        for anchor in (a, b, c, d):
            placement.homes_of(anchor, TWO, 0.0)
    assert len(placement.homes_of(hot, TWO, 0.0)) == 1  # 14 of 86


def test_a_few_placements_spread_nothing() -> None:
    placement = AnchorPlacement()
    (anchor,) = keys(1)
    assert [len(placement.homes_of(anchor, FOUR, 0.0)) for _ in range(31)] == [1] * 31
    assert len(placement.homes_of(anchor, FOUR, 0.0)) == 4  # 32 placements, all of this prefix
