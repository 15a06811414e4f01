"""Each request's ``Route`` (``routing.route``): the fallback chain, the retry budget, the
prefix index and claims, why there is no next attempt, and the access-log fields."""

from __future__ import annotations

from replicas.replica import Replica, ReplicaState
from routing.config import RetryBudgetSettings
from routing.route import DEADLINE, EXHAUSTED, NO_REPLICA, RETRY_BUDGET, Stop
from routing.router import PoolSpec
from tests.unit.routing.test_router import SYSTEM, build, chat, replica
from tests.unit.routing.test_tiers import HARD, TIERED, TIERED_REPLICAS


def test_fallback_chain_after_the_pool_is_exhausted() -> None:
    rs = {"big": [replica("big", 0)], "mid": [replica("mid", 0)], "small": [replica("small", 0)]}
    specs = [PoolSpec("big", "large", ("mid", "small")), PoolSpec("mid", "medium"), PoolSpec("small", "small")]
    router, registry = build(specs, rs)
    route = router.route("big", chat("hi"), 10, 10)
    assert route({"x"}).id == "big-0"  # type: ignore[union-attr]
    assert route({"big-0"}).id == "mid-0"  # type: ignore[union-attr]
    assert route({"big-0", "mid-0"}).id == "small-0"  # type: ignore[union-attr]
    assert route({"big-0", "mid-0", "small-0"}) is None
    entry: dict[str, object] = {}
    route.annotate(entry)
    assert entry["fallback"] == "small"
    # counted once per request, for the first fallback model that served
    assert registry.get_sample_value("fleetgate_routing_fallbacks_total", {"model": "big", "fallback": "mid"}) == 1


def test_fallback_when_no_replica_of_the_pool_is_routable() -> None:
    rs = {"big": [replica("big", 0, ReplicaState.DOWN)], "mid": [replica("mid", 0)]}
    router, _ = build([PoolSpec("big", "large", ("mid",)), PoolSpec("mid", "medium")], rs)
    assert router.route("big", chat("hi"), 10, 10)(set()).id == "mid-0"  # type: ignore[union-attr]


def test_retry_budget_limits_retries_and_says_so() -> None:
    rs = {"m": [replica("m", 0), replica("m", 1)]}
    router, registry = build(
        [PoolSpec("m", "t")], rs, retry_budget=RetryBudgetSettings(ratio=0.0, min_per_s=0.0, burst=1.0)
    )
    a, b = router.route("m", chat("hi"), 10, 10), router.route("m", chat("hi"), 10, 10)
    assert a.may_retry()
    assert not b.may_retry()
    assert not b.may_retry()
    entry: dict[str, object] = {}
    b.annotate(entry)
    assert entry["retry_budget"] == "exhausted"
    assert registry.get_sample_value("fleetgate_retry_budget_exhausted_total", {"model": "m"}) == 1


def test_first_pick_deposits_into_the_budget() -> None:
    rs = {"m": [replica("m", 0)]}
    router, _ = build([PoolSpec("m", "t")], rs, retry_budget=RetryBudgetSettings(ratio=0.5, min_per_s=0.0, burst=5))
    budget = router.pools["m"].budget
    while budget.withdraw(0.0):
        pass
    route = router.route("m", chat("hi"), 10, 10)
    route(set())
    route(set())  # a second pick of the same request deposits nothing more
    assert budget.balance == 0.5


def test_claims_charge_the_uncached_prompt_and_free_prefill_room_at_the_first_token() -> None:
    r = replica("m", 0)
    router, _ = build([PoolSpec("m", "t")], {"m": [r]})
    body = chat("a first question", system=SYSTEM)
    first = router.route("m", body, 1000, 10)
    assert first(set()) is r
    claim = first.claim(r, streamed=True)
    assert (r.prefill_requests, r.prefill_tokens, r.outstanding_tokens) == (1, 1000, 1010)  # nothing cached yet
    shown = r.snapshot(0.0)  # what /admin/fleet shows operators
    assert (shown["prefill_requests"], shown["prefill_tokens"]) == (1, 1000)
    claim.prefilled()
    assert (r.prefill_requests, r.prefill_tokens, r.outstanding_tokens) == (0, 0, 10)
    claim.release()
    # Same system prompt again: most of it is cached on r now.
    second = router.route("m", chat("another question", system=SYSTEM), 1000, 10)
    assert second(set()) is r
    claim = second.claim(r, streamed=False)
    assert r.prefill_requests == 0 and r.prefill_tokens == 0  # not streamed: no first token to wait for
    assert 10 < r.outstanding_tokens < 200
    claim.release()
    assert (r.outstanding_requests, r.outstanding_tokens) == (0, 0)


