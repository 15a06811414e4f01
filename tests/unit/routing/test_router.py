"""The router: tier choice (and what the classifier embeds), fallback chains, the retry budget,
room-aware picks, log fields."""

from __future__ import annotations

import random

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from common.breaker import BreakerConfig, CircuitBreaker
from dialects.base import PromptView
from dialects.openai import CHAT
from replicas.replica import Replica, ReplicaState
from routing.config import CapacitySettings, RetryBudgetSettings, RoutingSettings
from routing.embedding_head import EmbeddingHead
from routing.metrics import RoutingMetrics
from routing.policies import LeastRequests, PrefixAffinity, RoundRobin, conversation_key, session_hash
from routing.router import DEADLINE, EXHAUSTED, NO_REPLICA, RETRY_BUDGET, PoolSpec, Router, make_policy
from routing.word_frequency import default_word_frequency

SYSTEM = "You are the support assistant of a large company; answer politely and precisely. " * 20


def replica(model: str, i: int, state: ReplicaState = ReplicaState.HEALTHY) -> Replica:
    breaker = CircuitBreaker(BreakerConfig(2, 10.0))
    return Replica(f"{model}-{i}", f"http://{model}{i}", model, "t", model, False, breaker, state=state)


def build(
    specs: list[PoolSpec], replicas: dict[str, list[Replica]], head: EmbeddingHead | None = None, **routing: object
) -> tuple[Router, CollectorRegistry]:
    settings = RoutingSettings(**routing)  # type: ignore[arg-type]
    registry = CollectorRegistry()
    router = Router.build(
        settings,
        specs,
        replicas,
        rng=random.Random(1),
        clock=lambda: 0.0,
        metrics=RoutingMetrics(registry, settings.policy),
        head=head,
    )
    return router, registry


def chat(text: str, system: str = "") -> PromptView:
    messages = [{"role": "system", "content": system}] if system else []
    return CHAT.prompt({"messages": [*messages, {"role": "user", "content": text}]})


def test_policy_names_make_their_policies() -> None:
    from routing.config import AffinitySettings
    from routing.policies import LoadModel

    rng, load, aff = random.Random(0), LoadModel(), AffinitySettings()
    assert isinstance(make_policy("prefix_affinity", rng, load, aff), PrefixAffinity)
    assert isinstance(make_policy("round_robin", rng, load, aff), RoundRobin)
    assert isinstance(make_policy("least_requests", rng, load, aff), LeastRequests)


def test_round_robin_from_config_cycles() -> None:
    rs = {"m": [replica("m", 0), replica("m", 1), replica("m", 2)]}
    router, _ = build([PoolSpec("m", "t")], rs, policy="round_robin")
    route = router.route("m", chat("hi"), 10, 10)
    assert [route(set()).id for _ in range(4)] == ["m-0", "m-1", "m-2", "m-0"]  # type: ignore[union-attr]
    assert route.reason == "round_robin"


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


def test_picks_prefer_replicas_with_room() -> None:
    full, free = replica("m", 0), replica("m", 1)
    full.outstanding_requests = 2
    rs = {"m": [full, free]}
    router, _ = build([PoolSpec("m", "t", capacity=CapacitySettings(max_requests=2))], rs, policy="round_robin")
    route = router.route("m", chat("hi"), 10, 10)
    assert [route(set()).id for _ in range(3)] == ["m-1", "m-1", "m-1"]  # type: ignore[union-attr]
    # everyone full: the policy chooses among all (the replica queues it)
    free.outstanding_requests = 2
    assert route(set()) is not None


@pytest.mark.parametrize("policy", ["prefix_affinity", "least_requests"])
def test_a_full_replica_is_passed_over_where_the_first_token_comes_sooner_caches_counted(policy: str) -> None:
    """Prefix affinity leaves a full home only where the first token comes sooner; a baseline always does.

    The pool's prefix index records each prompt where it is sent; a prefill backlog past
    1,000 tokens fills a replica. Prompts of 1,000 tokens, mostly a cached system prompt.
    """
    affinity = policy == "prefix_affinity"
    # Cached at a full home behind 5,000 tokens of backlog: next door, with nothing to wait
    # for, prefills the whole prompt (counted twice: its copy evicts another) and still
    # starts sooner. Either policy diverts.
    router, home, other = _prefill_bound_pool(policy, SYSTEM)
    home.prefill_tokens = 5000
    assert _pick(router, "another question", SYSTEM) is other
    # Behind 1,500 tokens: full, but its first token still comes sooner at home.
    router, home, other = _prefill_bound_pool(policy, SYSTEM)
    home.prefill_tokens = 1500
    assert _pick(router, "another question", SYSTEM) is (home if affinity else other)
    # A hard limit is no wait: a replica at its requests bound is passed over.
    router, home, other = _prefill_bound_pool(policy, SYSTEM, max_requests=1)
    home.outstanding_requests = 1
    assert _pick(router, "another question", SYSTEM) is other
    # Too short for a prefix: no home, it goes where there is room.
    router, home, other = _prefill_bound_pool(policy, SYSTEM)
    home.prefill_tokens = 1500
    assert _pick(router, "hi", "") is other


