"""Tier -> model: own models, the nearest-tier rule, smaller tiers for overflow."""

from __future__ import annotations

from routing.classifier import DEFAULT_TIERS, TierRange
from routing.tier_map import TierMap

FIVE = (
    TierRange("xs", 0.0, 0.2),
    TierRange("s", 0.2, 0.4),
    TierRange("m", 0.4, 0.6),
    TierRange("l", 0.6, 0.8),
    TierRange("xl", 0.8, 1.0),
)


def test_each_tier_served_by_its_first_model() -> None:
    tiers = TierMap(DEFAULT_TIERS, [("s1", "small"), ("m1", "medium"), ("l1", "large"), ("l2", "large")])
    assert tiers.active
    assert [tiers.model_for(n) for n in ("small", "medium", "large")] == ["s1", "m1", "l1"]


def test_tier_without_model_borrows_nearest_larger_on_a_tie() -> None:
    # medium has no model: small and large are both one tier away; the larger wins.
    tiers = TierMap(DEFAULT_TIERS, [("s1", "small"), ("l1", "large")])
    assert tiers.model_for("medium") == "l1"


def test_nearest_counts_distance_in_tiers() -> None:
    # xs, s empty: s is one from m (model), xs is two from m -> both m1. xl is one from l.
    tiers = TierMap(FIVE, [("m1", "m"), ("l1", "l")])
    assert [tiers.model_for(t.name) for t in FIVE] == ["m1", "m1", "m1", "l1", "l1"]


def test_inactive_when_no_model_serves_any_tier() -> None:
    tiers = TierMap(DEFAULT_TIERS, [("only", "default")])
    assert not tiers.active
    assert tiers.model_for("small") is None


def test_smaller_lists_lower_tiers_nearest_first_without_duplicates() -> None:
    tiers = TierMap(FIVE, [("xs1", "xs"), ("m1", "m"), ("xl1", "xl")])
    # l borrows xl1 (one up, a tie with m broken upwards); s borrows m1 (the same tie).
    assert tiers.model_for("l") == "xl1"
    assert tiers.model_for("s") == "m1"
    assert tiers.smaller("xl") == ["m1", "xs1"]
    assert tiers.smaller("xs") == []
    assert tiers.smaller("unknown") == []
