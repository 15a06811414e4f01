"""Complexity classifier: a score in [0, 1] from the static head (word-piece vectors,
``routing.static_head``), or from the embedding head when the request's sentence embedding
is at hand. The n-gram model below (words, word pairs and symbols) is the benchmark's
baseline and an optional input of the embedding head.

A request for model ``auto`` goes to the tier whose configured score range holds its
score. The score says how likely the latest user message is a prompt on which a large
model answers clearly better than a small one (RouteLLM's framing, Ong et al. 2024): hard
coding and maths asks from real users high, everyday questions and simple instructions
low. What counts as hard and easy, and why, is in docs/routing.md ("Complexity classifier").

Features (``features``): the latest user message, lower-cased, digits folded to ``0``, its
head and tail only (``routing.static_head.window``) so cost does not grow with a pasted
document: words (less ``FUNCTION_WORDS``, which carry a writer's style rather than the ask),
pairs of adjacent remaining words, and runs of one to three symbols (code syntax and
formulas: ``()``, ``=``, ``\\``). Length is not a feature: every source has its typical
length, and a model that reads it learns the source rather than the ask (docs/routing.md,
"Guarding against learning the sources instead of difficulty"). Each present feature counts
once, and the sum is divided by the square root of the number of known features present, so
a long prompt does not add up evidence for being long. The weights, the bias and the
calibration (``scale * logit + shift``, chosen so that the default tier boundaries fall
where the training script measured them out of source) are in
``routing/data/classifier.json``, written by ``scripts/train_classifier.py``; evaluating
them needs no library beyond the standard one.

Every contribution keeps its feature, so a decision explains itself: the reasons are the
features (or the static head's word pieces) that moved the score most, either way, ``+``
towards the large tier, ``-`` towards the small.

Without a vector the static head decides; the header names it and its pieces, and the words'
frequency when it is among the parts that moved the score most (``+wf:rare``: rarer words
than everyday text's; ``-wf:common``): ``score=0.79; static; +t:0,+t:2,+t:x``. With a
sentence embedding of the instruction (``vector``, the semantic cache's), the embedding head
(``routing.embedding_head``) decides instead; the header names it and the parts of its logit:
``score=0.81; embedding(emb+1.52,len+2.10,cpt-0.35,wf+0.40); none`` (after ``none``, the n-gram
features of a head that weighs the n-gram logit: ``w:`` a word, ``b:`` a word pair, ``s:``
symbols).

Only requests that are classified (model ``auto`` or a tenant's ``classify_models``) pay
for it; ``bench/classifier.py`` measures what it costs.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import urllib.parse
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from dialects.base import PromptView
from routing.data_file import calibrated, read_data_file
from routing.embedding_head import EmbeddingHead, default_head
from routing.static_head import StaticHead, default_static_head, read_words, window
from routing.word_frequency import default_word_frequency

MODEL_FORMAT = 1
DEFAULT_MODEL = "classifier.json"
MAX_REASONS = 3
# Words that say how a person writes, not what they ask: left out, so that a source's style
# (questions in QQP's "what is the", self-instruct's "you are given a") cannot stand in for
# difficulty.
FUNCTION_WORDS = frozenset(
    "a about above after again against all am an and any are as at be because been before being below between "
    "both but by can could did do does doing down during each few for from further had has have having he her "
    "here hers herself him himself his how i if in into is it its itself just me more most my myself no nor not "
    "now of off on once only or other our ours ourselves out over own same she should so some such than that the "
    "their theirs them themselves then there these they this those through to too under until up very was we "
    "were what when where which while who whom why will with would you your yours yourself yourselves please "
    "hi hello hey thanks thank".split()
)
# A reason is shown only if it moved the logit by at least this much.
REASON_MIN = 0.02

_DIGITS = re.compile(r"\d")
_WORD = re.compile(r"[^\W_]+")
_SYMBOLS = re.compile(r"[^\w\s]{1,3}")
# Shown percent-encoded in a reason: what a header cannot carry, the header's separators, "%".
_HEADER_UNSAFE = re.compile(r"[^\x21-\x7e]|[,;\"\\%]")


class ClassifierModelError(ValueError):
    """The classifier's model file is missing, unreadable or of another format."""


@dataclass(frozen=True, slots=True)
class TierRange:
    """A tier and the scores it takes: ``min_score <= score < max_score`` (the top tier includes 1.0)."""

    name: str
    min_score: float
    max_score: float


