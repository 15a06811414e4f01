"""The semantic cache's local mirror: cached questions by scope, with expiry, searchable by meaning.

Every gateway process keeps one ``SemanticIndex`` in memory and searches it on the request
path; the shared copy lives in a ``SemanticStore`` (Redis or this process's memory) and
``cache.semantic.sync`` keeps the mirror equal to it. An entry is a cached question: its
scope (``cache.keys.semantic_query``), its text and unit vector, the exact-cache key of the
answer, and when it expires (wall-clock seconds, the store's clock). Vectors are kept as
they travel, rounded through float16 (``encode_vector``), so every process holds the same
numbers and reaches the same verdict for the same query.

Pure and synchronous: time is passed in. ``expire(now)`` pops entries from a heap, so it
costs nothing while nothing expires; ``candidates`` never returns an expired entry.
Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from cache.semantic.vector_index import Vector, VectorIndex
from cache.semantic.verifier import Candidate

# How vectors are stored and sent: half the bytes of float32, and a cosine changes by ~1e-4,
# far below any decision boundary the verifier draws.
VECTOR_DTYPE = np.dtype("<f2")


def encode_vector(vector: npt.ArrayLike) -> bytes:
    """The vector as little-endian float16 bytes."""
    return np.asarray(vector, dtype=np.float32).reshape(-1).astype(VECTOR_DTYPE).tobytes()


def decode_vector(raw: bytes, dimension: int) -> Vector:
    """A float32 vector from ``encode_vector``'s bytes; ValueError on the wrong length."""
    if len(raw) != dimension * VECTOR_DTYPE.itemsize:
        raise ValueError(f"a vector of {len(raw)} bytes, expected {dimension * VECTOR_DTYPE.itemsize}")
    decoded: Vector = np.frombuffer(raw, dtype=VECTOR_DTYPE).astype(np.float32)
    return decoded


def round_vector(vector: npt.ArrayLike) -> Vector:
    """The vector as every process will hold it after storage (float16 precision)."""
    rounded: Vector = np.asarray(vector, dtype=np.float32).reshape(-1).astype(VECTOR_DTYPE).astype(np.float32)
    return rounded


@dataclass(frozen=True, slots=True)
class SemanticEntry:
    """One cached question. ``id`` is its answer's digest, unique across tenants and scopes."""

    id: str
    scope: str
    text: str
    vector: Vector = field(compare=False, repr=False)
    answer_key: str
    expires_at: float = 0.0


@dataclass(frozen=True, slots=True)
class _Meta:
    scope: str
    text: str
    answer_key: str
    expires_at: float


class SemanticIndex:
    """Entries by id, their vectors by scope (a ``VectorIndex``), and an expiry heap."""

    def __init__(self, dimension: int) -> None:
        self.dimension = dimension
        self._vectors = VectorIndex(dimension)
        self._meta: dict[str, _Meta] = {}
        # (expires_at, id); an id re-added with a later expiry leaves a stale item behind,
        # recognised on pop because its time no longer matches the entry's.
        self._expiry: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._meta)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._meta

    def count(self, scope: str) -> int:
        """Entries held in ``scope``."""
        return self._vectors.count(scope)

    def get(self, entry_id: str) -> SemanticEntry | None:
        """The entry ``entry_id`` (vector included), or None."""
        meta = self._meta.get(entry_id)
        if meta is None:
            return None
        vector = self._vectors.vector(meta.scope, entry_id)
        assert vector is not None  # the two maps change together
        return SemanticEntry(entry_id, meta.scope, meta.text, vector, meta.answer_key, meta.expires_at)

    def add(self, entry: SemanticEntry) -> None:
        """Hold ``entry``, replacing one of the same id (which may have moved scope)."""
        old = self._meta.get(entry.id)
        if old is not None and old.scope != entry.scope:
            self._vectors.remove(old.scope, entry.id)
        self._vectors.add(entry.scope, entry.id, entry.vector)
        self._meta[entry.id] = _Meta(entry.scope, entry.text, entry.answer_key, entry.expires_at)
        heapq.heappush(self._expiry, (entry.expires_at, entry.id))

    def remove(self, entry_id: str) -> bool:
        """Forget ``entry_id``; False if it was not held."""
        meta = self._meta.pop(entry_id, None)
        if meta is None:
            return False
        self._vectors.remove(meta.scope, entry_id)
        return True

    def expire(self, now: float) -> int:
        """Drop the entries whose time has come; how many were dropped."""
        dropped = 0
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, entry_id = heapq.heappop(self._expiry)
            meta = self._meta.get(entry_id)
            if meta is not None and meta.expires_at == expires_at:
                self.remove(entry_id)
                dropped += 1
        # Stale heap items (removed or re-added ids) are dropped as they surface; compact
        # when they dominate so a long-lived process does not accumulate them.
        if len(self._expiry) > 2 * len(self._meta) + 1024:
            self._expiry = [(m.expires_at, i) for i, m in self._meta.items()]
            heapq.heapify(self._expiry)
        return dropped

    def candidates(self, scope: str, vector: npt.ArrayLike, *, k: int, min_score: float, now: float) -> list[Candidate]:
        """The ``k`` live entries of ``scope`` closest to ``vector`` with cosine >= ``min_score``."""
        found = []
        for hit in self._vectors.search(scope, vector, k=k, min_score=min_score):
            meta = self._meta[hit.key]
            if meta.expires_at <= now:
                continue
            stored = self._vectors.vector(scope, hit.key)
            assert stored is not None
            found.append(Candidate(hit.key, meta.text, stored, hit.score))
        return found

    def adopt(self, other: SemanticIndex) -> None:
        """Take over ``other``'s entries in place of this index's own (a full reload)."""
        if other.dimension != self.dimension:
            raise ValueError("cannot adopt an index of another dimension")
        self._vectors, self._meta, self._expiry = other._vectors, other._meta, other._expiry
        other._vectors, other._meta, other._expiry = VectorIndex(other.dimension), {}, []
