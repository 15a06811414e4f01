"""Replica-choice policies: expected choices written out."""

from __future__ import annotations

import dataclasses
import random

from common.breaker import BreakerConfig, CircuitBreaker
from dialects.openai import CHAT
from replicas.replica import GAUGE_KV_USAGE, GAUGE_RUNNING, GAUGE_WAITING, Replica, ReplicaState
from routing.policies import (
    Decision,
    LeastOutstandingTokens,
    LeastRequests,
    LoadBound,
    LoadModel,
    PrefixAffinity,
    RoundRobin,
    RouteRequest,
    conversation_key,
    prefix_keys,
    session_hash,
)
from routing.prefix_index import PrefixIndex
from routing.prefix_placement import AnchorPlacement


def replica(
    rid: str, tokens: int = 0, requests: int = 0, state: ReplicaState = ReplicaState.HEALTHY, **gauges: float
) -> Replica:
    r = Replica(rid, f"http://{rid}", "m", "default", "m", False, CircuitBreaker(BreakerConfig(2, 10.0)), state=state)
    r.outstanding_tokens = tokens
    r.outstanding_requests = requests
    r.observe({f"vllm:{k}": v for k, v in gauges.items()})
    return r


def chat(system: str, user: str) -> tuple[str, ...]:
    """The prompt's segments, as the chat dialect renders them for placement."""
    return CHAT.prompt(
        {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    ).segments


SYSTEM_A = "You are the billing assistant for Acme. " * 30
SYSTEM_B = "You answer questions about the Widget API. " * 30


def req(system: str, user: str = "hi") -> RouteRequest:
    keys, ends, chars = prefix_keys(chat(system, user))
    return RouteRequest(keys, prompt_tokens=300, max_tokens=100, prefix_ends=ends, prompt_chars=chars)


def affinity(bound: LoadBound | None = None) -> PrefixAffinity:
    return PrefixAffinity(random.Random(1), bound=bound)


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
    for policy in (RoundRobin(), LeastRequests(rng), LeastOutstandingTokens(rng), PrefixAffinity(rng)):
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


def home(rs: list[Replica], request: RouteRequest) -> Replica:
    """The replica a quiet fleet gives ``request``'s prefix."""
    d = affinity().pick(rs, request, 0.0)
    assert d.replica is not None and d.reason == "affinity"
    return d.replica


def test_a_prefix_has_one_home_whatever_follows_it() -> None:
    rs = [replica(x) for x in "abcd"]
    policy = affinity()
    first = policy.pick(rs, req(SYSTEM_A, "first"), 0.0)
    assert first.reason == "affinity"
    for user in ("second", "third question", "and a fourth"):
        d = policy.pick(rs, req(SYSTEM_A, user), 0.0)
        assert d.replica is first.replica and d.reason == "affinity"


def test_pods_agree_without_sharing_anything() -> None:
    """Two policies (two gateway pods) with their own replica objects, in another order, place alike."""
    pod1 = [replica(x) for x in "abcd"]
    pod2 = [replica(x) for x in "dcba"]
    for i in range(50):
        request = req(f"Tenant {i} system prompt. " * 60)
        assert home(pod1, request).base_url == home(pod2, request).base_url


def test_distinct_prefixes_spread_across_replicas() -> None:
    rs = [replica(x) for x in "abcd"]
    homes = [home(rs, req(f"Tenant {i} system prompt. " * 60)).id for i in range(400)]
    # 100 each on average; a binomial's standard deviation here is ~8.7.
    assert all(75 <= homes.count(x) <= 125 for x in "abcd"), {x: homes.count(x) for x in "abcd"}


def test_prefixes_in_use_are_split_evenly_between_the_replicas() -> None:
    """The hash alone splits these 32 prompts 22/10; once they are in use, their homes are 16/16."""
    rs = [replica(x) for x in "ab"]
    policy = PrefixAffinity(random.Random(1), placement=AnchorPlacement(refresh_s=0.0), members=rs)
    prompts = [req(f"Tenant {i} system prompt. " * 60) for i in range(32)]
    firsts = [policy.placement.order(p.prefix_keys[3], [r.base_url for r in rs])[0] for p in prompts]
    assert sorted(firsts.count(r.base_url) for r in rs) == [10, 22]
    for t in (0.0, 1.0):  # each in use from its second placement on
        for p in prompts:
            policy.pick(rs, p, t)
    homes = [policy.pick(rs, p, 2.0).replica for p in prompts]
    assert sorted(homes.count(r) for r in rs) == [16, 16]
    # A retry away from home (home excluded) is not at home; the homes stay the pool's.
    assert homes[0] is not None
    d = policy.pick(rs, prompts[0], 3.0, exclude={homes[0].id})
    assert d.replica is not homes[0] and d.reason == "affinity_spill"
    assert policy.pick(rs, prompts[0], 3.0).replica is homes[0]


def test_one_off_prefixes_are_placed_by_load() -> None:
    """Where new prefixes seldom come back (retrieval over unique documents), a home does not pay."""
    rs = [replica("a", requests=3), replica("b", requests=0)]
    policy = affinity()
    reasons = [policy.pick(rs, req(f"Document {i}. " * 100), 0.0).reason for i in range(100)]
    # The pool starts by homing prefixes; a new prefix not seen again while 64 newer ones
    # came is a one-off, and once most are, load decides.
    assert set(reasons[:64]) == {"affinity"} and set(reasons[-20:]) == {"new_prefix"}
    assert policy.pick(rs, req("Document 500. " * 100), 0.0).replica is rs[1]
    assert policy.placement.reuse() < 0.5
    # A prefix that does come back gets its home, and enough of them make homes the rule again.
    for _ in range(2):
        for i in range(300):
            policy.pick(rs, req(f"Chat system prompt {i}. " * 100), 1.0)
    assert policy.placement.reuse() > 0.5
    assert policy.pick(rs, req("A new system prompt. " * 100), 2.0).reason in {"affinity", "affinity_spill"}


def test_a_short_common_opening_does_not_decide_the_home() -> None:
    """Prompts that share fewer than anchor_blocks leading blocks are placed independently."""
    rs = [replica(x) for x in "abcd"]
    opening = "You are helpful. " * 20  # ~340 characters: one 256-character block
    homes = {home(rs, req(opening + f"Topic {i}. " * 100)).id for i in range(20)}
    assert len(homes) > 1


def test_a_spill_goes_to_the_next_in_the_prefix_order_and_leaves_no_trace() -> None:
    rs = [replica(x) for x in "abcd"]
    policy = affinity(LoadBound(factor=1.25, margin_requests=2))
    first = home(rs, req(SYSTEM_A))
    # 4 replicas with 4 in flight each: the bound is 1.25 * (16 + 1) / 4 + 2 = 7.3125.
    for r in rs:
        r.outstanding_requests = 4
    first.outstanding_requests = 6  # total 18: 1.25 * 19 / 4 + 2 = 7.9375 >= 6 + 1
    assert policy.pick(rs, req(SYSTEM_A), 0.0).replica is first
    first.outstanding_requests = 7  # total 19: 1.25 * 20 / 4 + 2 = 8.25 >= 7 + 1
    assert policy.pick(rs, req(SYSTEM_A), 0.0).replica is first
    first.outstanding_requests = 8  # total 20: 1.25 * 21 / 4 + 2 = 8.5625 < 8 + 1
    spill = policy.pick(rs, req(SYSTEM_A), 0.0)
    assert spill.replica is not first and spill.reason == "affinity_spill"
    # The spill target is the prefix's second choice: the home's absence makes it the first.
    rest = [r for r in rs if r is not first]
    assert home(rest, req(SYSTEM_A)) is spill.replica
    # Every spill of this prefix goes there, not to whichever replica is least busy.
    assert spill.replica is not None
    for other in rest:
        if other is not spill.replica:
            other.outstanding_requests = 3
    assert policy.pick(rs, req(SYSTEM_A), 0.0).replica is spill.replica
    # Home has room again: the prefix goes home; the spill left nothing behind.
    first.outstanding_requests = 4
    d = policy.pick(rs, req(SYSTEM_A), 0.0)
    assert d.replica is first and d.reason == "affinity"


def test_a_hot_prefix_spreads_over_its_order_as_its_load_needs() -> None:
    rs = [replica(x) for x in "abcdefgh"]
    policy = affinity(LoadBound(factor=1.25, margin_requests=1))
    for _ in range(40):  # one prefix, requests that never finish
        d = policy.pick(rs, req(SYSTEM_B), 0.0)
        assert d.replica is not None
        d.replica.outstanding_requests += 1
    # Every replica stays within the bound: 1.25 x the mean (5) + 1.
    assert max(r.outstanding_requests for r in rs) <= 1.25 * 40 / 8 + 1
    # The replicas used are the first ones of the prefix's order, not any that had room.
    order, rest = [], list(rs)
    while rest:
        order.append(home(rest, req(SYSTEM_B)))
        rest.remove(order[-1])
    used = [r for r in order if r.outstanding_requests]
    assert used == order[: len(used)] and len(used) < len(rs)


def test_short_prompt_goes_to_least_loaded() -> None:
    rs = [replica("a", tokens=500), replica("b", tokens=100)]
    d = affinity().pick(rs, RouteRequest(prompt_tokens=3), 0.0)
    assert d.replica is rs[1] and d.reason == "no_prefix"


def test_short_prompt_prefers_fewer_sequences_over_fewer_tokens() -> None:
    """A new prompt's prefill stalls every sequence on its replica: fewer of them wins."""
    rs = [replica("a", tokens=300, requests=6), replica("b", tokens=2000, requests=1)]
    d = affinity().pick(rs, RouteRequest(prompt_tokens=3), 0.0)
    assert d.replica is rs[1] and d.reason == "no_prefix"


def test_affinity_respects_exclude_on_retry() -> None:
    rs = [replica(x) for x in "abc"]
    policy = affinity()
    first = home(rs, req(SYSTEM_B))
    retry = policy.pick(rs, req(SYSTEM_B), 0.0, exclude={first.id})
    assert retry.replica is not None and retry.replica is not first


def test_gauges_feed_the_bound() -> None:
    """Other pods' requests, as the home replica reports them, count towards its load."""
    rs = [replica(x) for x in "ab"]
    policy = affinity()
    first = home(rs, req(SYSTEM_A))
    first.observe({GAUGE_WAITING: 20.0, GAUGE_RUNNING: 40.0, GAUGE_KV_USAGE: 0.95})
    d = policy.pick(rs, req(SYSTEM_A), 0.0)
    assert d.replica is not first and d.reason == "affinity_spill"


def test_block_tokens_share_the_prompt_by_characters() -> None:
    r = RouteRequest((1, 2, 3), prompt_tokens=300, max_tokens=50, prefix_ends=(256, 512, 768), prompt_chars=1000)
    # 0.3 tokens per character: 76.8 -> 77 per block; the unkeyed end and the completion remain.
    assert r.block_tokens() == ((77, 77, 77), 300 - 231 + 50)
    assert RouteRequest(prompt_tokens=40, max_tokens=10).block_tokens() == ((), 50)


# --- hot prefixes, sessions and stalls -----------------------------------------------------


def conversation(system: str, user: str, turns: int) -> list[RouteRequest]:
    """A conversation's requests, turn by turn (each repeats the ones before), as the router keys them."""
    requests = []
    for turn in range(1, turns + 1):
        body = {"messages": [{"role": "system", "content": system}]}
        for t in range(turn):
            body["messages"] += [{"role": "user", "content": f"{user} {t}"}]
            if t < turn - 1:
                body["messages"] += [{"role": "assistant", "content": f"answer {t} " * 50}]
        segments = CHAT.prompt(body).segments
        keys, ends, chars = prefix_keys(segments)
        requests.append(RouteRequest(keys, 300, 100, ends, chars, conversation=conversation_key(segments)))
    return requests


def zipf_conversations(policy: PrefixAffinity, rs: list[Replica]) -> tuple[dict[str, int], set[str], int]:
    """300 conversations of 2-4 turns behind 16 system prompts of Zipf popularity (the most
    popular: 30% of them); (requests per replica, where the hot prompt's went, conversations
    after the first 50 that moved between replicas)."""
    rng = random.Random(7)
    systems = [f"System prompt {i} (4): you help with topic {i}. " * 30 for i in range(16)]
    popularity = [1 / (i + 1) for i in range(16)]
    served = dict.fromkeys((r.id for r in rs), 0)
    hot: set[str] = set()
    moved, now = 0, 0.0
    for c in range(300):
        s = rng.choices(range(16), popularity)[0]
        where = set()
        for request in conversation(systems[s], f"conversation {c}", rng.randint(2, 4)):
            decision = policy.pick(rs, request, now)
            assert decision.replica is not None and decision.reason == "affinity"
            where.add(decision.replica.id)
            served[decision.replica.id] += 1
            now += 0.05
        moved += len(where) > 1 and c >= 50
        if s == 0:
            hot |= where
    return served, hot, moved


def test_a_hot_prefix_spreads_its_conversations_and_keeps_each_on_one_replica() -> None:
    """Over two replicas the hot prompt gets both as homes and fills what the others leave."""
    rs = [replica("a"), replica("b")]
    served, hot, moved = zipf_conversations(PrefixAffinity(random.Random(1), members=rs), rs)
    assert hot == {"a", "b"}
    assert max(served.values()) / sum(served.values()) <= 0.55, served
    assert moved <= 2, f"{moved} conversations moved after the first 50"


def test_without_the_spread_the_same_traffic_piles_onto_one_replica() -> None:
    """The check above can fail: with no spread (a hot share no prefix reaches), one replica
    takes over 60% of the same requests."""
    rs = [replica("a"), replica("b")]
    policy = PrefixAffinity(random.Random(1), placement=AnchorPlacement(hot_share=1e9), members=rs)
    served, hot, moved = zipf_conversations(policy, rs)
    assert len(hot) == 1 and moved == 0
    assert max(served.values()) / sum(served.values()) > 0.6, served


def test_a_session_key_chooses_among_a_hot_prefixs_homes_alike_on_every_pod() -> None:
    members = [replica(x) for x in "abcd"]
    pods = [PrefixAffinity(random.Random(i), members=members) for i in range(2)]
    base = req(SYSTEM_A)

    def pick(i: int, session: str, now: float) -> Replica:
        request = RouteRequest(
            base.prefix_keys, 300, 100, base.prefix_ends, base.prompt_chars, session=session_hash(session)
        )
        decision = pods[i % 2].pick(members, request, now)
        assert decision.replica is not None and decision.reason == "affinity"
        return decision.replica

    for i in range(64):  # one prompt only: once the pods have seen enough, it is hot everywhere
        pick(i, "warm-up", i * 0.01)
    where: dict[str, set[str]] = {}
    for i in range(400):
        session = f"user-{i % 40}"
        where.setdefault(session, set()).add(pick(i, session, 1.0 + i * 0.01).id)
    assert all(len(w) == 1 for w in where.values()), where  # each session on one replica, from either pod
    assert {next(iter(w)) for w in where.values()} == set("abcd")


def hot_pair() -> tuple[PrefixAffinity, PrefixIndex, list[Replica]]:
    """Two replicas, a prefix index, and SYSTEM_A hot enough to have both replicas as homes."""
    rs = [replica("a"), replica("b")]
    index = PrefixIndex()
    policy = PrefixAffinity(random.Random(1), members=rs, index=index)
    for i in range(64):
        policy.pick(rs, req(SYSTEM_A, f"warm-up {i}"), i * 0.01)
    assert len(policy.placement.homes_of(req(SYSTEM_A).prefix_keys[3], ["http://a", "http://b"], 1.0)) == 2
    return policy, index, rs


def record(index: PrefixIndex, request: RouteRequest, r: Replica) -> None:
    """What the router does with a pick: the replica now holds the request's prefix."""
    index.record(request.prefix_keys, request.block_tokens()[0], r.id)


def turns(system: str, user: str, n: int) -> list[RouteRequest]:
    """``conversation``'s requests with what the router adds: the system prompt's blocks, and
    whether the turn opens the conversation."""
    out = []
    for i, r in enumerate(conversation(system, user, n)):
        preamble = len(prefix_keys(chat(system, "")[:1])[0])
        out.append(dataclasses.replace(r, preamble_blocks=preamble, opens=i == 0))
    return out


def test_a_conversation_of_a_hot_prefix_follows_its_history_to_the_home_that_holds_it() -> None:
    """Its next turn goes where the index says its turns are cached, not where its hash would
    pick now (after a spill, or after the homes' parts moved)."""
    policy, index, rs = hot_pair()
    by_id = {r.id: r for r in rs}
    first, second, third = turns(SYSTEM_A, "a question", 3)
    chosen = policy.pick(rs, first, 2.0).replica
    assert chosen is not None
    record(index, first, chosen)
    other = by_id["b" if chosen.id == "a" else "a"]
    record(index, second, other)  # the second turn went to the other home (a spill)
    assert policy.pick(rs, third, 2.1) == Decision(other, "affinity")
    without_index = PrefixAffinity(random.Random(1), members=rs, placement=policy.placement)
    assert without_index.pick(rs, third, 2.1).replica is chosen  # by its hash alone


def test_new_conversations_of_a_hot_prefix_spread_even_where_one_home_holds_more_of_the_system_prompt() -> None:
    """The system prompt cached on one home only is not a conversation's history: new
    conversations still take each home by their hash."""
    policy, index, rs = hot_pair()
    record(index, req(SYSTEM_A, "x" * 2000), rs[0])  # only "a" is known to hold the prompt
    picks = {policy.pick(rs, turns(SYSTEM_A, f"new {i}", 1)[0], 2.0).replica.id for i in range(40)}  # type: ignore[union-attr]
    assert picks == {"a", "b"}


def test_only_a_conversations_first_turn_counts_towards_its_prefixs_share() -> None:
    """Later turns come as fast as the replica answers them, so counting them would make a
    slow home's prefixes look rare; a prefix's share counts the conversations it opens."""
    placement = AnchorPlacement()
    members = ["http://a", "http://b"]
    for i in range(20):
        placement.homes_of(1, members, i * 0.01)
        placement.homes_of(2, members, i * 0.01)
        for _ in range(4):
            placement.homes_of(2, members, i * 0.01, opens=False)
    assert placement.share(1, 1.0) == placement.share(2, 1.0) == 0.5


def test_a_session_places_a_prompt_too_short_for_an_anchor() -> None:
    rs = [replica("a", requests=3), replica("b"), replica("c")]
    policy = affinity()
    short = RouteRequest(*prefix_keys(chat("", "hello"))[:1], session=session_hash("s1"))
    picks = {policy.pick(rs, short, 0.0).replica.id for _ in range(5)}  # type: ignore[union-attr]
    assert len(picks) == 1 and policy.pick(rs, short, 0.0).reason == "session"
    assert policy.pick(rs, RouteRequest(short.prefix_keys), 0.0).reason == "no_prefix"


def stall(r: Replica, since: float) -> None:
    """``r`` holds a stream that has had no byte since ``since``."""
    r.streams, r.streams_since = 1, since


def test_a_stalled_home_spills_to_the_next_replica_and_the_prefix_comes_back() -> None:
    rs = [replica("a"), replica("b"), replica("c")]
    policy = affinity()
    request = req(SYSTEM_A)
    home = policy.pick(rs, request, 0.0).replica
    assert home is not None
    stall(home, since=0.0)
    spill = policy.pick(rs, request, 10.0)
    assert spill.replica is not home and spill.reason == "stall_spill"
    order = policy.placement.order(request.prefix_keys[3], [r.base_url for r in rs])
    assert spill.replica is not None and spill.replica.base_url == order[1 if order[0] == home.base_url else 0]
    home.last_progress_at = 10.5  # a byte came: it moves again
    assert policy.pick(rs, request, 11.0) == Decision(home, "affinity")


def test_when_every_replica_is_stalled_the_home_still_serves() -> None:
    rs = [replica("a"), replica("b")]
    policy = affinity()
    request = req(SYSTEM_B)
    home = policy.pick(rs, request, 0.0).replica
    for r in rs:
        stall(r, since=0.0)
    assert policy.pick(rs, request, 10.0) == Decision(home, "affinity")


class _Held:
    """What each replica holds of a request, as the exact index (``RequestBlocks``) would say."""

    def __init__(self, **tokens: int) -> None:
        self._tokens = tokens

    def cached_tokens(self, replica_id: str) -> int | None:
        return self._tokens.get(replica_id)


def test_with_kv_events_a_spilled_conversation_stays_with_its_history_and_an_estimate_goes_home() -> None:
    rs = [replica(x) for x in "abcd"]
    policy = affinity(LoadBound(factor=1.25, margin_requests=2))
    first = home(rs, req(SYSTEM_A))
    spilled = next(r for r in rs if r is not first)
    turn = dataclasses.replace(req(SYSTEM_A, "and then?"), opens=False)  # a later turn

    # The events say the spill target holds more of the conversation than home does: it stays.
    def held(**tokens: int) -> RouteRequest:
        return dataclasses.replace(turn, exact=_Held(**tokens))  # type: ignore[arg-type]

    exact = held(**{first.id: 250, spilled.id: 290})
    d = policy.pick(rs, exact, 0.0)
    assert d.replica is spilled and d.reason == "affinity_history"
    # Home holding as much, or the other replica nothing of the conversation: home.
    assert policy.pick(rs, held(**{first.id: 290, spilled.id: 290}), 0.0).replica is first
    assert policy.pick(rs, held(**{spilled.id: 0}), 0.0).replica is first
    # Past the load bound, it spills on as before.
    spilled.outstanding_requests = 9
    assert policy.pick(rs, exact, 0.0).replica is not spilled
    # Without events (the estimate), the spill leaves no trace: home; nor does a first turn follow a copy.
    spilled.outstanding_requests = 0
    assert policy.pick(rs, turn, 0.0).replica is first
    assert policy.pick(rs, dataclasses.replace(exact, opens=True), 0.0).replica is first