# Which head decided (``Classification.head``).
STATIC = "static"
EMBEDDING = "embedding"


@dataclass(frozen=True, slots=True)
class Classification:
    """The chosen tier, the score, the head that decided, and the features that moved the
    score most (largest first): the static head's word pieces and words' frequency, or the
    n-gram features the embedding head weighed.

    ``detail``: for the embedding head, the parts of its logit (``emb+1.52,ngram+0.40``); for
    the static head, why the embedding head did not decide when it was asked to (``timeout``),
    else empty.
    """

    tier: str
    score: float
    reasons: tuple[str, ...]
    head: str = STATIC
    detail: str = ""

    def header(self) -> str:
        """Compact debug form for a response header and the log line:
        ``score=0.81; static; +t:integral,+t:derivative,-t:joke``."""
        head = f"{self.head}({self.detail})" if self.detail else self.head
        return f"score={self.score:.2f}; {head}; {','.join(self.reasons) or 'none'}"


# The boundaries are fixed, so a tier's range means the same whichever head scores; each
# head's calibration puts them where its training script found them on prompts of sources it
# had not seen (docs/routing.md, "Evaluation and thresholds"): small below the logit under
# which 85% of easy prompts fall, large from the one over which 60% of real users' short hard
# asks fall. Those two logits are close, so medium is a thin band. The values themselves are
# arbitrary: the calibration maps each head's logits onto them.
DEFAULT_TIERS = (
    TierRange("small", 0.0, 0.45),
    TierRange("medium", 0.45, 0.5),
    TierRange("large", 0.5, 1.0),
)


@dataclass(frozen=True, slots=True)
class LinearModel:
    """Feature weights, the bias, and the calibration of the logit into a score."""

    weights: Mapping[str, float]
    bias: float
    scale: float
    shift: float

    def logit(self, feats: Iterable[str]) -> tuple[float, list[tuple[str, float]]]:
        """The uncalibrated log-odds and each known feature's contribution to it."""
        weights = self.weights
        hits = [(f, weights[f]) for f in feats if f in weights]
        if not hits:
            return self.bias, []
        norm = 1.0 / math.sqrt(len(hits))
        contributions = [(f, w * norm) for f, w in hits]
        return self.bias + sum(w for _, w in hits) * norm, contributions

    def score(self, logit: float) -> float:
        return calibrated(logit, self.scale, self.shift)


def features(text: str) -> set[str]:
    """The features of one text (the same function at training and at routing time)."""
    text = _DIGITS.sub("0", window(text).lower())
    words = _WORD.findall(text)
    words = [w for w in words if w not in FUNCTION_WORDS]
    out = {"w:" + w for w in words}
    out.update("b:" + a + " " + b for a, b in itertools.pairwise(words))
    out.update("s:" + s for s in _SYMBOLS.findall(text))
    return out


