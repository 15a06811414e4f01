"""Tier choice for classified requests (``routing.tiers``): which head scores, forced tiers,
what the classifier embeds, and the tables read at start."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry

from routing.embedding_head import EmbeddingHead
from routing.router import PoolSpec, Router
from routing.word_frequency import default_word_frequency
from tests.unit.routing.test_router import build, chat, replica

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
