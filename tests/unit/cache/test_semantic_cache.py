"""The semantic cache in one process (memory stores, the hashing embedder, the real verifier).

Questions with the same words in the same order are a hit whatever the embedder (the
verifier's rule), so these tests need no model; the real one is in tests/integration.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

from cache.config import CacheServiceSettings, CacheSettings, SemanticCacheSettings, SemanticServiceSettings
from cache.keys import split_key
from cache.memory_store import MemoryStore
from cache.metrics import CacheMetrics
from cache.semantic.cache import SemanticCache, State
from cache.semantic.embedder import Embeddings, HashingEmbedder
from cache.semantic.store import MemorySemanticStore
from cache.service import ResponseCache, create_response_cache
from dialects.answer import CachedCompletion
from dialects.openai import CHAT, EMBEDDINGS

ANSWER = CachedCompletion("chat", "m", "Paris.", "stop", 12, 2)
ON = CacheSettings(semantic=SemanticCacheSettings(enabled=True))


class GatedEmbedder:
    """The hashing embedder, answering only once ``gate`` is set; counts its calls."""

    def __init__(self) -> None:
        self.inner = HashingEmbedder()
        self.gate = asyncio.Event()
        self.calls = 0

    @property
    def dimension(self) -> int:
        return self.inner.dimension

    @property
    def identity(self) -> str:
        return self.inner.identity

    async def embed(self, texts: Sequence[str]) -> Embeddings:
        self.calls += 1
        await self.gate.wait()
        return self.inner.embed_now(texts)


class BrokenEmbedder(HashingEmbedder):
    async def embed(self, texts: Sequence[str]) -> Embeddings:
        raise RuntimeError("model crashed")


def body(question: str, **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": question}], "temperature": 0, **fields}


class RenamedEmbedder(HashingEmbedder):
    """The hashing embedder under another identity: another model, as far as the cache knows."""

    @property
    def identity(self) -> str:
        return "another-model"


def make(embedder: Any = None, store: MemoryStore | None = None, **semantic: Any) -> ResponseCache:
    metrics = CacheMetrics()
    settings = CacheServiceSettings(semantic=SemanticServiceSettings(**semantic))
    cache = SemanticCache(settings.semantic, MemorySemanticStore(), metrics, embedder=embedder or HashingEmbedder())
    answers = store if store is not None else MemoryStore()  # an empty store is falsy
    return ResponseCache(answers, settings, metrics, semantic=cache, start_semantic=True)


def sample(cache: ResponseCache, name: str, **labels: str) -> float:
    return cache.metrics.sample(name, **labels)


async def remember(cache: ResponseCache, question: str, tenant: str = "t1", **fields: Any) -> None:
    plan = cache.plan(tenant, "m", CHAT, body(question, **fields), ON, None)
    assert plan.key is not None
    assert await cache.find(plan) is None
    cache.store_later(plan.key, ANSWER, ON, plan.semantic)
    await asyncio.gather(*cache._pending)


async def ask(cache: ResponseCache, question: str, tenant: str = "t1", **fields: Any) -> str:
    hit = await cache.find(cache.plan(tenant, "m", CHAT, body(question, **fields), ON, None))
    return "miss" if hit is None else hit.kind


async def test_a_rephrasing_hits_within_its_scope_only() -> None:
    async with make() as cache:
        await remember(cache, "What is the capital of France?")
        assert await ask(cache, "What is the capital of France?") == "exact"
        assert await ask(cache, "what is the capital of france") == "semantic"
        assert await ask(cache, "what is the capital of france", tenant="t2") == "miss"
        assert await ask(cache, "what is the capital of france", max_tokens=5) == "miss"
        assert await ask(cache, "How tall is Mount Everest?") == "miss"
        assert sample(cache, "fleetgate_cache_lookups_total", kind="semantic", result="hit") == 1
        assert sample(cache, "fleetgate_cache_lookups_total", kind="semantic", result="miss") == 4  # 1 at store
        assert sample(cache, "fleetgate_cache_semantic_verdicts_total", reason="same_words") == 1
        assert sample(cache, "fleetgate_cache_stores_total", kind="semantic", result="stored") == 1
        assert sample(cache, "fleetgate_cache_entries", kind="semantic") == 1
        assert sample(cache, "fleetgate_cache_lookup_seconds_count", kind="semantic") == 5
        assert sample(cache, "fleetgate_cache_embed_seconds_count") >= 3


async def test_only_tenants_that_enable_it_and_only_short_texts() -> None:
    async with make(max_text_chars=40) as cache:
        plan = cache.plan("t1", "m", CHAT, body("What is the capital of France?"), CacheSettings(), None)
        assert plan.semantic is None
        long_text = "What is the capital of France, and why is it not Lyon?"
        assert cache.plan("t1", "m", CHAT, body(long_text), ON, None).semantic is None
        assert sample(cache, "fleetgate_cache_bypass_total", reason="semantic_long_text") == 1
        tool = body("x")
        tool["messages"].append({"role": "tool", "content": "42", "tool_call_id": "c"})
        assert cache.plan("t1", "m", CHAT, tool, ON, None).semantic is None
        assert sample(cache, "fleetgate_cache_bypass_total", reason="semantic_no_text") == 1
        # Sampled requests are not cached at all, by meaning or otherwise.
        assert cache.plan("t1", "m", CHAT, body("x", temperature=1), ON, None).key is None


async def test_cache_control_is_honoured() -> None:
    async with make() as cache:
        plan = cache.plan("t1", "m", CHAT, body("What is the capital of France?"), ON, "no-store")
        assert not plan.store  # the gateway then never calls store_later
        await remember(cache, "What is the capital of France?")
        no_cache = cache.plan("t1", "m", CHAT, body("what is the capital of france"), ON, "no-cache")
        assert await cache.find(no_cache) is None
        assert sample(cache, "fleetgate_cache_lookups_total", kind="semantic", result="hit") == 0


async def test_a_slow_embedder_is_a_timeout_and_its_vector_serves_the_store() -> None:
    embedder = GatedEmbedder()
    async with make(embedder, embed_timeout_ms=20) as cache:
        plan = cache.plan("t1", "m", CHAT, body("What is the capital of France?"), ON, None)
        assert plan.key is not None
        assert await cache.find(plan) is None
        assert sample(cache, "fleetgate_cache_lookups_total", kind="semantic", result="timeout") == 1
        embedder.gate.set()
        cache.store_later(plan.key, ANSWER, ON, plan.semantic)
        await asyncio.gather(*cache._pending)
        assert embedder.calls == 1  # the lookup's embedding, finished in the background
        assert await ask(cache, "what is the capital of france") == "semantic"


async def test_a_backlogged_embedder_is_skipped() -> None:
    embedder = GatedEmbedder()
    async with make(embedder, embed_timeout_ms=5000, max_pending=2) as cache:
        waiting = [asyncio.create_task(ask(cache, f"question number {n}")) for n in range(2)]
        await asyncio.sleep(0.01)
        assert await ask(cache, "one more question") == "miss"
        assert sample(cache, "fleetgate_cache_lookups_total", kind="semantic", result="unavailable") == 1
        assert sample(cache, "fleetgate_cache_embed_pending") == 2
        embedder.gate.set()
        assert await asyncio.gather(*waiting) == ["miss", "miss"]


async def test_a_failing_embedder_is_an_error_not_a_failure() -> None:
    async with make(BrokenEmbedder()) as cache:
        assert await ask(cache, "What is the capital of France?") == "miss"
        assert sample(cache, "fleetgate_cache_lookups_total", kind="semantic", result="error") == 1


async def test_an_entry_whose_answer_is_gone_is_forgotten() -> None:
    async with make() as cache:
        await remember(cache, "What is the capital of France?")
        assert isinstance(cache.store_backend, MemoryStore)
        cache.store_backend._scopes.clear()  # the answer was evicted from the exact cache
        assert await ask(cache, "what is the capital of france") == "miss"
        assert sample(cache, "fleetgate_cache_semantic_verdicts_total", reason="answer_gone") == 1
        assert sample(cache, "fleetgate_cache_entries", kind="semantic") == 0


async def test_the_tenant_bound_evicts_semantic_entries() -> None:
    async with make() as cache:
        small = CacheSettings(max_entries=2, semantic=SemanticCacheSettings(enabled=True))
        for n in range(4):
            plan = cache.plan("t1", "m", CHAT, body(f"Question {n} about rivers?"), small, None)
            assert plan.key is not None
            cache.store_later(plan.key, ANSWER, small, plan.semantic)
            await asyncio.gather(*cache._pending)
        assert sample(cache, "fleetgate_cache_evictions_total", kind="semantic") == 2
        assert sample(cache, "fleetgate_cache_entries", kind="semantic") == 2


async def test_entries_expire_with_the_tenant_ttl() -> None:
    now = [1000.0]
    metrics = CacheMetrics()
    settings = SemanticServiceSettings()
    semantic = SemanticCache(
        settings, MemorySemanticStore(lambda: now[0]), metrics, embedder=HashingEmbedder(), wall_clock=lambda: now[0]
    )
    async with ResponseCache(MemoryStore(), metrics=metrics, semantic=semantic, start_semantic=True) as cache:
        short = CacheSettings(ttl_s=10, semantic=SemanticCacheSettings(enabled=True))
        plan = cache.plan("t1", "m", CHAT, body("What is the capital of France?"), short, None)
        assert plan.key is not None and plan.semantic is not None
        await semantic.store(plan.semantic, plan.key, short)
        query = cache.plan("t1", "m", CHAT, body("what is the capital of france"), short, None).semantic
        assert query is not None
        assert (await semantic.lookup(query)).result == "hit"
        now[0] += 10
        assert (await semantic.lookup(query)).result == "miss"
        assert semantic.index is not None and len(semantic.index) == 0


async def test_nothing_loads_until_a_tenant_asks() -> None:
    metrics = CacheMetrics()
    cache = create_response_cache(None, CacheServiceSettings(), metrics)
    async with cache:
        assert cache.semantic is not None and cache.semantic.state is State.IDLE
        cache.plan("t1", "m", CHAT, body("hi"), CacheSettings(), None)
        assert cache.semantic.state is State.IDLE


async def test_a_tenant_enabled_later_starts_it_in_the_background() -> None:
    metrics = CacheMetrics()
    semantic = SemanticCache(SemanticServiceSettings(), MemorySemanticStore(), metrics, embedder=HashingEmbedder())
    async with ResponseCache(MemoryStore(), metrics=metrics, semantic=semantic) as cache:
        assert semantic.state is State.IDLE
        assert await ask(cache, "What is the capital of France?") == "miss"  # starts it
        assert sample(cache, "fleetgate_cache_lookups_total", kind="semantic", result="unavailable") == 1
        for _ in range(100):
            if semantic.ready:
                break
            await asyncio.sleep(0.01)
        assert semantic.ready


async def test_entries_made_by_another_model_are_never_compared() -> None:
    # Two gateways share the answers; the second runs another model (say, after an upgrade)
    # and holds the first one's entry as a shared store would hand it over.
    answers = MemoryStore()
    async with make(store=answers) as first, make(RenamedEmbedder(), store=answers) as second:
        assert first.semantic is not None and second.semantic is not None
        await remember(first, "What is the capital of France?")
        plan = first.plan("t1", "m", CHAT, body("What is the capital of France?"), ON, None)
        assert first.semantic.index is not None and second.semantic.index is not None and plan.key is not None
        entry = first.semantic.index.get(split_key(plan.key)[1])
        assert entry is not None and entry.scope.endswith("@hashing-384")
        second.semantic.index.add(entry)
        assert await ask(second, "what is the capital of france") == "miss"
        # The same entry as if the second model had made it is a hit: only the identity differed.
        second.semantic.index.add(dataclasses.replace(entry, scope=entry.scope.replace("hashing-384", "another-model")))
        assert await ask(second, "what is the capital of france") == "semantic"


async def test_an_embedder_of_another_dimension_is_refused_at_start() -> None:
    metrics = CacheMetrics()
    semantic = SemanticCache(
        SemanticServiceSettings(), MemorySemanticStore(), metrics, embedder=HashingEmbedder(dimension=64)
    )
    with pytest.raises(ValueError, match="verifier_path"):
        async with ResponseCache(MemoryStore(), metrics=metrics, semantic=semantic, start_semantic=True):
            pass
    assert semantic.state is State.CLOSED


async def test_the_classifiers_vector_is_the_one_the_lookup_and_store_use() -> None:
    """The classifier asks for the text's vector before the cache looks it up: one embedding."""
    embedder = GatedEmbedder()
    embedder.gate.set()
    async with make(embedder) as cache:
        question = "What is the capital of France?"
        text = cache.semantic_text(CHAT, body(f"  {question} "), ON, None)
        assert text == question
        assert cache.semantic is not None
        embedding, why = await cache.semantic.vector(text, 1.0)
        assert embedding is not None and why == ""
        assert embedding.window is None  # this embedder does not say what its model read
        await remember(cache, question)  # lookup (a miss) and store of the same text
        assert embedder.calls == 1


