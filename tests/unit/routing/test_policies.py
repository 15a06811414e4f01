"""Replica-choice policies: expected choices written out."""

from __future__ import annotations

import random

from replicas.replica import GAUGE_KV_USAGE, GAUGE_RUNNING, GAUGE_WAITING, Breaker, Replica, ReplicaState
from routing.policies import (
    AffinityGuard,
    LeastOutstandingTokens,
    LeastRequests,
    LoadModel,
    PrefixAffinity,
    RoundRobin,
    RouteRequest,
    prefix_keys,
)
from routing.prefix_index import PrefixIndex


def replica(
    rid: str, tokens: int = 0, requests: int = 0, state: ReplicaState = ReplicaState.HEALTHY, **gauges: float
) -> Replica:
    r = Replica(rid, f"http://{rid}", "m", "default", "m", False, Breaker(2, 10.0), state=state)
    r.outstanding_tokens = tokens
    r.outstanding_requests = requests
    r.observe({f"vllm:{k}": v for k, v in gauges.items()})
    return r


def chat(system: str, user: str) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


SYSTEM_A = "You are the billing assistant for Acme. " * 30
SYSTEM_B = "You answer questions about the Widget API. " * 30


def req(system: str, user: str = "hi") -> RouteRequest:
    keys, ends, chars = prefix_keys(chat(system, user))
    return RouteRequest(keys, prompt_tokens=300, max_tokens=100, prefix_ends=ends, prompt_chars=chars)


def affinity(guard: AffinityGuard | None = None) -> PrefixAffinity:
    return PrefixAffinity(random.Random(1), PrefixIndex(), guard=guard)


def send(policy: PrefixAffinity, rs: list[Replica], request: RouteRequest) -> Replica:
    """Pick and record the choice in the index, as ``routing.router.Route`` does."""
    d = policy.pick(rs, request, 0.0)
    assert d.replica is not None
    policy.index.record(request.prefix_keys, d.replica.id)
    return d.replica


# --- baselines -------------------------------------------------------------------------


def test_round_robin_cycles_and_skips_unroutable() -> None:
    rs = [replica("a"), replica("b", state=ReplicaState.DRAINING), replica("c"), replica("d")]
    rr = RoundRobin()
    picks = [rr.pick(rs, RouteRequest(), 0.0).replica for _ in range(6)]
    assert [p.id for p in picks if p] == ["a", "c", "d", "a", "c", "d"]
    assert rr.pick(rs, RouteRequest(), 0.0, exclude={"a"}).replica.id == "c"  # type: ignore[union-attr]


def test_round_robin_with_nothing_routable() -> None:
    d = RoundRobin().pick([replica("a", state=ReplicaState.FAILED)], RouteRequest(), 0.0)
    assert d.replica is None and d.reason == "no_routable_replica"


def test_least_requests_ignores_tokens() -> None:
    rs = [replica("a", tokens=10, requests=3), replica("b", tokens=9000, requests=1), replica("c", requests=2)]
    assert LeastRequests(random.Random(1)).pick(rs, RouteRequest(), 0.0).replica.id == "b"  # type: ignore[union-attr]


# --- least outstanding tokens with gauge correction ----------------------------------


def test_effective_load_formula() -> None:
    model = LoadModel(tokens_per_request=500, kv_knee=0.8, kv_full_tokens=1000)
    # own: 2 requests, 1200 tokens. Replica reports 5 running + 3 waiting -> 6 foreign.
    # 1200 + 500 * (6 foreign + 3 waiting) + 1000 * (0.9 - 0.8) / 0.2 = 1200 + 4500 + 500
    r = replica("a", tokens=1200, requests=2, num_requests_running=5, num_requests_waiting=3, kv_cache_usage_perc=0.9)
    assert model.effective_load(r) == 6200
    # No gauges yet: only this pod's own tokens.
    assert model.effective_load(replica("b", tokens=700, requests=1)) == 700
    # Gauges lag: fewer requests reported than ours in flight never subtracts load.
    assert model.effective_load(replica("c", tokens=700, requests=4, num_requests_running=1)) == 700


def test_other_pods_work_is_counted_as_of_the_scrape() -> None:
    model = LoadModel(tokens_per_request=500)
    r = replica("a", requests=2)
    r.observe({GAUGE_RUNNING: 6.0, GAUGE_WAITING: 0.0})  # 4 of the 6 are another pod's
    assert model.requests(r) == 6
    # Our two finish before the next scrape: the replica is not left looking busy with them.
    r.outstanding_requests = 0
    assert model.requests(r) == 4 and model.effective_load(r) == 4 * 500
    # We send three more: they add to the other pod's four, not hide behind them.
    r.outstanding_requests = 3
    assert model.requests(r) == 7


