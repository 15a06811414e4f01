"""The local semantic index: scopes, expiry, replacement, reloads, and the vectors' wire form."""

from __future__ import annotations

import numpy as np
import pytest

from cache.semantic.index import SemanticEntry, SemanticIndex, decode_vector, encode_vector, round_vector

DIM = 16


def unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def entry(n: int, scope: str = "t1:s", expires_at: float = 100.0, seed: int | None = None) -> SemanticEntry:
    vector = round_vector(unit(n if seed is None else seed))
    return SemanticEntry(f"id{n}", scope, f"question {n}", vector, f"t1:id{n}", expires_at)


def test_candidates_stay_within_their_scope() -> None:
    index = SemanticIndex(DIM)
    index.add(entry(1, "t1:a"))
    index.add(entry(2, "t1:b", seed=1))  # the same vector, another scope
    found = index.candidates("t1:a", unit(1), k=4, min_score=0.5, now=0)
    assert [c.key for c in found] == ["id1"]
    assert found[0].text == "question 1" and found[0].cosine == pytest.approx(1.0, abs=1e-3)
    assert index.candidates("t1:c", unit(1), k=4, min_score=0.5, now=0) == []


def test_expired_entries_are_never_candidates_and_are_dropped() -> None:
    index = SemanticIndex(DIM)
    index.add(entry(1, expires_at=10.0))
    index.add(entry(2, expires_at=20.0))
    assert [c.key for c in index.candidates("t1:s", unit(1), k=4, min_score=0.9, now=10.0)] == []
    assert index.expire(10.0) == 1
    assert len(index) == 1 and "id1" not in index
    assert index.expire(19.0) == 0


def test_re_adding_replaces_and_extends_the_expiry() -> None:
    index = SemanticIndex(DIM)
    index.add(entry(1, expires_at=10.0))
    index.add(entry(1, expires_at=50.0))
    assert len(index) == 1
    assert index.expire(30.0) == 0  # the stale heap item of the first add is ignored
    got = index.get("id1")
    assert got is not None and got.expires_at == 50.0 and got.answer_key == "t1:id1"


def test_an_entry_may_move_scope() -> None:
    index = SemanticIndex(DIM)
    index.add(entry(1, "t1:a"))
    index.add(entry(1, "t1:b"))
    assert (index.count("t1:a"), index.count("t1:b")) == (0, 1)


def test_remove_and_adopt() -> None:
    index = SemanticIndex(DIM)
    index.add(entry(1))
    assert index.remove("id1") and not index.remove("id1")
    fresh = SemanticIndex(DIM)
    fresh.add(entry(2))
    fresh.add(entry(3))
    index.add(entry(9))
    index.adopt(fresh)
    assert len(index) == 2 and "id9" not in index and len(fresh) == 0
    with pytest.raises(ValueError):
        index.adopt(SemanticIndex(DIM + 1))


def test_heap_is_compacted_when_stale_items_pile_up() -> None:
    index = SemanticIndex(DIM)
    for n in range(3000):
        index.add(entry(1, expires_at=1000.0 + n))
    index.expire(0.0)
    assert len(index._expiry) <= 2 * len(index) + 1024


def test_vectors_travel_as_float16() -> None:
    v = unit(7)
    raw = encode_vector(v)
    assert len(raw) == 2 * DIM
    back = decode_vector(raw, DIM)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, round_vector(v))
    assert abs(float(back @ v) - 1.0) < 1e-3
    with pytest.raises(ValueError):
        decode_vector(raw, DIM + 1)
