"""What the semantic verifier looks at in a (query, cached question) pair: plain numbers.

Cosine similarity alone cannot tell "How do I buy a gun with a licence in India?" from
"... without a licence ...", nor "IIT JEE 2017" from "IIT JEE 2016": such pairs score 0.98
while many true rephrasings score 0.85. What separates them is visible in the words: a
number or a name that differs, a negation on one side, content words left unmatched,
the same words in another order ("convert ethanol to ethanoic acid" and back). Each is a
*feature* here, weighed by a trained model, rather than a hard veto: vetoes removed true
hits as fast as false ones (see docs/semantic-cache.md).

Every feature is symmetric in the two texts (the model is trained on unordered pairs),
cheap (~50 us per pair in pure Python) and needs only the texts and their sentence
embeddings, which the index keeps anyway. The same function computes the features for
training (``scripts/train_semantic_verifier.py``) and at lookup time, so they cannot drift.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]

# Function words carry grammar, not topic: "how do I" vs "how can I" must not count as a
# difference. A short fixed list keeps training and lookup identical without NLP packages.
STOPWORDS = frozenset(
    """a an the of to in on for and or is are was were be been being do does did i my me you
    your it its this that these those what which who whom how why when where can could should
    would will shall with as at by from about into than then there their they them we our us
    he she his her have has had any some most more best good way ways get if so""".split()
)
NEGATIONS = frozenset(
    "not no never without cannot nor don't doesn't isn't aren't can't won't didn't "
    "shouldn't wouldn't couldn't wasn't weren't".split()
)
# The first of these in a question says what kind of answer it wants (a reason, a
# method, a date); rephrasings mostly keep it, different questions often do not.
QUESTION_WORDS = (
    "what",
    "how",
    "why",
    "who",
    "when",
    "where",
    "which",
    "is",
    "are",
    "can",
    "do",
    "does",
    "should",
    "will",
    "would",
)

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)?")
# A capitalised word that does not open a sentence: a name, a place, a product.
_NAME = re.compile(r"(?<!^)(?<![.?!] )\b[A-Z][a-zA-Z]+")

FEATURE_NAMES = (
    "cosine",
    "word_jaccard",
    "content_jaccard",
    "trigram_jaccard",
    "bigram_jaccard",
    "word_sequence_ratio",
    "content_sequence_ratio",
    "common_word_order",
    "length_ratio",
    "log_length_difference",
    "log_unmatched_content_max",
    "log_unmatched_content_min",
    "number_mismatch",
    "has_number",
    "negation_mismatch",
    "name_mismatch",
    "log_names_unmatched",
    "question_word_same",
    "same_words",
)


def _stem(word: str) -> str:
    """A crude suffix strip so "phones"/"phone" and "learning"/"learn" match."""
    for suffix in ("ing", "ed", "es", "s"):
        if len(word) > 4 and word.endswith(suffix):
            return word[: -len(suffix)]
    return word


def _jaccard(a: set[str] | set[tuple[str, str]], b: set[str] | set[tuple[str, str]]) -> float:
    union = len(a | b)
    return len(a & b) / union if union else 1.0


def _trigrams(text: str) -> set[str]:
    return {text[i : i + 3] for i in range(max(1, len(text) - 2))}


class _Text:
    """The parts of one text the features compare, computed once per text."""

    __slots__ = ("bigrams", "content", "lower", "names", "negated", "numbers", "question_word", "stems", "words")

    def __init__(self, text: str) -> None:
        self.lower = text.lower()
        self.words = _WORD.findall(self.lower)
        self.bigrams = set(zip(self.words, self.words[1:], strict=False))
        self.stems = [_stem(w) for w in self.words if w not in STOPWORDS]
        self.content = set(self.stems)
        self.numbers = set(_NUMBER.findall(text))
        self.negated = sum(w in NEGATIONS for w in self.words) % 2
        self.names = {w.lower() for w in _NAME.findall(text)}
        self.question_word = next((w for w in self.words if w in QUESTION_WORDS), "")


def lexical_features(a: str, b: str) -> list[float]:
    """The word-level features of a pair, in ``FEATURE_NAMES`` order after the cosine."""
    ta, tb = _Text(a), _Text(b)
    common_a = [w for w in ta.stems if w in tb.content]
    common_b = [w for w in tb.stems if w in ta.content]
    order = difflib.SequenceMatcher(None, common_a, common_b, autojunk=False).ratio() if common_a else 1.0
    only_a, only_b = len(ta.content - tb.content), len(tb.content - ta.content)
    longest = max(len(ta.words), len(tb.words), 1)
    return [
        _jaccard(set(ta.words), set(tb.words)),
        _jaccard(ta.content, tb.content),
        _jaccard(_trigrams(ta.lower), _trigrams(tb.lower)),
        _jaccard(ta.bigrams, tb.bigrams),
        difflib.SequenceMatcher(None, ta.words, tb.words, autojunk=False).ratio(),
        difflib.SequenceMatcher(None, ta.stems, tb.stems, autojunk=False).ratio(),
        order,
        min(len(ta.words), len(tb.words)) / longest,
        float(np.log1p(abs(len(ta.words) - len(tb.words)))),
        float(np.log1p(max(only_a, only_b))),
        float(np.log1p(min(only_a, only_b))),
        float(ta.numbers != tb.numbers),
        float(bool(ta.numbers or tb.numbers)),
        float(ta.negated != tb.negated),
        float(ta.names != tb.names),
        float(np.log1p(len(ta.names ^ tb.names))),
        float(ta.question_word == tb.question_word),
        float(ta.words == tb.words),
    ]


def projected_features(u: FloatArray, v: FloatArray, projection: FloatArray, mean: FloatArray) -> FloatArray:
    """``|Pu - Pv|`` and ``Pu * Pv`` for a few principal directions ``P`` of the embeddings.

    Which directions two vectors disagree on says more than the cosine, which sums them
    all: a pair that differs along a "place" direction is riskier than one differing in
    phrasing. A handful of directions keeps the model small. ``mean`` centres the vectors
    as the principal components were computed on centred ones.
    """
    pu, pv = projection @ (u - mean), projection @ (v - mean)
    return np.concatenate([np.abs(pu - pv), pu * pv]).astype(np.float32)


def pair_features(
    query: str,
    cached: str,
    query_vector: FloatArray,
    cached_vector: FloatArray,
    cosine: float,
    projection: FloatArray,
    mean: FloatArray,
) -> FloatArray:
    """The full feature vector of one pair: cosine, lexical features, projected features."""
    head = np.asarray([cosine, *lexical_features(query, cached)], dtype=np.float32)
    return np.concatenate([head, projected_features(query_vector, cached_vector, projection, mean)])


def feature_names(projection_dims: int) -> list[str]:
    """Names of ``pair_features``' columns for a projection of ``projection_dims`` rows."""
    return [
        *FEATURE_NAMES,
        *(f"proj_absdiff_{i}" for i in range(projection_dims)),
        *(f"proj_product_{i}" for i in range(projection_dims)),
    ]


def feature_matrix(
    queries: Sequence[str],
    cached: Sequence[str],
    query_vectors: FloatArray,
    cached_vectors: FloatArray,
    projection: FloatArray,
    mean: FloatArray,
) -> FloatArray:
    """``pair_features`` for many pairs at once (training and benchmarks)."""
    cosines = np.einsum("ij,ij->i", query_vectors, cached_vectors)
    rows = [
        pair_features(q, c, query_vectors[i], cached_vectors[i], float(cosines[i]), projection, mean)
        for i, (q, c) in enumerate(zip(queries, cached, strict=True))
    ]
    return np.vstack(rows).astype(np.float32)