def _prefill_bound_pool(policy: str, system: str, max_requests: int | None = None) -> tuple[Router, Replica, Replica]:
    """Two replicas under a prefill bound of 1,000 tokens, ``system`` sent once: (router, its home, the other)."""
    a, b = replica("m", 0), replica("m", 1)
    bounds = CapacitySettings(max_requests=max_requests, max_prefill_tokens=1000)
    router, _ = build([PoolSpec("m", "t", capacity=bounds)], {"m": [a, b]}, policy=policy)
    home = _pick(router, "a question", system)
    return router, home, b if home is a else a


def _pick(router: Router, text: str, system: str) -> Replica:
    picked = router.route("m", chat(text, system=system), 1000, 10)(set())
    assert picked is not None
    return picked


def test_prefix_keys_only_where_something_uses_them() -> None:
    rs = {"m": [replica("m", 0)]}
    body = chat("hello", system=SYSTEM)
    affinity, _ = build([PoolSpec("m", "t")], rs)
    assert len(affinity.route_request(body, 100, 10).prefix_keys) > 4
    # Another policy still hashes for the prefill estimate of the capacity bound...
    tokens, _ = build([PoolSpec("m", "t")], rs, policy="least_outstanding_tokens")
    assert len(tokens.route_request(body, 100, 10).prefix_keys) > 4
    # ...and nothing hashes when that bound is off too.
    unbounded = CapacitySettings(max_prefill_tokens=None)
    plain, _ = build([PoolSpec("m", "t")], rs, policy="least_outstanding_tokens", capacity=unbounded)
    assert plain.route_request(body, 100, 10).prefix_keys == ()


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


TIERED = [PoolSpec("s", "small"), PoolSpec("l", "large")]
TIERED_REPLICAS = {"s": [replica("s", 0)], "l": [replica("l", 0)]}
HARD = chat("Compute the integral of x^2 * sin(x) dx from 0 to pi, step by step, and verify the result.")


def test_choose_tier_classifies() -> None:
    router, registry = build(TIERED, TIERED_REPLICAS)
    easy = router.choose_tier(chat("hi"), None, ())
    assert easy is not None and (easy.model, easy.tier, easy.reason) == ("s", "small", "classified")
    hard = router.choose_tier(HARD, None, ())
    assert hard is not None and (hard.model, hard.tier) == ("l", "large")
    assert hard.header().startswith("score=") and hard.header().endswith("; tier=large; classified")
    assert registry.get_sample_value("fleetgate_routing_tiers_total", {"tier": "small", "reason": "classified"}) == 1


def test_medium_without_a_model_goes_to_large() -> None:
    router, _ = build(TIERED, TIERED_REPLICAS)
    choice = router.choose_tier(chat("hi"), "medium", ("medium",))
    assert choice is not None and (choice.tier, choice.model, choice.reason) == ("medium", "l", "forced")


def test_forced_tier_needs_the_tenants_permission() -> None:
    router, _ = build(TIERED, TIERED_REPLICAS)
    denied = router.choose_tier(chat("hi"), "large", ("medium",))
    assert denied is not None and (denied.tier, denied.model, denied.reason) == ("small", "s", "force_denied")
    unknown = router.choose_tier(chat("hi"), "huge", ("huge",))
    assert unknown is not None and (unknown.tier, unknown.reason) == ("small", "force_denied")


def test_the_classifiers_tables_are_read_at_start_not_by_the_first_request() -> None:
    """The word-frequency table both heads weigh is read when the router is built with tiers
    (as the static head is), so the first classified request does not block the loop on it."""
    default_word_frequency.cache_clear()
    build([PoolSpec("m", "default")], {"m": [replica("m", 0)]})
    assert default_word_frequency.cache_info().currsize == 0  # nothing to classify into: not read
    build(TIERED, TIERED_REPLICAS)
    assert default_word_frequency.cache_info().currsize == 1


def test_no_tiered_model_means_no_classification() -> None:
    router, _ = build([PoolSpec("m", "default")], {"m": [replica("m", 0)]})
    assert router.choose_tier(HARD, None, ()) is None


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


def head_router(embedding: str, specs: list[PoolSpec] = TIERED) -> tuple[Router, CollectorRegistry]:
    """A tiered router with a one-weight embedding head (score = sigmoid(4 * v[0] - 2))."""
    head = EmbeddingHead(np.array([4.0, 0.0]), -2.0, 0.0, 0.0, 0.0, 1.0, 0.0, "e")
    replicas = {s.model: [replica(s.model, 0)] for s in specs}
    return build(specs, replicas, head, classifier={"embedding": embedding})