def test_least_tokens_sees_other_pods_work() -> None:
    # a has less of our work but a queue from other pods; b is the better choice.
    a = replica("a", tokens=100, requests=1, num_requests_running=8, num_requests_waiting=4)
    b = replica("b", tokens=900, requests=2, num_requests_running=2, num_requests_waiting=0)
    d = LeastOutstandingTokens(random.Random(1)).pick([a, b], RouteRequest(), 0.0)
    assert d.replica is b and d.reason == "least_tokens"


def test_least_tokens_penalises_full_kv_cache() -> None:
    a = replica("a", tokens=1000, kv_cache_usage_perc=0.99)
    b = replica("b", tokens=3000, kv_cache_usage_perc=0.5)
    assert LeastOutstandingTokens(random.Random(1)).pick([a, b], RouteRequest(), 0.0).replica is b


def test_never_routes_to_draining_failed_or_open_breaker() -> None:
    bad = [
        replica("draining", state=ReplicaState.DRAINING),
        replica("failed", state=ReplicaState.FAILED),
        replica("down", state=ReplicaState.DOWN),
        replica("open"),
    ]
    bad[3].breaker.record_failure(100.0)
    bad[3].breaker.record_failure(100.0)
    busy = replica("busy", tokens=50_000)
    rng = random.Random(1)
    for policy in (RoundRobin(), LeastRequests(rng), LeastOutstandingTokens(rng), PrefixAffinity(rng, PrefixIndex())):
        for _ in range(5):
            assert policy.pick([*bad, busy], req(SYSTEM_A), 101.0).replica is busy
        assert policy.pick(bad, req(SYSTEM_A), 101.0).replica is None


# --- prefix affinity -------------------------------------------------------------------


def test_prefix_keys_are_cumulative_blocks() -> None:
    long_a, ends_a, chars_a = prefix_keys(chat(SYSTEM_A, "question one"), block_chars=64)
    long_b, _, _ = prefix_keys(chat(SYSTEM_A, "a different question entirely"), block_chars=64)
    other, _, _ = prefix_keys(chat(SYSTEM_B, "question one"), block_chars=64)
    shared = sum(1 for x, y in zip(long_a, long_b, strict=False) if x == y)
    assert shared >= len(SYSTEM_A) // 64 - 1
    assert long_a[0] != other[0]
    assert ends_a == tuple(64 * (i + 1) for i in range(len(long_a)))
    assert chars_a - ends_a[-1] < 64  # the tail shorter than a block has no key
    assert prefix_keys(chat("short", "hi")) == ((), (), len("system\x1fshort\x1euser\x1fhi\x1e"))


def test_prefix_keys_turn_coarse_past_the_fine_blocks() -> None:
    body = chat("x" * 10_000, "y" * 30_000)
    keys, ends, chars = prefix_keys(body, block_chars=256, max_blocks=8, coarse_block_chars=4096, max_chars=20_000)
    assert ends[:8] == tuple(256 * (i + 1) for i in range(8))
    assert ends[8:] == tuple(2048 + 4096 * (i + 1) for i in range(4))  # 2048 + 4 x 4096 = 18432 <= 20000
    assert chars == 20_000 and len(keys) == 12


def test_uncached_tokens_from_the_matched_depth() -> None:
    r = RouteRequest((1, 2, 3, 4), prompt_tokens=1000, prefix_ends=(250, 500, 750, 1000), prompt_chars=1000)
    assert [r.uncached_tokens(d) for d in range(5)] == [1000, 750, 500, 250, 1]  # a full match recomputes one
    assert RouteRequest(prompt_tokens=80).uncached_tokens(0) == 80


def test_affinity_sticks_for_same_prefix() -> None:
    rs = [replica(x) for x in "abcd"]
    policy = affinity()
    first = policy.pick(rs, req(SYSTEM_A, "first"), 0.0)
    assert first.reason == "new_prefix"
    assert first.replica is not None
    policy.index.record(req(SYSTEM_A, "first").prefix_keys, first.replica.id)
    for user in ("second", "third question", "and a fourth"):
        d = policy.pick(rs, req(SYSTEM_A, user), 0.0)
        assert d.replica is first.replica and d.reason == "affinity"


def test_new_prefix_goes_to_the_least_loaded() -> None:
    rs = [replica("a", tokens=900), replica("b", tokens=100), replica("c", tokens=500)]
    d = affinity().pick(rs, req(SYSTEM_B), 0.0)
    assert d.replica is rs[1] and d.reason == "new_prefix"


