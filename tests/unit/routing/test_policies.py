"""Replica-choice policies: expected choices written out."""

from __future__ import annotations

import random

from replicas.replica import Breaker, Replica, ReplicaState
from routing.policies import (
    GAUGE_KV_USAGE,
    GAUGE_RUNNING,
    GAUGE_WAITING,
    AffinityGuard,
    LeastOutstandingTokens,
    LeastRequests,
    LoadModel,
    PrefixAffinity,
    RoundRobin,
    RouteRequest,
    prefix_keys,
    rendezvous_rank,
)


def replica(
    rid: str, tokens: int = 0, requests: int = 0, state: ReplicaState = ReplicaState.HEALTHY, **gauges: float
) -> Replica:
    r = Replica(rid, f"http://{rid}", "m", "default", "m", False, Breaker(2, 10.0), state=state)
    r.outstanding_tokens = tokens
    r.outstanding_requests = requests
    r.gauges = {f"vllm:{k}": v for k, v in gauges.items()}
    return r


def chat(system: str, user: str) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


SYSTEM_A = "You are the billing assistant for Acme. " * 30
SYSTEM_B = "You answer questions about the Widget API. " * 30


def req(system: str, user: str = "hi") -> RouteRequest:
    return RouteRequest(prefix_keys=prefix_keys(chat(system, user)), prompt_tokens=300, max_tokens=100)


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
    for policy in (RoundRobin(), LeastRequests(rng), LeastOutstandingTokens(rng), PrefixAffinity(rng)):
        for _ in range(5):
            assert policy.pick([*bad, busy], req(SYSTEM_A), 101.0).replica is busy
        assert policy.pick(bad, req(SYSTEM_A), 101.0).replica is None


# --- prefix affinity -------------------------------------------------------------------


def test_prefix_keys_are_cumulative_blocks() -> None:
    long_a = prefix_keys(chat(SYSTEM_A, "question one"), block_chars=64)
    long_b = prefix_keys(chat(SYSTEM_A, "a different question entirely"), block_chars=64)
    other = prefix_keys(chat(SYSTEM_B, "question one"), block_chars=64)
    shared = sum(1 for x, y in zip(long_a, long_b, strict=False) if x == y)
    assert shared >= len(SYSTEM_A) // 64 - 1
    assert long_a[0] != other[0]
    assert prefix_keys(chat("short", "hi")) == ()  # under one block: no key


def test_affinity_sticks_for_same_prefix() -> None:
    rs = [replica(x) for x in "abcd"]
    policy = PrefixAffinity(random.Random(1))
    first = policy.pick(rs, req(SYSTEM_A, "first"), 0.0)
    assert first.reason == "affinity"
    for user in ("second", "third question", "and a fourth"):
        d = policy.pick(rs, req(SYSTEM_A, user), 0.0)
        assert d.replica is first.replica and d.reason == "affinity"


def test_affinity_moves_when_preferred_is_overloaded_past_guard() -> None:
    rs = [replica(x) for x in "abcd"]
    guard = AffinityGuard(factor=1.5, margin_tokens=1000, spill_ranks=1)
    policy = PrefixAffinity(random.Random(1), guard=guard)
    ranked = rendezvous_rank(req(SYSTEM_A).prefix_keys[3], rs)
    top, second = ranked[0], ranked[1]
    # Least loaded is 2000 -> allowed up to 1.5 * 2000 + 1000 = 4000.
    for r in rs:
        r.outstanding_tokens = 2000
    top.outstanding_tokens = 4000
    assert policy.pick(rs, req(SYSTEM_A), 0.0).replica is top  # at the bound: keep affinity
    top.outstanding_tokens = 4001
    d = policy.pick(rs, req(SYSTEM_A), 0.0)
    assert d.replica is second and d.reason == "affinity_spill:1"  # stable second home
    second.outstanding_tokens = 4001
    d = policy.pick(rs, req(SYSTEM_A), 0.0)
    assert d.replica not in (top, second) and d.reason == "affinity_overloaded"


def test_distinct_prefixes_spread_across_replicas() -> None:
    rs = [replica(x) for x in "abcd"]
    policy = PrefixAffinity(random.Random(1))
    counts = {r.id: 0 for r in rs}
    for i in range(400):
        d = policy.pick(rs, req(f"Tenant {i} system prompt. " * 40), 0.0)
        counts[d.replica.id] += 1  # type: ignore[union-attr]
    # 100 expected each; a binomial(400, 1/4) stays within +-40 with overwhelming odds.
    assert all(60 <= c <= 140 for c in counts.values()), counts


def test_rendezvous_removal_moves_only_the_removed_replicas_prefixes() -> None:
    rs = [replica(x) for x in "abcde"]
    keys = [req(f"App {i} prompt. " * 40).prefix_keys[0] for i in range(300)]
    before = {k: rendezvous_rank(k, rs)[0].id for k in keys}
    after = {k: rendezvous_rank(k, [r for r in rs if r.id != "c"])[0].id for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "c"}
    assert moved  # the removed replica did own some prefixes


def test_short_prompt_goes_to_least_loaded() -> None:
    rs = [replica("a", tokens=500), replica("b", tokens=100)]
    d = PrefixAffinity(random.Random(1)).pick(rs, RouteRequest(prompt_tokens=3), 0.0)
    assert d.replica is rs[1] and d.reason == "no_prefix"


def test_affinity_respects_exclude_on_retry() -> None:
    rs = [replica(x) for x in "abc"]
    policy = PrefixAffinity(random.Random(1))
    first = policy.pick(rs, req(SYSTEM_B), 0.0).replica
    assert first is not None
    retry = policy.pick(rs, req(SYSTEM_B), 0.0, exclude={first.id}).replica
    assert retry is not None and retry is not first


def test_gauges_feed_the_guard() -> None:
    rs = [replica(x) for x in "ab"]
    top = rendezvous_rank(req(SYSTEM_A).prefix_keys[3], rs)[0]
    top.gauges = {GAUGE_WAITING: 20.0, GAUGE_RUNNING: 40.0, GAUGE_KV_USAGE: 0.95}
    d = PrefixAffinity(random.Random(1), guard=AffinityGuard(spill_ranks=0)).pick(rs, req(SYSTEM_A), 0.0)
    assert d.replica is not top and d.reason == "affinity_overloaded"
