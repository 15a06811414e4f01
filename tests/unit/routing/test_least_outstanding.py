"""Least-outstanding-tokens choice."""

from __future__ import annotations

import random

from replicas.replica import Breaker, Claim, Replica, ReplicaState
from routing.least_outstanding import pick_least_outstanding


def replica(rid: str, tokens: int = 0, state: ReplicaState = ReplicaState.HEALTHY) -> Replica:
    r = Replica(rid, f"http://{rid}", "m", "default", "m", False, Breaker(2, 10.0), state=state)
    r.outstanding_tokens = tokens
    return r


def test_fewest_outstanding_tokens_wins() -> None:
    rs = [replica("a", 500), replica("b", 100), replica("c", 300)]
    assert pick_least_outstanding(rs, 0.0, random.Random(1)).id == "b"  # type: ignore[union-attr]


def test_unroutable_and_excluded_are_skipped() -> None:
    rs = [
        replica("a", 0, ReplicaState.DRAINING),
        replica("b", 0, ReplicaState.DOWN),
        replica("c", 900),
        replica("d", 1),
    ]
    assert pick_least_outstanding(rs, 0.0, random.Random(1), exclude={"d"}).id == "c"  # type: ignore[union-attr]
    assert pick_least_outstanding(rs, 0.0, random.Random(1), exclude={"c", "d"}) is None


def test_open_breaker_is_skipped_until_cooldown() -> None:
    a, b = replica("a", 0), replica("b", 50)
    a.breaker.record_failure(now=100.0)
    a.breaker.record_failure(now=100.0)
    assert pick_least_outstanding([a, b], 105.0, random.Random(1)).id == "b"  # type: ignore[union-attr]
    # after the 10 s cooldown, one trial is let through (half-open)
    assert pick_least_outstanding([a, b], 110.0, random.Random(1)).id == "a"  # type: ignore[union-attr]


def test_ties_are_spread() -> None:
    rs = [replica("a"), replica("b"), replica("c")]
    rng = random.Random(7)
    picks = {pick_least_outstanding(rs, 0.0, rng).id for _ in range(50)}  # type: ignore[union-attr]
    assert picks == {"a", "b", "c"}


def test_claim_pays_off_as_tokens_arrive() -> None:
    r = replica("a")
    claim = Claim(r, prompt=100, completion=20)
    assert (r.outstanding_tokens, r.outstanding_requests) == (120, 1)
    claim.prefilled()
    assert r.outstanding_tokens == 20
    claim.generated(5)
    assert r.outstanding_tokens == 15
    claim.generated(50)  # never below what was claimed
    assert r.outstanding_tokens == 0
    claim.release()
    claim.release()  # idempotent
    assert (r.outstanding_tokens, r.outstanding_requests) == (0, 0)


def test_release_returns_the_unpaid_rest() -> None:
    r = replica("a")
    claim = Claim(r, prompt=100, completion=20)
    claim.release()
    assert (r.outstanding_tokens, r.outstanding_requests) == (0, 0)