def test_a_short_common_opening_is_not_warmth() -> None:
    """Sharing fewer than anchor_blocks leading blocks does not pull a request to a replica."""
    rs = [replica("a"), replica("b", tokens=10)]
    policy = affinity()
    opening = "You are helpful. " * 20  # ~340 characters: one 256-character block
    policy.index.record(req(opening + "Topic one. " * 100).prefix_keys, "b")
    d = policy.pick(rs, req(opening + "Another subject. " * 100), 0.0)
    assert d.replica is rs[0] and d.reason == "new_prefix"


def test_affinity_prefers_the_deepest_match_then_the_least_loaded() -> None:
    rs = [replica("a", tokens=300), replica("b", tokens=200), replica("c", tokens=100)]
    policy = affinity()
    turn1 = req(SYSTEM_A, "first question about invoices " * 20)
    policy.index.record(turn1.prefix_keys, "a")
    policy.index.record(req(SYSTEM_A).prefix_keys, "b")
    policy.index.record(req(SYSTEM_A).prefix_keys, "c")
    # The next turn extends turn 1's prompt: only a holds all of it.
    turn2 = req(SYSTEM_A, "first question about invoices " * 20 + "and a follow-up")
    assert policy.pick(rs, turn2, 0.0).replica is rs[0]
    # A new conversation on the same system prompt: b and c are as warm as a; c is least loaded.
    assert policy.pick(rs, req(SYSTEM_A, "something else"), 0.0).replica is rs[2]


def test_affinity_moves_when_the_warm_replicas_are_overloaded() -> None:
    rs = [replica(x) for x in "abcd"]
    policy = affinity(AffinityGuard(factor=1.5, margin_requests=2))
    warm = send(policy, rs, req(SYSTEM_A))
    # The least busy has 4 requests in flight -> allowed up to 1.5 * 4 + 2 = 8.
    for r in rs:
        r.outstanding_requests = 4
    warm.outstanding_requests = 8
    assert policy.pick(rs, req(SYSTEM_A), 0.0).replica is warm  # at the bound: keep affinity
    warm.outstanding_requests = 9
    d = policy.pick(rs, req(SYSTEM_A), 0.0)
    assert d.replica is not warm and d.reason == "affinity_overloaded"
    # Recorded, the overflow replica is warm too: the prefix now has two homes, and the
    # less busy of them is chosen.
    assert d.replica is not None
    policy.index.record(req(SYSTEM_A).prefix_keys, d.replica.id)
    d2 = policy.pick(rs, req(SYSTEM_A), 0.0)
    assert d2.replica is d.replica and d2.reason == "affinity"


def test_new_prefix_prefers_fewer_sequences_over_fewer_tokens() -> None:
    """A new prompt's prefill stalls every sequence on its replica: fewer of them wins."""
    rs = [replica("a", tokens=300, requests=6), replica("b", tokens=2000, requests=1)]
    d = affinity().pick(rs, req(SYSTEM_B), 0.0)
    assert d.replica is rs[1] and d.reason == "new_prefix"


def test_distinct_prefixes_spread_across_replicas() -> None:
    rs = [replica(x) for x in "abcd"]
    policy = affinity()
    for i in range(400):
        chosen = send(policy, rs, req(f"Tenant {i} system prompt. " * 40))
        chosen.outstanding_tokens += 100  # each keeps its load: the least loaded takes the next
    # New prefixes go to the least loaded, so the load stays even.
    assert {r.outstanding_tokens for r in rs} == {10_000}


def test_short_prompt_goes_to_least_loaded() -> None:
    rs = [replica("a", tokens=500), replica("b", tokens=100)]
    d = affinity().pick(rs, RouteRequest(prompt_tokens=3), 0.0)
    assert d.replica is rs[1] and d.reason == "no_prefix"


def test_affinity_respects_exclude_on_retry() -> None:
    rs = [replica(x) for x in "abc"]
    policy = affinity()
    first = send(policy, rs, req(SYSTEM_B))
    retry = policy.pick(rs, req(SYSTEM_B), 0.0, exclude={first.id})
    assert retry.replica is not None and retry.replica is not first


def test_gauges_feed_the_guard() -> None:
    rs = [replica(x) for x in "ab"]
    policy = affinity()
    warm = send(policy, rs, req(SYSTEM_A))
    warm.observe({GAUGE_WAITING: 20.0, GAUGE_RUNNING: 40.0, GAUGE_KV_USAGE: 0.95})
    d = policy.pick(rs, req(SYSTEM_A), 0.0)
    assert d.replica is not warm and d.reason == "affinity_overloaded"
