"""The labelled question pairs behind the semantic cache's training and its benchmark.

``shared/data/qqp_val.csv`` (Quora Question Pairs with hard negatives, 12,129 pairs) is
split once, reproducibly, into a training half (``scripts/train_semantic_verifier.py``
fits on it and chooses thresholds on it) and a held-out half (``bench/cache_quality.py``
reports on it and nothing else).

The split is by *connected component*, not by row: some questions occur in several pairs
("How can I lose weight quickly?" is in five), and a row split would put the same
question on both sides, letting the model be scored on text it was trained on. Questions
are linked when they share a pair; each component goes to the half chosen by the first
bit of ``sha256(f"{seed}:{smallest question of the component}")``. A hash instead of a
shuffled RNG keeps a component's half fixed whatever the file's row order or Python version.
"""

from __future__ import annotations

import csv
import hashlib
from dataclasses import dataclass
from pathlib import Path

# The seed of the published split: changing it changes which half is held out.
SPLIT_SEED = 20240611
DEFAULT_PAIRS = Path(__file__).resolve().parents[2] / "shared" / "data" / "qqp_val.csv"
TRAIN, HELD_OUT = 0, 1


@dataclass(frozen=True, slots=True)
class Pair:
    """One labelled pair: is ``question2`` a duplicate of ``question1``?"""

    question1: str
    question2: str
    duplicate: bool
    component: str  # the smallest question text of the pair's connected component


def resolve_pairs_path(path: str | Path | None = None) -> Path:
    """``path``, or the shared data file next to the repository (``../shared/data``)."""
    candidate = Path(path) if path is not None else DEFAULT_PAIRS
    if not candidate.is_file():
        fallback = Path("/work/shared/data/qqp_val.csv")
        if path is None and fallback.is_file():
            return fallback
        raise FileNotFoundError(f"question pairs not found: {candidate}")
    return candidate


def load_pairs(path: str | Path | None = None) -> list[Pair]:
    """All pairs of the CSV (columns question1, question2, is_duplicate), components set."""
    with resolve_pairs_path(path).open(newline="", encoding="utf-8") as handle:
        raw = [(r["question1"], r["question2"], r["is_duplicate"].strip() == "1") for r in csv.DictReader(handle)]
    parent: dict[str, str] = {}

    def find(text: str) -> str:
        parent.setdefault(text, text)
        while parent[text] != text:
            parent[text] = parent[parent[text]]
            text = parent[text]
        return text

    for q1, q2, _ in raw:
        a, b = find(q1), find(q2)
        if a != b:
            # Keep the smaller text as the root, so the root is the component's minimum.
            parent[max(a, b)] = min(a, b)
    return [Pair(q1, q2, dup, find(q1)) for q1, q2, dup in raw]


def half_of(pair: Pair, seed: int = SPLIT_SEED) -> int:
    """``TRAIN`` or ``HELD_OUT`` for ``pair`` (all pairs of one component share a half)."""
    digest = hashlib.sha256(f"{seed}:{pair.component}".encode()).digest()
    return digest[0] & 1


def split_pairs(pairs: list[Pair], seed: int = SPLIT_SEED) -> tuple[list[Pair], list[Pair]]:
    """(training half, held-out half) of ``pairs``, by component."""
    train = [p for p in pairs if half_of(p, seed) == TRAIN]
    held_out = [p for p in pairs if half_of(p, seed) == HELD_OUT]
    return train, held_out


def fold_of(pair: Pair, folds: int, seed: int = SPLIT_SEED) -> int:
    """A cross-validation fold for ``pair`` within its half, again by component."""
    digest = hashlib.sha256(f"{seed}:fold:{pair.component}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % folds


def duplicate_clusters(pairs: list[Pair]) -> dict[str, str]:
    """Each question's cluster: questions linked by duplicate labels (transitively).

    In an index a query may hit another labelled duplicate than its own pair's partner;
    such a hit is right. Both the benchmark and the training script's index measure use it.
    """
    parent: dict[str, str] = {}

    def find(text: str) -> str:
        parent.setdefault(text, text)
        while parent[text] != text:
            parent[text] = parent[parent[text]]
            text = parent[text]
        return text

    for pair in pairs:
        find(pair.question1)
        find(pair.question2)
        if pair.duplicate:
            parent[find(pair.question1)] = find(pair.question2)
    return {text: find(text) for text in parent}
