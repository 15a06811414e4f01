"""The static head: a complexity score from word-piece vectors, with no model to run.

The classifier's head for a request whose sentence embedding is not at hand (the semantic
cache off, or not embedding this text). It reads the instruction's word pieces, as
all-MiniLM-L6-v2's tokenizer cuts them, and gives each piece a fixed vector: the model's
output for that piece alone, projected on the vocabulary's leading principal directions (a
static distillation of the model, as Model2Vec makes them: Tulkens and van Dongen, 2024).
The text's vector is the sum of its pieces' vectors, made unit length; a logistic head over
it, log length, characters per word piece and how common the words are
(``routing.word_frequency``) gives the logit.

Because every piece of the vocabulary has a vector, a word no labelled prompt contains
still scores by what its pieces are near ("kubelet" is ``ku ##bel ##et``): that is what the
n-gram model, whose weights exist only for features its training prompts had, could not do
on sources it never read (docs/routing.md, bench/results/classifier.md).

The head is linear in the unit vector, so each piece's part of the logit is its own score
(its vector times the weights) over the sum's length: a decision explains itself by the
pieces that moved it most (``+t:integral``, ``-t:joke``).

Tokenisation is BERT's uncased one (lower case, accents stripped, punctuation and CJK
characters split off, then greedy longest-match word pieces), written out here so that the
gateway needs no tokenizer library; the training script uses the same function, so training
and routing cut a text the same way. Only the head and tail of a long text are read
(``HEAD_CHARS + TAIL_CHARS``), so the cost is bounded whatever its size.
"""

from __future__ import annotations

import base64
import functools
import itertools
import math
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from routing.data_file import calibrated, read_data_file
from routing.word_frequency import default_word_frequency

FORMAT = 2
# Files of format 1 (no ``word_zipf_weight``) are read with that weight 0: they score as they did.
FORMATS_READ = (1, FORMAT)
DEFAULT_STATIC = "classifier-static.json"
# Read of a long text, by this head and the n-gram model: its head and tail (the ask sits at
# the start or the end of a paste, and the cost stays flat whatever the size).
HEAD_CHARS = 500
TAIL_CHARS = 250
# BERT's limit: a longer word is one unknown piece.
MAX_WORD_CHARS = 100
UNKNOWN = "[UNK]"
# Printable ASCII other than letters and digits is punctuation to BERT; control characters
# other than whitespace are dropped.
_ASCII_WORDS = re.compile(r"[a-z0-9]+|\S")
_ASCII_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


class StaticHeadError(ValueError):
    """The static head's file is missing, unreadable or of another format."""


def window(text: str) -> str:
    """What the head reads of ``text``: all of it, or its head and tail."""
    if len(text) > HEAD_CHARS + TAIL_CHARS:
        return text[:HEAD_CHARS] + " " + text[-TAIL_CHARS:]
    return text


def read_words(text: str) -> list[str]:
    """The words the head reads of ``text``: ``words`` of its ``window``."""
    return words(window(text))


def words(text: str) -> list[str]:
    """BERT's basic uncased tokenisation: lower-cased, accents stripped, split on whitespace,
    each punctuation mark and CJK character its own word."""
    text = text.lower()
    if text.isascii():
        return _ASCII_WORDS.findall(_ASCII_CONTROL.sub("", text))
    text = unicodedata.normalize("NFD", text)
    # Each distinct character once (cached across texts), then one pass in C.
    return text.translate({ord(ch): _spaced(ch) for ch in set(text)}).split()


@functools.lru_cache(maxsize=8192)
def _spaced(ch: str) -> str:
    """What a character becomes before the split: dropped (accents, control characters),
    set apart (punctuation, CJK), a space, or itself."""
    category = unicodedata.category(ch)
    if category == "Mn" or ch == "\ufffd" or (category[0] == "C" and ch not in "\t\n\r"):
        return ""
    if _is_cjk(ord(ch)) or _is_punctuation(ch, category):
        return f" {ch} "
    if ch.isspace():
        return " "
    return ch


def _is_punctuation(ch: str, category: str) -> bool:
    cp = ord(ch)
    return 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126 or category[0] == "P"


