"""Is a cached question a safe answer for a new one? The semantic cache's pure decision.

The index proposes the cached questions nearest to a query by cosine; this module decides
whether the best of them may answer it. A wrong hit hands a user the answer to another
question, so the decision is tuned for few false hits first and recall second.

The decision is a gradient-boosted tree ensemble over ``cache.semantic.pair_features`` (the cosine,
word-level agreement, and where the two embeddings disagree): five ensembles of shallow
trees averaged in log-odds, stored as one. It is trained by
``scripts/train_semantic_verifier.py`` on one half of a labelled question-pair set and
shipped as ``cache/semantic/data/verifier.json`` (trees, a projection, the default threshold and
the out-of-fold numbers measured on that half). Evaluating it needs numpy only: no
scikit-learn or torch at lookup time, ~0.6 ms of CPU for the top-4 candidates of a lookup.

The parameters belong to the embedder they were trained with (the cosine's scale differs
between models): bring your own embedder, retrain (see docs/semantic-cache.md).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from cache.semantic.pair_features import FEATURE_NAMES, FloatArray, feature_names, pair_features

PARAMS_FORMAT = 1
DEFAULT_PARAMS = "verifier.json"

VERIFIED = "verified"
SAME_WORDS = "same_words"
BELOW_COSINE_FLOOR = "below_cosine_floor"
LOW_SCORE = "low_score"
NO_CANDIDATE = "no_candidate"

IntArray = npt.NDArray[np.int32]

# Texts with the same words in the same order (case and punctuation aside) ask the same
# question. The training labels disagree on a few such pairs ("What is the purpose of
# life ?" vs "...life?" is marked as different): label noise the model must not learn.
_SAME_WORDS = FEATURE_NAMES.index("same_words")


class VerifierParamsError(ValueError):
    """The verifier's parameters file is missing, unreadable or of another format."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer for one pair: a hit or not, the model's score in [0, 1], and why."""

    hit: bool
    score: float
    reason: str


@dataclass(frozen=True, slots=True)
class Candidate:
    """A cached question the index proposed: its key, text, unit vector and cosine."""

    key: str
    text: str
    vector: FloatArray = field(compare=False, repr=False)
    cosine: float


@dataclass(frozen=True, slots=True)
class TreeEnsemble:
    """Binary trees as flat node arrays; the raw score sums one leaf value per tree.

    The file lists each tree's nodes with tree-local child indices and ``feature < 0`` on
    leaves; a sample goes left when ``x[feature] <= threshold`` (scikit-learn's rule), and
    the score is ``baseline`` plus one leaf value per tree, squashed by a sigmoid. Loaded,
    all nodes sit in one array, children point into it, and a leaf is its own child: every
    sample then takes ``depth`` steps through every tree with a few whole-array gathers
    (the shipped 3,000 trees of 4 leaves: ~0.4 ms of CPU for a lookup's 4 candidates).
    """

    feature: IntArray
    threshold: npt.NDArray[np.float64]
    left: IntArray
    right: IntArray
    value: FloatArray
    roots: IntArray
    baseline: float
    depth: int

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TreeEnsemble:
        trees = data["trees"]
        sizes = [len(tree["feature"]) for tree in trees]
        roots = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int32)

        def flat(key: str, dtype: type[np.generic]) -> npt.NDArray[Any]:
            return np.concatenate([np.asarray(tree[key], dtype=dtype) for tree in trees])

        feature = flat("feature", np.int32)
        offset = np.repeat(roots, sizes)
        leaf = feature < 0
        own = np.arange(len(feature), dtype=np.int32)
        return cls(
            feature=np.where(leaf, 0, feature).astype(np.int32),
            # float64: split points lie between two float32 feature values, and rounding
            # one to float32 could send a sample down the other branch than in training.
            threshold=flat("threshold", np.float64),
            left=np.where(leaf, own, flat("left", np.int32) + offset).astype(np.int32),
            right=np.where(leaf, own, flat("right", np.int32) + offset).astype(np.int32),
            value=np.where(leaf, flat("value", np.float32), 0.0).astype(np.float32),
            roots=roots,
            baseline=float(data["baseline"]),
            depth=int(data["depth"]),
        )

    def predict(self, features: FloatArray) -> npt.NDArray[np.float64]:
        """Scores in [0, 1] for a ``(n, n_features)`` matrix, all trees walked at once."""
        x = np.atleast_2d(np.asarray(features, dtype=np.float32)).astype(np.float64)
        samples, width = x.shape
        values = x.ravel()
        row_start = (np.arange(samples, dtype=np.int32) * width)[:, np.newaxis]
        node = np.broadcast_to(self.roots, (samples, len(self.roots)))
        # ``depth`` counts node levels; a leaf at level d is reached in d steps.
        for _ in range(self.depth - 1):
            goes_left = values[self.feature[node] + row_start] <= self.threshold[node]
            node = np.where(goes_left, self.left[node], self.right[node])
        raw: npt.NDArray[np.float64] = self.baseline + self.value[node].astype(np.float64).sum(axis=1)
        return np.asarray(1.0 / (1.0 + np.exp(-raw)), dtype=np.float64)


@dataclass(frozen=True, slots=True)
class VerifierParams:
    """Everything ``verifier.json`` holds that the decision needs."""

    ensemble: TreeEnsemble
    projection: FloatArray
    projection_mean: FloatArray
    threshold: float
    min_cosine: float
    feature_names: tuple[str, ...]
    info: dict[str, Any]

    @classmethod
    def load(cls, path: str | Path | None = None) -> VerifierParams:
        """Read a parameters file; the one shipped in ``cache/semantic/data`` by default."""
        try:
            if path is None:
                text = resources.files("cache.semantic").joinpath("data", DEFAULT_PARAMS).read_text("utf-8")
            else:
                text = Path(path).read_text("utf-8")
            data = json.loads(text)
        except (OSError, ValueError) as exc:
            raise VerifierParamsError(f"cannot read verifier parameters {path or DEFAULT_PARAMS}: {exc}") from exc
        return cls.from_json(data)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VerifierParams:
        if data.get("format") != PARAMS_FORMAT:
            raise VerifierParamsError(f"verifier parameters of format {data.get('format')!r}, expected {PARAMS_FORMAT}")
        try:
            mean = np.asarray(data["projection_mean"], dtype=np.float32)
            # One row per principal direction; zero rows (no projected features) keep the width.
            projection = np.asarray(data["projection"], dtype=np.float32).reshape(-1, mean.shape[0])
            names = tuple(data["features"])
            if list(names) != feature_names(projection.shape[0]):
                raise VerifierParamsError("verifier parameters were trained on other features")
            return cls(
                ensemble=TreeEnsemble.from_json(data["model"]),
                projection=projection,
                projection_mean=mean,
                threshold=float(data["threshold"]),
                min_cosine=float(data["min_cosine"]),
                feature_names=names,
                info=dict(data.get("info", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, VerifierParamsError):
                raise
            raise VerifierParamsError(f"malformed verifier parameters: {exc!r}") from exc


class SemanticVerifier:
    """Decides whether a cached question may answer a query, from texts and embeddings.

    ``threshold`` (on the score) and ``min_cosine`` (below which no model is consulted)
    default to the shipped values, chosen on training data for at most 1.6% false hits
    out of fold, both for pairs alone and for lookups in an index of all the questions;
    raise ``threshold`` for fewer false hits, never lower it without measuring
    (``bench/cache_quality.py``).
    """

    def __init__(
        self,
        params: VerifierParams | None = None,
        *,
        threshold: float | None = None,
        min_cosine: float | None = None,
    ) -> None:
        self.params = params if params is not None else VerifierParams.load()
        self.threshold = self.params.threshold if threshold is None else threshold
        self.min_cosine = self.params.min_cosine if min_cosine is None else min_cosine
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError("threshold must lie in [0, 1]")

    def features(
        self, query: str, cached: str, query_vector: FloatArray, cached_vector: FloatArray, cosine: float
    ) -> FloatArray:
        """The feature row of one pair, as the model sees it."""
        params = self.params
        return pair_features(
            query, cached, query_vector, cached_vector, cosine, params.projection, params.projection_mean
        )

    def score(
        self, query: str, cached: str, query_vector: FloatArray, cached_vector: FloatArray, cosine: float
    ) -> float:
        """The score for one pair, in [0, 1] (higher: more surely the same question)."""
        row = self.features(query, cached, query_vector, cached_vector, cosine)
        return float(self._scores(row[np.newaxis, :])[0])

    def verify(
        self, query: str, cached: str, query_vector: FloatArray, cached_vector: FloatArray, cosine: float
    ) -> Verdict:
        """Hit or miss for one pair, with the score and the reason."""
        if not math.isfinite(cosine) or cosine < self.min_cosine:
            return Verdict(False, 0.0, BELOW_COSINE_FLOOR)
        row = self.features(query, cached, query_vector, cached_vector, cosine)
        return self._verdict(row, float(self._scores(row[np.newaxis, :])[0]))

    def choose(
        self, query: str, query_vector: FloatArray, candidates: Sequence[Candidate]
    ) -> tuple[Candidate | None, Verdict]:
        """The best-scoring candidate that passes, or None with the best verdict seen.

        All candidates above the cosine floor are scored in one call; the highest score
        wins rather than the highest cosine, since the model has already weighed cosine.
        """
        eligible = [c for c in candidates if math.isfinite(c.cosine) and c.cosine >= self.min_cosine]
        if not eligible:
            return None, Verdict(False, 0.0, BELOW_COSINE_FLOOR if candidates else NO_CANDIDATE)
        rows = np.vstack([self.features(query, c.text, query_vector, c.vector, c.cosine) for c in eligible])
        scores = self._scores(rows)
        best = int(np.argmax(scores))
        verdict = self._verdict(rows[best], float(scores[best]))
        return (eligible[best] if verdict.hit else None), verdict

    def _scores(self, rows: FloatArray) -> npt.NDArray[np.float64]:
        scores = self.params.ensemble.predict(rows)
        return np.where(rows[:, _SAME_WORDS] == 1.0, 1.0, scores)

    def _verdict(self, row: FloatArray, score: float) -> Verdict:
        if row[_SAME_WORDS] == 1.0:
            return Verdict(True, score, SAME_WORDS)
        return Verdict(score >= self.threshold, score, VERIFIED if score >= self.threshold else LOW_SCORE)