def load_model(path: str | Path | None = None) -> LinearModel:
    """Read a model file (the shipped one by default)."""
    data = read_data_file(path, DEFAULT_MODEL, (MODEL_FORMAT,), ClassifierModelError, "the classifier model")
    try:
        weights = {str(k): float(v) for k, v in data["weights"].items()}
        return LinearModel(weights, float(data["bias"]), float(data["scale"]), float(data["shift"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ClassifierModelError(f"classifier model is malformed: {exc}") from exc


@functools.cache
def default_model() -> LinearModel:
    """The shipped model, read once."""
    return load_model()


def validate_tiers(tiers: Sequence[TierRange]) -> None:
    """Raise ValueError unless the ranges are ordered, contiguous and cover [0, 1]."""
    if not tiers:
        raise ValueError("at least one tier is required")
    if tiers[0].min_score != 0.0 or tiers[-1].max_score != 1.0:
        raise ValueError("tier ranges must start at 0 and end at 1")
    for a, b in itertools.pairwise(tiers):
        if a.max_score != b.min_score:
            raise ValueError(f"tier {a.name!r} ends at {a.max_score} but {b.name!r} starts at {b.min_score}")
    for t in tiers:
        if not t.min_score < t.max_score:
            raise ValueError(f"tier {t.name!r} has an empty range")


def classify(
    prompt: PromptView,
    tiers: Sequence[TierRange] = DEFAULT_TIERS,
    model: LinearModel | None = None,
    *,
    vector: npt.NDArray[np.floating] | None = None,
    window: tuple[int, int] | None = None,
    head: EmbeddingHead | None = None,
    static: StaticHead | None = None,
    fallback: str = "",
) -> Classification:
    """Score ``prompt`` (its ``instruction``, whatever the API) and pick the tier holding the score.

    With ``vector`` (the embedding of ``embedding_text(prompt.instruction)``) the embedding
    head decides (``head``, the shipped one by default), with ``window`` (the word pieces
    and characters the model read of that text, from the same embedding) when the head
    weighs it, and the n-gram ``model``'s logit when the head weighs that; without, the
    static head (``static``, the shipped one by default), and ``fallback`` says why the
    embedding head did not (shown in the header; "" when it was not asked to).
    """
    return classify_text(
        prompt.instruction, tiers, model, vector=vector, window=window, head=head, static=static, fallback=fallback
    )


def classify_text(
    text: str,
    tiers: Sequence[TierRange] = DEFAULT_TIERS,
    model: LinearModel | None = None,
    *,
    vector: npt.NDArray[np.floating] | None = None,
    window: tuple[int, int] | None = None,
    head: EmbeddingHead | None = None,
    static: StaticHead | None = None,
    fallback: str = "",
) -> Classification:
    """Score one instruction text and pick the tier holding the score (see ``classify``)."""
    if vector is not None:
        h = head or default_head()
        if h.uses_ngrams:
            ngram_logit, contributions = (model or default_model()).logit(features(text))
        else:
            ngram_logit, contributions = 0.0, []
        zipf = default_word_frequency().offset(read_words(text)) if h.uses_words else None
        parts = h.logit(vector, ngram_logit, len(text), window, zipf)
        score = h.score(parts.total)
        detail = f"emb{parts.embedding:+.2f}"
        if h.uses_ngrams:
            detail += f",ngram{parts.ngram:+.2f}"
        if h.length_weight:
            detail += f",len{parts.length:+.2f}"
        if h.uses_window:
            detail += f",cpt{parts.chars_per_token:+.2f}"
        if h.uses_words:
            detail += f",wf{parts.word_zipf:+.2f}"
        return Classification(_tier_for(score, tiers), round(score, 3), _reasons(contributions), EMBEDDING, detail)
    s = static or default_static_head()
    static_parts = s.logit(text, reasons=4 * MAX_REASONS)
    score = s.score(static_parts.total)
    # The words' frequency competes with the pieces for a place among the reasons: it is
    # centred on everyday text, so its part says how far it moved the score (``+wf:rare``).
    frequency = ("wf:rare" if static_parts.word_zipf > 0 else "wf:common", static_parts.word_zipf)
    reasons = _reasons([("t:" + piece, part) for piece, part in static_parts.pieces] + [frequency])
    return Classification(_tier_for(score, tiers), round(score, 3), reasons, STATIC, fallback)


def _reasons(contributions: list[tuple[str, float]]) -> tuple[str, ...]:
    """The features that moved the logit most, either way, as ``+w:integral``."""
    reasons: list[str] = []
    for name, weight in sorted(contributions, key=_magnitude, reverse=True):
        if abs(weight) < REASON_MIN:
            break
        shown = _header_safe(name)
        if shown:
            reasons.append(("+" if weight > 0 else "-") + shown)
            if len(reasons) == MAX_REASONS:
                break
    return tuple(reasons)


def resolve_tier(classification: Classification, forced: str | None, allowed: Collection[str]) -> tuple[str, str]:
    """The tier to use and why: a forced tier (request header) wins only where the tenant allows it."""
    if forced and forced in allowed:
        return forced, "forced"
    if forced:
        return classification.tier, "force_denied"
    return classification.tier, "classified"


def _tier_for(score: float, tiers: Sequence[TierRange]) -> str:
    for tier in tiers:
        if tier.min_score <= score < tier.max_score:
            return tier.name
    return tiers[-1].name


def _magnitude(contribution: tuple[str, float]) -> float:
    return abs(contribution[1])


@functools.lru_cache(maxsize=8192)
def _header_safe(feature: str) -> str:
    """A feature as header-safe ASCII: spaces shown as ``_``, other characters outside
    printable ASCII and the header's separators percent-encoded as in a URL (``t:%E5%B9%B3``
    is the piece "平"); "" for a feature with no text."""
    kind, _, text = feature.partition(":")
    shown = _HEADER_UNSAFE.sub(_percent_encoded, text.replace(" ", "_").strip("_"))
    return f"{kind}:{shown}" if shown else ""


def _percent_encoded(match: re.Match[str]) -> str:
    return urllib.parse.quote(match.group(), safe="")
