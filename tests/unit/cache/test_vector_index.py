"""The vector index: cosine top-k within one scope, adds, replaces and O(1) deletes."""

from __future__ import annotations

import numpy as np
import pytest

from cache.semantic.vector_index import SearchHit, VectorIndex, nearest_rows


def unit(*values: float) -> np.ndarray:
    v = np.asarray(values, dtype=np.float32)
    return v / np.linalg.norm(v)


def test_search_ranks_by_cosine_best_first() -> None:
    index = VectorIndex(3)
    index.add("s", "x", [1, 0, 0])
    index.add("s", "y", [0, 1, 0])
    index.add("s", "xy", [1, 1, 0])
    hits = index.search("s", [1, 0.1, 0], k=3)
    assert [h.key for h in hits] == ["x", "xy", "y"]
    # cos((1, 0.1, 0), (1, 0, 0)) = 1 / sqrt(1.01)
    assert hits[0].score == pytest.approx(1 / np.sqrt(1.01), abs=1e-6)
    assert hits[1].score == pytest.approx(1.1 / np.sqrt(1.01) / np.sqrt(2), abs=1e-6)


def test_k_and_min_score_bound_the_answer() -> None:
    index = VectorIndex(2)
    index.add("s", "a", [1, 0])
    index.add("s", "b", [1, 1])
    index.add("s", "c", [0, 1])
    assert [h.key for h in index.search("s", [1, 0], k=1)] == ["a"]
    # cos 45 degrees = 0.707: kept at 0.7, dropped at 0.71
    assert [h.key for h in index.search("s", [1, 0], k=3, min_score=0.7)] == ["a", "b"]
    assert [h.key for h in index.search("s", [1, 0], k=3, min_score=0.71)] == ["a"]
    assert index.search("s", [1, 0], k=0) == []


def test_scopes_never_meet() -> None:
    index = VectorIndex(2)
    index.add("tenant-a", "k", [1, 0])
    index.add("tenant-b", "k", [0, 1])
    assert index.search("tenant-a", [0, 1], k=5) == [SearchHit("k", pytest.approx(0.0, abs=1e-7))]  # type: ignore[arg-type]
    assert index.search("tenant-c", [0, 1], k=5) == []
    assert index.count("tenant-a") == index.count("tenant-b") == 1
    assert len(index) == 2
    assert ("tenant-a", "k") in index and ("tenant-c", "k") not in index


def test_add_under_an_existing_key_replaces_the_vector() -> None:
    index = VectorIndex(2)
    index.add("s", "k", [1, 0])
    index.add("s", "k", [0, 1])
    assert index.count("s") == 1
    assert index.search("s", [0, 1], k=1)[0].score == pytest.approx(1.0)


def test_remove_moves_the_last_row_into_the_hole() -> None:
    index = VectorIndex(2)
    for i, angle in enumerate((0.0, 0.5, 1.0)):
        index.add("s", f"k{i}", [np.cos(angle), np.sin(angle)])
    assert index.remove("s", "k0")
    assert not index.remove("s", "k0")
    assert not index.remove("other", "k1")
    # k2 now sits in row 0 and must still be found under its own key and vector.
    top = index.search("s", [np.cos(1.0), np.sin(1.0)], k=1)[0]
    assert top.key == "k2" and top.score == pytest.approx(1.0)
    assert index.remove("s", "k1") and index.remove("s", "k2")
    assert index.count("s") == 0 and index.search("s", [1, 0]) == []


def test_vectors_are_normalised_and_checked() -> None:
    index = VectorIndex(2)
    index.add("s", "k", [3, 4])  # length 5: stored as (0.6, 0.8)
    np.testing.assert_allclose(index.vector("s", "k"), [0.6, 0.8], rtol=1e-6)  # type: ignore[arg-type]
    assert index.vector("s", "other") is None and index.vector("t", "k") is None
    assert index.search("s", [6, 8], k=1)[0].score == pytest.approx(1.0)
    with pytest.raises(ValueError, match="dimension 2"):
        index.add("s", "bad", [1, 2, 3])
    with pytest.raises(ValueError, match="zero"):
        index.add("s", "bad", [0, 0])
    with pytest.raises(ValueError):
        VectorIndex(0)


def test_growth_keeps_every_row() -> None:
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((300, 8)).astype(np.float32)
    index = VectorIndex(8)
    for i, v in enumerate(vectors):
        index.add("s", str(i), v)
    for i in (0, 150, 299):
        assert index.search("s", vectors[i], k=1)[0].key == str(i)


def test_sketch_shortlist_finds_the_same_neighbours_as_an_exact_scan() -> None:
    rng = np.random.default_rng(7)
    base = rng.standard_normal((3000, 64)).astype(np.float32)
    exact = VectorIndex(64, exact_below=10_000)
    sketched = VectorIndex(64, exact_below=0, shortlist=64)
    for i, v in enumerate(base):
        exact.add("s", str(i), v)
        sketched.add("s", str(i), v)
    for i in range(0, 3000, 97):
        # A near-duplicate of row i (cosine ~0.95), as a rephrased question would be.
        query = base[i] / np.linalg.norm(base[i]) + rng.standard_normal(64).astype(np.float32) * 0.04
        want = exact.search("s", query, k=3)
        got = sketched.search("s", query, k=3)
        assert got[0].key == want[0].key == str(i)
        assert got[0].score == pytest.approx(want[0].score, abs=1e-6)


def test_nearest_rows_takes_the_smallest_distances_ties_by_row_order() -> None:
    distance = np.array([5, 1, 3, 1, 3, 0, 3, 7], dtype=np.uint16)
    # 0 (row 5), 1 (rows 1, 3), then two of the three 3s: rows 2 and 4, the first ones.
    assert sorted(nearest_rows(distance, 5, max_distance=8).tolist()) == [1, 2, 3, 4, 5]
    assert sorted(nearest_rows(distance, 3, max_distance=8).tolist()) == [1, 3, 5]
    assert sorted(nearest_rows(distance, 8, max_distance=8).tolist()) == list(range(8))
    assert sorted(nearest_rows(distance, 20, max_distance=8).tolist()) == list(range(8))


def test_nearest_rows_picks_the_distances_argpartition_picks() -> None:
    rng = np.random.default_rng(3)
    for size, count in ((1000, 128), (5000, 64), (300, 299)):
        distance = rng.integers(0, 385, size=size).astype(np.uint16)
        rows = nearest_rows(distance, count, max_distance=384)
        assert len(rows) == count == len(set(rows.tolist()))
        assert sorted(distance[rows].tolist()) == sorted(distance[np.argpartition(distance, count)[:count]].tolist())