def test_decisions_by_policy_and_reason() -> None:
    rs = {"m": [replica("m", 0), replica("m", 1)]}
    router, registry = build([PoolSpec("m", "t")], rs)
    route = router.route("m", chat("hello", system=SYSTEM), 500, 10)
    first = route(set())
    labels = {"model": "m", "policy": "prefix_affinity", "reason": "affinity"}
    assert registry.get_sample_value("fleetgate_routing_decisions_total", labels) == 1
    assert first is not None
    first.outstanding_requests = 21  # the bound: 1.25 * (21 + 1) / 2 + 8 = 21.75 < 21 + 1, so it spills
    again = router.route("m", chat("hello again", system=SYSTEM), 500, 10)
    assert again(set()) is not first
    labels["reason"] = "affinity_spill"
    assert registry.get_sample_value("fleetgate_routing_decisions_total", labels) == 1
    assert registry.get_sample_value("fleetgate_routing_affinity_hits_total", {"model": "m"}) == 1


def test_log_fields_for_a_classified_request() -> None:
    router, _ = build(TIERED, TIERED_REPLICAS)
    choice = router.choose_tier(HARD, None, ())
    assert choice is not None
    route = router.route(choice.model, HARD, 60, None, choice)
    route(set())
    route.queued_s = 0.25
    entry: dict[str, object] = {}
    route.annotate(entry)
    assert entry["tier"] == "large" and entry["tier_reason"] == "classified"
    assert str(entry["classifier"]).startswith("score=")
    assert entry["route"] == "no_prefix" and entry["queued_ms"] == 250.0
    assert "fallback" not in entry
    assert route.cost == 60 + 256  # no max_tokens: the routing estimate


def test_the_prefix_index_forgets_replicas_that_left_the_pool() -> None:
    members = [replica("m", 0), replica("m", 1)]
    router, _ = build([PoolSpec("m", "t")], {"m": members})
    for i in range(8):
        router.route("m", chat(f"question {i}", system=f"{i} " + SYSTEM), 500, 10)(set())
    index = router.pools["m"].index
    assert index is not None and index.replicas() == 2
    members.pop()  # discovery removed it, in place
    router.route("m", chat("one more", system=SYSTEM), 500, 10)(set())
    assert index.replicas() == 1


def test_next_attempt_is_a_replica_or_why_there_is_none() -> None:
    rs = {"m": [replica("m", 0), replica("m", 1)]}
    router, _ = build([PoolSpec("m", "t")], rs, retry_budget=RetryBudgetSettings(ratio=0.0, min_per_s=0.0, burst=1.0))
    route = router.route("m", chat("hi"), 10, 10)
    first = route.next_attempt(0.0, set(), 0, 5.0)
    assert isinstance(first, Replica)
    # A retry past the deadline: none, whatever is left.
    assert route.next_attempt(5.0, {first.id}, 1, 5.0) == DEADLINE
    # Before it, the one credit of the budget pays for one retry, on the other replica.
    second = route.next_attempt(1.0, {first.id}, 1, 5.0)
    assert isinstance(second, Replica) and second.id != first.id
    assert route.next_attempt(1.0, set(), 2, 5.0) == RETRY_BUDGET
    assert route.next_attempt(1.0, {"m-0", "m-1"}, 2, 5.0) == EXHAUSTED
    # A first attempt is never stopped by the deadline or the budget; only by no replica.
    empty, _ = build([PoolSpec("e", "t")], {"e": [replica("e", 0, ReplicaState.DOWN)]})
    assert empty.route("e", chat("hi"), 10, 10).next_attempt(9.0, set(), 0, 5.0) == NO_REPLICA


def test_a_stall_spill_leaves_the_prefix_recorded_where_it_was() -> None:
    members = [replica("m", 0), replica("m", 1)]
    router, _ = build([PoolSpec("m", "t")], {"m": members})
    prompt = chat("a question", system=SYSTEM)
    route = router.route("m", prompt, 500, 10)
    home = route(set())
    assert home is not None and route.reason == "affinity"
    home.streams, home.streams_since = 1, -60.0  # a stream with no byte for a minute: stalled
    detour = router.route("m", prompt, 500, 10)
    other = detour(set())
    assert other is not None and other is not home and detour.reason == "stall_spill"
    index = router.pools["m"].index
    assert index is not None
    keys = router.route_request(prompt, 500, 10).prefix_keys
    assert index.depth(keys, home.id) == len(keys) and index.depth(keys, other.id) == 0


def test_stop_reasons_are_their_strings() -> None:
    """The proxy and the access log compare and write stop reasons as plain strings."""
    assert [str(s) for s in Stop] == ["no_replica", "exhausted", "deadline", "retry_budget"]
    assert DEADLINE == "deadline" and RETRY_BUDGET == "retry_budget" and f"{EXHAUSTED}" == "exhausted"
    assert {"no_replica": 1}[NO_REPLICA] == 1
