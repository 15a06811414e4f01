"""The complexity classifier's embedding head: a logistic model over a sentence embedding.

The semantic cache embeds a request's text to compare it by meaning (all-MiniLM-L6-v2 with
the shipped layers, 384 dimensions). The same vector says a good deal about how hard the
ask is, and better than words do on prompts written by people the model never read
(``bench/results/classifier.md``): a short technical ask with no word any training prompt
used still lands near other technical asks. When a request's vector is at hand the head
scores it; the static head (``routing.static_head``) scores everything else.

The logit is ``weights . vector + ngram_weight * ngram_logit + length_weight *
log1p(characters) + chars_per_token_weight * log(characters per token) + word_zipf_weight *
the words' frequency + bias``, calibrated like the n-gram model's (``scale * logit
+ shift`` through a sigmoid) so that the same tier boundaries hold for both heads.
``ngram_weight``, ``length_weight``, ``chars_per_token_weight`` and ``word_zipf_weight`` are
what training found worth adding (zero when they did not help on held-out sources). The words'
frequency is ``routing.word_frequency``'s (``WordFrequency.offset``: their mean Zipf frequency
less everyday text's), of the words the static head reads of the instruction.

Characters per token (``chars_per_token``) are those of the window the model read: its word
pieces, and the characters of the text they cover (``cache.semantic.embed_model.TokenWindow``),
counted by the embedder's own tokenisation and handed over with the vector. Code, formulas and
identifiers split into many short pieces, plain prose into few long ones, and the vector, a
mean over the pieces, does not keep how many there were. It moves real users' hard prompts
(arena-hard, held out whole) most (bench/results/classifier.md).

Everything is in ``routing/data/classifier-embedding.json``, written by
``scripts/train_classifier.py --embedding``, with the identity of the embedder whose
vectors it was trained on: vectors of another model (``cache.semantic.model_dir`` of one's
own) mean something else, and the head refuses them (``accepts``).

Cost: one dot product over 384 floats and two logarithms, a few microseconds. The embedding
itself (~5 ms of CPU) is the semantic cache's, computed off the event loop; see
docs/routing.md for when a classified request pays for it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from routing.data_file import calibrated, read_data_file

HEAD_FORMAT = 3
# Files of format 1 (no ``chars_per_token_weight``) and 2 (no ``word_zipf_weight``) are read
# with the weights they lack at 0: they score as they did. A gateway that only reads older
# formats refuses a newer one rather than drop an input.
HEAD_FORMATS_READ = (1, 2, HEAD_FORMAT)
DEFAULT_HEAD = "classifier-embedding.json"
# The text embedded for classification is cut here: the model reads its first 256 word
# pieces (~1,000 characters of English, fewer of code), so 4096 characters lose nothing it
# would read, and tokenising a pasted document costs nothing extra.
EMBED_MAX_CHARS = 4096


class EmbeddingHeadError(ValueError):
    """The embedding head's file is missing, unreadable or of another format."""


@dataclass(frozen=True, slots=True)
class HeadLogit:
    """The head's logit, and the parts it is the sum of (for the debug header)."""

    total: float
    embedding: float  # weights . vector + bias
    ngram: float  # ngram_weight * the n-gram model's logit
    length: float  # length_weight * log1p(characters)
    chars_per_token: float  # chars_per_token_weight * chars_per_token(window)
    word_zipf: float  # word_zipf_weight * the words' frequency (``WordFrequency.offset``)


@dataclass(frozen=True, slots=True)
class EmbeddingHead:
    """Weights over the embedding, the extra inputs' weights, the calibration, and whose vectors."""

    weights: npt.NDArray[np.float64]
    bias: float
    ngram_weight: float
    length_weight: float
    chars_per_token_weight: float
    scale: float
    shift: float
    embedder: str  # identity of the embedder the head was trained on (``Embedder.identity``)
    word_zipf_weight: float = 0.0

    @property
    def dimension(self) -> int:
        return int(self.weights.shape[0])

    @property
    def uses_ngrams(self) -> bool:
        return self.ngram_weight != 0.0

    @property
    def uses_window(self) -> bool:
        """Whether the head needs the window the model read (``logit``'s ``window``)."""
        return self.chars_per_token_weight != 0.0

    @property
    def uses_words(self) -> bool:
        """Whether the head needs the words' frequency (``logit``'s ``word_zipf``)."""
        return self.word_zipf_weight != 0.0

    def accepts(self, identity: str, dimension: int) -> bool:
        """Whether vectors of this embedder are the ones the head was trained on."""
        return identity == self.embedder and dimension == self.dimension

    def logit(
        self,
        vector: npt.NDArray[np.floating],
        ngram_logit: float,
        chars: int,
        window: tuple[int, int] | None = None,
        word_zipf: float | None = None,
    ) -> HeadLogit:
        """The logit of ``vector``; ``chars``: the instruction's length; ``window``: the (word
        pieces, characters) the model read of it, needed when ``uses_window``; ``word_zipf``:
        its words' frequency (``routing.word_frequency.WordFrequency.offset``), needed when
        ``uses_words``."""
        embedding = float(np.dot(self.weights, vector)) + self.bias
        ngram = self.ngram_weight * ngram_logit
        length = self.length_weight * math.log1p(chars)
        per_token = 0.0
        if self.uses_window:
            if window is None:
                raise ValueError("this embedding head weighs the token window, and none was given")
            per_token = self.chars_per_token_weight * chars_per_token(*window)
        zipf = 0.0
        if self.uses_words:
            if word_zipf is None:
                raise ValueError("this embedding head weighs the words' frequency, and none was given")
            zipf = self.word_zipf_weight * word_zipf
        return HeadLogit(embedding + ngram + length + per_token + zipf, embedding, ngram, length, per_token, zipf)

    def score(self, logit: float) -> float:
        return calibrated(logit, self.scale, self.shift)


def embedding_text(instruction: str) -> str:
    """The text embedded for classification: the instruction, stripped, at most ``EMBED_MAX_CHARS``.

    Stripped as the semantic cache strips its text, so that a request the cache embeds is
    embedded once for both.
    """
    return instruction.strip()[:EMBED_MAX_CHARS]


def chars_per_token(pieces: int, chars: int) -> float:
    """The head's input from the window the model read: ``log(characters / word pieces)``
    (the pieces count the model's two end markers; an empty text counts one character)."""
    return math.log(max(chars, 1) / max(pieces, 1))


def load_head(path: str | Path | None = None) -> EmbeddingHead:
    """Read a head file (the shipped one by default)."""
    data = read_data_file(path, DEFAULT_HEAD, HEAD_FORMATS_READ, EmbeddingHeadError, "the classifier's embedding head")
    try:
        weights = np.asarray([float(w) for w in data["weights"]], dtype=np.float64)
        if weights.ndim != 1 or weights.size == 0:
            raise ValueError("no weights")
        return EmbeddingHead(
            weights,
            float(data["bias"]),
            float(data["ngram_weight"]),
            float(data["length_weight"]),
            float(data["chars_per_token_weight"]) if data["format"] >= 2 else 0.0,
            float(data["scale"]),
            float(data["shift"]),
            str(data["embedder"]),
            float(data["word_zipf_weight"]) if data["format"] >= 3 else 0.0,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EmbeddingHeadError(f"the classifier's embedding head is malformed: {exc}") from exc


@functools.cache
def default_head() -> EmbeddingHead:
    """The shipped head, read once."""
    return load_head()
