"""The hashing embedder: deterministic unit vectors without a model, for tests."""

from __future__ import annotations

import numpy as np
import pytest

from cache.semantic.embedder import HASHING_MAX_PIECES, Embedder, HashingEmbedder, WindowedEmbedder


async def test_vectors_are_deterministic_unit_and_shaped() -> None:
    embedder = HashingEmbedder(64)
    assert isinstance(embedder, Embedder)
    first = await embedder.embed(["How do I learn Python?", "", "Best pizza in Rome"])
    again = await HashingEmbedder(64).embed(["How do I learn Python?", "", "Best pizza in Rome"])
    assert first.shape == (3, 64) and first.dtype == np.float32
    np.testing.assert_array_equal(first, again)
    np.testing.assert_allclose(np.linalg.norm(first, axis=1), 1.0, rtol=1e-6)
    assert (await embedder.embed([])).shape == (0, 64)


async def test_shared_words_mean_closer_vectors() -> None:
    a, b, c = await HashingEmbedder().embed(
        ["How do I learn Python quickly?", "How can I learn Python fast?", "What is the capital of Peru?"]
    )
    assert float(a @ b) > float(a @ c)


def test_dimension_is_checked() -> None:
    with pytest.raises(ValueError):
        HashingEmbedder(4)


async def test_the_window_counts_words_and_symbols_up_to_the_models_limit() -> None:
    embedder = HashingEmbedder(64)
    assert isinstance(embedder, WindowedEmbedder)
    texts = ["How do I learn Python?", "", "word " * 300]
    embedded = await embedder.embed_windowed(texts)
    np.testing.assert_array_equal(embedded.vectors, await embedder.embed(texts))
    assert embedded.windows is not None
    # Five words and "?", plus the two end markers; every character read.
    assert embedded.windows[0] == (8, 22)
    assert embedded.windows[1] == (2, 0)
    # 254 words read of 300, the last ending at character 254 * 5 - 1.
    assert embedded.windows[2] == (HASHING_MAX_PIECES, 1269)