async def test_the_classifier_gets_the_window_with_the_same_vector() -> None:
    """A windowed embedder's window comes with the vector; the vector is ``embed``'s, bit for bit."""
    async with make() as cache:
        assert cache.semantic is not None
        question = "What is the capital of France?"
        embedding, _ = await cache.semantic.vector(question, 1.0)
        assert embedding is not None
        # Six words and a symbol, and the two end markers; all 30 characters read.
        assert embedding.window == (9, 30)
        assert embedding.vector.tobytes() == HashingEmbedder().embed_now([question])[0].tobytes()


async def test_the_classifiers_vector_is_bounded_like_a_lookup() -> None:
    embedder = GatedEmbedder()
    async with make(embedder, max_pending=1) as cache:
        assert cache.semantic is not None
        assert await cache.semantic.vector("first question", 0.02) == (None, "timeout")
        assert await cache.semantic.vector("second question", 1.0) == (None, "unavailable")  # one pending
        embedder.gate.set()
        embedding, _ = await cache.semantic.vector("first question", 1.0)  # the timed-out one, finished
        assert embedding is not None and embedder.calls == 1
    idle = make()  # never started
    assert idle.semantic is not None and await idle.semantic.vector("x", 1.0) == (None, "unavailable")


async def test_a_failing_embedder_gives_the_classifier_no_vector_not_an_exception() -> None:
    """The classify stage asks for a vector before any lookup: an embedder that raises must
    leave it to the n-gram model (``error``), as a lookup turns it into a miss."""
    async with make(BrokenEmbedder()) as cache:
        assert cache.semantic is not None
        assert await cache.semantic.vector("What is the capital of France?", 1.0) == (None, "error")


async def test_semantic_text_is_what_plan_would_embed() -> None:
    async with make(max_text_chars=40) as cache:
        question = "What is the capital of France?"
        assert cache.semantic_text(CHAT, body(question), ON, None) == question
        plan = cache.plan("t1", "m", CHAT, body(question), ON, None)
        assert plan.semantic is not None and plan.semantic.text == question
        assert cache.semantic_text(CHAT, body(question), CacheSettings(), None) is None  # tenant: semantic off
        off = CacheSettings(enabled=False, semantic=SemanticCacheSettings(enabled=True))
        assert cache.semantic_text(CHAT, body(question), off, None) is None
        assert cache.semantic_text(CHAT, body(question, temperature=1), ON, None) is None  # not cacheable
        assert cache.semantic_text(CHAT, body(question), ON, "no-cache, no-store") is None
        assert cache.semantic_text(CHAT, body(question), ON, "no-store") == question  # still looked up
        assert cache.semantic_text(CHAT, body(question + " And Peru's?"), ON, None) is None  # > 40 characters
        assert cache.semantic_text(EMBEDDINGS, {"input": question}, ON, None) is None
        assert sample(cache, "fleetgate_cache_bypass_total", reason="semantic_long_text") == 0  # uncounted