def _is_cjk(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


@dataclass(frozen=True, slots=True)
class StaticParts:
    """The head's logit and its parts: the vector's (with the bias), log length's, characters
    per piece's, the words' frequency's (``word_zipf``); ``pieces``: each piece's part of the
    vector's, largest first."""

    total: float
    vector: float
    length: float
    chars_per_piece: float
    word_zipf: float
    pieces: tuple[tuple[str, float], ...]


class StaticHead:
    """Word-piece vectors, the logistic head over their unit sum, and its calibration."""

    def __init__(
        self,
        tokens: list[str],
        table: npt.NDArray[np.float32],
        weights: npt.NDArray[np.float64],
        bias: float,
        length_weight: float,
        chars_per_piece_weight: float,
        scale: float,
        shift: float,
        source: str = "",
        word_zipf_weight: float = 0.0,
    ) -> None:
        if table.shape != (len(tokens), weights.size):
            raise ValueError(f"a table of {table.shape} for {len(tokens)} pieces and {weights.size} weights")
        if UNKNOWN not in tokens:
            raise ValueError(f"the vocabulary has no {UNKNOWN}")
        self.tokens = tokens
        self.table = table
        self.weights = weights
        self.bias = bias
        self.length_weight = length_weight
        self.chars_per_piece_weight = chars_per_piece_weight
        self.scale = scale
        self.shift = shift
        self.source = source
        self.word_zipf_weight = word_zipf_weight
        self._ids = {token: i for i, token in enumerate(tokens)}
        self._unknown = self._ids[UNKNOWN]
        # Each piece's part of the logit before the division by the sum's length.
        self.piece_scores = table.astype(np.float64) @ weights
        self._pieces_of = functools.lru_cache(maxsize=65536)(self._word_pieces)

    def pieces(self, text: str) -> list[int]:
        """The word pieces of ``text`` (all of it: the caller takes the ``window``)."""
        return self._ids_of(words(text))

    def _ids_of(self, read: list[str]) -> list[int]:
        return list(itertools.chain.from_iterable(map(self._pieces_of, read)))

    def word_zipf(self, read: list[str]) -> float:
        """``word_zipf_weight`` times the frequency (``WordFrequency.offset``, the shipped
        table's) of the words ``read`` (0 when the head does not weigh it)."""
        return self.word_zipf_weight * default_word_frequency().offset(read) if self.word_zipf_weight else 0.0

    def _word_pieces(self, word: str) -> tuple[int, ...]:
        """Greedy longest-match-first word pieces; an unknown piece makes the word unknown."""
        ids = self._ids
        if word in ids:
            return (ids[word],)
        if len(word) > MAX_WORD_CHARS:
            return (self._unknown,)
        out: list[int] = []
        start = 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in ids:
                    out.append(ids[piece])
                    break
                end -= 1
            else:
                return (self._unknown,)
            start = end
        return tuple(out)

    def vector(self, ids: list[int]) -> npt.NDArray[np.float64]:
        """The unit sum of the pieces' vectors (zeros for no pieces): the head's input."""
        total = self.table[ids].sum(axis=0, dtype=np.float64) if ids else np.zeros(self.weights.size)
        norm = float(np.linalg.norm(total))
        return total / norm if norm > 0 else total

    def logit(self, text: str, reasons: int = 12) -> StaticParts:
        """The logit of an instruction and its parts; ``pieces`` holds the ``reasons``
        pieces whose parts are largest either way."""
        read = window(text)
        in_words = words(read)
        ids = self._ids_of(in_words)
        length = self.length_weight * math.log1p(len(text))
        per_piece = self.chars_per_piece_weight * chars_per_piece(len(ids), len(read))
        zipf = self.word_zipf(in_words)
        extras = length + per_piece + zipf
        if not ids:
            return StaticParts(self.bias + extras, self.bias, length, per_piece, zipf, ())
        norm = float(np.linalg.norm(self.table[ids].sum(axis=0, dtype=np.float64)))
        unique, counts = np.unique(np.asarray(ids), return_counts=True)
        parts = self.piece_scores[unique] * counts / norm if norm > 0 else np.zeros(len(unique))
        vector = self.bias + float(parts.sum())
        top = np.argsort(-np.abs(parts), kind="stable")[:reasons]
        pieces = tuple((self.tokens[unique[i]], float(parts[i])) for i in top)
        return StaticParts(vector + extras, vector, length, per_piece, zipf, pieces)

    def score(self, logit: float) -> float:
        return calibrated(logit, self.scale, self.shift)


def chars_per_piece(pieces: int, chars: int) -> float:
    """``log(characters / word pieces)`` of the text read (an empty text counts one of each)."""
    return math.log(max(chars, 1) / max(pieces, 1))


def encode_table(table: npt.NDArray[np.floating]) -> str:
    """The table as the file keeps it: float16, row-major, base64."""
    return base64.b64encode(np.ascontiguousarray(table, dtype="<f2").tobytes()).decode("ascii")


def load_static_head(path: str | Path | None = None) -> StaticHead:
    """Read a static head file (the shipped one by default)."""
    data = read_data_file(path, DEFAULT_STATIC, FORMATS_READ, StaticHeadError, "the classifier's static head")
    try:
        tokens = [str(t) for t in data["tokens"]]
        weights = np.asarray([float(w) for w in data["weights"]], dtype=np.float64)
        raw = np.frombuffer(base64.b64decode(data["table"], validate=True), dtype="<f2")
        table = raw.astype(np.float32).reshape(len(tokens), weights.size)
        return StaticHead(
            tokens,
            table,
            weights,
            float(data["bias"]),
            float(data["length_weight"]),
            float(data["chars_per_piece_weight"]),
            float(data["scale"]),
            float(data["shift"]),
            str(data.get("source", "")),
            float(data["word_zipf_weight"]) if data["format"] >= 2 else 0.0,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise StaticHeadError(f"the classifier's static head is malformed: {exc}") from exc


@functools.cache
def default_static_head() -> StaticHead:
    """The shipped static head, read once."""
    return load_static_head()