def test_text_to_embed_by_setting() -> None:
    body = chat("  Write a shell script that configures a samba server.  ")
    shared = "Write a shell script that configures a samba server."
    auto, _ = head_router("auto")
    # auto: only the text the semantic cache embeds anyway.
    assert auto.text_to_embed(body, shared, None, ()) == shared
    assert auto.text_to_embed(body, None, None, ()) is None
    always, _ = head_router("always")
    assert always.text_to_embed(body, None, None, ()) == shared  # embedding_text: stripped
    assert always.text_to_embed(chat("   "), None, None, ()) is None
    never, _ = head_router("never")
    assert never.text_to_embed(body, shared, None, ()) is None
    # A forced tier the tenant may force makes the score moot: nothing to embed.
    assert always.text_to_embed(body, None, "large", ("large",)) is None
    assert always.text_to_embed(body, None, "large", ()) == shared
    # No tier has a model: nothing is classified.
    untiered, _ = head_router("always", [PoolSpec("m", "default")])
    assert untiered.text_to_embed(body, shared, None, ()) is None


def test_choose_tier_with_a_vector_uses_the_head_and_counts_heads() -> None:
    router, registry = head_router("auto")
    hard = router.choose_tier(chat("hi"), None, (), np.array([1.0, 0.0], dtype=np.float32))
    assert hard is not None and hard.classification.head == "embedding"
    # sigmoid(4 - 2) = 0.881: large, whatever the n-gram model thinks of "hi".
    assert (hard.tier, hard.model, hard.classification.score) == ("large", "l", 0.881)
    assert hard.header() == "score=0.88; embedding(emb+2.00); none; tier=large; classified"
    late = router.choose_tier(chat("hi"), None, (), None, "timeout")
    assert late is not None and late.classification.head == "static" and late.tier == "small"
    assert "; static(timeout); " in late.header()

    def count(head: str, fallback: str) -> float | None:
        return registry.get_sample_value(
            "fleetgate_routing_classifier_heads_total", {"head": head, "fallback": fallback}
        )

    assert count("embedding", "none") == 1 and count("static", "timeout") == 1


def test_choose_tier_hands_the_window_to_a_head_that_weighs_it() -> None:
    # score = sigmoid(4 * v[0] - 2 - 1.0 * log(chars / pieces))
    head = EmbeddingHead(np.array([4.0, 0.0]), -2.0, 0.0, 0.0, -1.0, 1.0, 0.0, "e")
    router, _ = build(TIERED, {s.model: [replica(s.model, 0)] for s in TIERED}, head)
    # 40 characters in 10 word pieces: -log(4) = -1.386; sigmoid(2 - 1.386) = 0.649.
    choice = router.choose_tier(chat("hi"), None, (), np.array([1.0, 0.0], dtype=np.float32), "", (10, 40))
    assert choice is not None and choice.classification.score == 0.649
    assert choice.header() == "score=0.65; embedding(emb+2.00,cpt-1.39); none; tier=large; classified"
    # A vector without its window (an embedder whose tokenizer keeps no offsets): n-grams
    # classify, and the header says why, instead of the head failing the request.
    bare = router.choose_tier(chat("hi"), None, (), np.array([1.0, 0.0], dtype=np.float32), "", None)
    assert bare is not None and bare.classification.head == "static"
    assert "; static(mismatch); " in bare.header()


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


def second_turn() -> PromptView:
    """The second turn of the conversation ``chat("a question", system=SYSTEM)`` opens."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "a question"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "another"},
    ]
    return CHAT.prompt({"messages": messages})


def test_a_session_key_reaches_the_policy_as_its_hash() -> None:
    router, _ = build([PoolSpec("m", "t")], {"m": [replica("m", 0)]})
    prompt = chat("a question", system=SYSTEM)
    with_session = router.route_request(prompt, 500, 10, "conversation-7")
    assert with_session.session == session_hash("conversation-7") and with_session.conversation == 0
    without = router.route_request(prompt, 500, 10)
    assert without.session == 0 and without.conversation == conversation_key(prompt.segments) != 0
    # A later turn of the same conversation keeps its key.
    assert router.route_request(second_turn(), 500, 10).conversation == without.conversation


def test_the_policy_learns_where_the_system_prompt_ends_and_whether_a_turn_opens_its_conversation() -> None:
    router, _ = build([PoolSpec("m", "t")], {"m": [replica("m", 0)]})
    first = router.route_request(chat("a long question " * 40, system=SYSTEM), 500, 10)
    system_only = router.route_request(chat("", system=SYSTEM), 500, 10)
    assert first.opens
    # Blocks wholly within the system prompt: every block the system prompt alone fills.
    assert 0 < first.preamble_blocks == len(system_only.prefix_keys) < len(first.prefix_keys)
    turn = router.route_request(second_turn(), 500, 10, "conversation-7")
    assert not turn.opens and turn.preamble_blocks == first.preamble_blocks
    assert router.route_request(chat("no system prompt here " * 40), 500, 10).preamble_blocks == 0
