"""An in-process vector index: unit vectors grouped by scope, top-k by cosine within one scope.

Entries of different scopes (a tenant, a model, a system prompt: whatever the cache layer
puts in the scope string) never meet: each scope keeps its own arrays, so a search costs
time in proportion to that scope's entries only and cannot return another scope's entry.

Search is exact below ``exact_below`` entries (one BLAS matrix-vector product). Above it,
the index first ranks every entry by the Hamming distance between sign-bit sketches (48
bytes per 384-d vector, a 32nd of the float32 vector: numpy's ``bitwise_count``), then
scores only the ``shortlist`` closest by exact cosine. The angle between two vectors is
proportional to the expected share of differing sign bits (Charikar, "Similarity estimation
techniques from rounding algorithms", STOC 2002), and cache hits need cosines of 0.8 and
more, far from those of unrelated texts, so the true neighbours land in the shortlist. The
shortlist is cut by a histogram of the distances (``nearest_rows``), a linear pass over
small integers, instead of a partial sort. The figures that chose this design are kept in
``bench/results/vector-index-history.md``.

Deleting swaps the last row into the freed one, so rows stay dense and deletes cost O(1).
Not thread-safe: call it from one thread (the event loop), or guard it with a lock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Vector = npt.NDArray[np.float32]

# Below this many entries in a scope, the exact scan is cheaper than sketch + rerank.
DEFAULT_EXACT_BELOW = 4096
# Candidates re-scored exactly after the sketch pass: far more than the handful of
# near-duplicates a query can have, and still a negligible gather (128 x 1.5 KB).
DEFAULT_SHORTLIST = 128
_INITIAL_CAPACITY = 64
_BITS_PER_WORD = 64
# numpy < 2.0 has no bitwise_count: fall back to a byte-wise table (slower, same answer).
_POPCOUNT_TABLE = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def _popcount(words: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint8]:
    """Set bits of each 64-bit word."""
    if hasattr(np, "bitwise_count"):
        counts: npt.NDArray[np.uint8] = np.bitwise_count(words)
        return counts
    per_byte = _POPCOUNT_TABLE[words.view(np.uint8)].reshape(-1, 8)
    summed: npt.NDArray[np.uint8] = per_byte.sum(axis=1, dtype=np.uint8)
    return summed


def _hamming(sketches: npt.NDArray[np.uint64], code: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint16]:
    """Differing bits between ``code`` and each column of ``sketches`` (words x rows).

    Word-major storage makes each step one contiguous pass over all rows, rather than a sum
    along a short row axis. The passes reuse one scratch array for the XOR instead of
    allocating one per word.
    """
    rows = sketches.shape[1]
    distance = np.zeros(rows, dtype=np.uint16)
    xor = np.empty(rows, dtype=np.uint64)
    for word in range(sketches.shape[0]):
        np.bitwise_xor(sketches[word], code[word], out=xor)
        np.add(distance, _popcount(xor), out=distance)
    return distance


def nearest_rows(distance: npt.NDArray[np.uint16], count: int, max_distance: int) -> npt.NDArray[np.intp]:
    """The ``count`` rows of smallest ``distance`` (any order; ties at the cut by row order).

    What ``np.argpartition(distance, count)[:count]`` returns, in a different order and tie
    choice, without sorting: distances are small integers (at most ``max_distance``), so
    one histogram finds the cut distance, and two passes collect the rows below it and as
    many at it as fit.
    """
    if count >= len(distance):
        return np.arange(len(distance))
    histogram = np.bincount(distance, minlength=max_distance + 1)
    cut = int(np.searchsorted(np.cumsum(histogram), count))  # the first distance reaching count rows
    below = np.flatnonzero(distance < cut)
    at_cut = np.flatnonzero(distance == cut)[: count - len(below)]
    return np.concatenate([below, at_cut])


@dataclass(frozen=True, slots=True)
class SearchHit:
    """One entry found by a search: its key and its cosine similarity to the query."""

    key: str
    score: float


class _Scope:
    """The rows of one scope: vectors, their sign sketches and keys, densely packed.

    ``sketches`` is word-major (``words x capacity``): see ``_hamming``.
    """

    def __init__(self, dimension: int, words: int) -> None:
        self.vectors = np.empty((_INITIAL_CAPACITY, dimension), dtype=np.float32)
        self.sketches = np.empty((words, _INITIAL_CAPACITY), dtype=np.uint64)
        self.keys: list[str] = []
        self.rows: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def grow(self) -> None:
        size, capacity = len(self.keys), 2 * self.vectors.shape[0]
        vectors = np.empty((capacity, self.vectors.shape[1]), dtype=np.float32)
        vectors[:size] = self.vectors[:size]
        sketches = np.empty((self.sketches.shape[0], capacity), dtype=np.uint64)
        sketches[:, :size] = self.sketches[:, :size]
        self.vectors, self.sketches = vectors, sketches


class VectorIndex:
    """Unit vectors under string keys, searched by cosine within one scope at a time."""

    def __init__(
        self,
        dimension: int,
        *,
        exact_below: int = DEFAULT_EXACT_BELOW,
        shortlist: int = DEFAULT_SHORTLIST,
    ) -> None:
        if dimension <= 0:
            raise ValueError("dimension must be positive")
        self.dimension = dimension
        self.exact_below = exact_below
        self.shortlist = shortlist
        # Sign bits are packed in bytes then viewed as 64-bit words: pad to whole words.
        self._words = -(-dimension // _BITS_PER_WORD)
        self._scopes: dict[str, _Scope] = {}

    def __len__(self) -> int:
        return sum(len(scope) for scope in self._scopes.values())

    def count(self, scope: str) -> int:
        """Entries held in ``scope``."""
        found = self._scopes.get(scope)
        return len(found) if found is not None else 0

    def __contains__(self, item: tuple[str, str]) -> bool:
        scope, key = item
        found = self._scopes.get(scope)
        return found is not None and key in found.rows

    def vector(self, scope: str, key: str) -> Vector | None:
        """A copy of the unit vector stored under ``key`` in ``scope`` (None if absent)."""
        found = self._scopes.get(scope)
        if found is None or key not in found.rows:
            return None
        copy: Vector = found.vectors[found.rows[key]].copy()
        return copy

    def add(self, scope: str, key: str, vector: npt.ArrayLike) -> None:
        """Store ``vector`` under ``key`` in ``scope``, replacing an entry of the same key."""
        unit = self._unit(vector)
        block = self._scopes.get(scope)
        if block is None:
            block = self._scopes[scope] = _Scope(self.dimension, self._words)
        row = block.rows.get(key)
        if row is None:
            if len(block) == block.vectors.shape[0]:
                block.grow()
            row = len(block)
            block.rows[key] = row
            block.keys.append(key)
        block.vectors[row] = unit
        block.sketches[:, row] = self._sketch(unit[np.newaxis, :])[0]

    def remove(self, scope: str, key: str) -> bool:
        """Forget ``key`` in ``scope``; False if it was not there."""
        block = self._scopes.get(scope)
        if block is None or key not in block.rows:
            return False
        row = block.rows.pop(key)
        last = len(block) - 1
        if row != last:
            moved = block.keys[last]
            block.vectors[row] = block.vectors[last]
            block.sketches[:, row] = block.sketches[:, last]
            block.keys[row] = moved
            block.rows[moved] = row
        block.keys.pop()
        if not block.keys:
            del self._scopes[scope]
        return True

    def search(self, scope: str, query: npt.ArrayLike, k: int = 4, min_score: float = -1.0) -> list[SearchHit]:
        """The ``k`` entries of ``scope`` closest to ``query`` with cosine >= ``min_score``, best first."""
        block = self._scopes.get(scope)
        if block is None or k <= 0:
            return []
        unit = self._unit(query)
        size = len(block)
        if size <= max(self.exact_below, self.shortlist):
            rows = np.arange(size)
            scores = block.vectors[:size] @ unit  # a view: no copy of the matrix
        else:
            rows = self._shortlist(block, unit, size)
            scores = block.vectors[rows] @ unit
        if len(rows) > k:
            best = np.argpartition(scores, -k)[-k:]
            rows, scores = rows[best], scores[best]
        order = np.argsort(-scores, kind="stable")
        return [SearchHit(block.keys[int(rows[i])], float(scores[i])) for i in order if scores[i] >= min_score]

    # -- internals ----------------------------------------------------------------------------

    def _shortlist(self, block: _Scope, unit: Vector, size: int) -> npt.NDArray[np.intp]:
        """Rows whose sign sketch is nearest to the query's, by Hamming distance."""
        code = self._sketch(unit[np.newaxis, :])[0]
        distance = _hamming(block.sketches[:, :size], code)
        return nearest_rows(distance, self.shortlist, self._words * _BITS_PER_WORD)

    def _sketch(self, units: Vector) -> npt.NDArray[np.uint64]:
        packed = np.packbits(units > 0, axis=1)
        padded = np.zeros((units.shape[0], self._words * 8), dtype=np.uint8)
        padded[:, : packed.shape[1]] = packed
        return padded.view(np.uint64)

    def _unit(self, vector: npt.ArrayLike) -> Vector:
        array = np.asarray(vector, dtype=np.float32).reshape(-1)
        if array.shape[0] != self.dimension:
            raise ValueError(f"expected a vector of dimension {self.dimension}, got {array.shape[0]}")
        norm = float(np.linalg.norm(array))
        if not np.isfinite(norm) or norm == 0.0:
            raise ValueError("cannot index a zero or non-finite vector")
        # Embedders already normalise; dividing again costs nothing and protects the cosine.
        return array / np.float32(norm)
