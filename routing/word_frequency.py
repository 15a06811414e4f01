"""How common a text's words are: the classifier heads' word-frequency input.

Arena-hard's prompts were picked from real users' asks for their specificity, domain
knowledge and technical accuracy, and it shows in their words: "samba", "PromQL", "pods",
"kubelet", "eigenvalue" are rarer in everyday English than the words of an everyday question
or a generic instruction of the same length. The input is the mean Zipf frequency
(log10 of a word's occurrences per billion words) of the words of letters the static head
reads of a text (``routing.static_head.words`` of its ``window``): around 5.5 for everyday
questions, lower for technical asks, lowest for code, whose identifiers are no English words.
The heads weigh its ``offset`` from ``EVERYDAY_ZIPF``, so that the part it adds to a logit
reads as it moves the score (``wf+0.9``: rarer words than everyday text's).
Measured on held-out sources, it moves real users' hard prompts most
(bench/results/classifier.md, docs/routing.md).

The frequencies are wordfreq's (Robyn Speer, https://github.com/rspeer/wordfreq): English's,
and those of the 26 other languages written in the Latin alphabet it has lists for, a word
counting its highest (an everyday question in Spanish or Polish is not rare English), kept in
``routing/data/word-frequency.json`` for the words at or above its language's ``min_zipf``
(3 in the seven most used, 4 in the rest), to one decimal; every other word counts ``floor``.
Only words of ASCII letters (accents stripped) are read: a text in another script (Cyrillic,
Chinese) gets nothing from this input, where its every word would otherwise count as rare.
Words of a Latin-script language with no list (Estonian, Basque, Welsh, Albanian...) do count
as rare, and push a prompt up. The data is wordfreq's, under the Creative Commons
Attribution-ShareAlike 4.0 licence, which the file carries; it is rebuilt by
``scripts/build_word_frequency.py``.

Cost: one dictionary lookup per word of the window (at most ``HEAD_CHARS + TAIL_CHARS``
characters), a few microseconds.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from routing.data_file import read_data_file

FORMAT = 1
DEFAULT_WORD_FREQUENCY = "word-frequency.json"
# About the mean Zipf frequency of everyday text's words: the heads' input is the offset from
# it, and a text with no word it reads ("2+2=?", a bare code symbol, Chinese) counts it (offset 0).
EVERYDAY_ZIPF = 5.0


class WordFrequencyError(ValueError):
    """The word-frequency file is missing, unreadable or of another format."""


@dataclass(frozen=True, slots=True)
class WordFrequency:
    """Zipf frequencies of common words; ``floor``: what any other word counts."""

    zipf: Mapping[str, float]
    floor: float

    def mean_zipf(self, read: Iterable[str]) -> float:
        """The mean Zipf frequency of the words of ASCII letters among ``read`` (``EVERYDAY_ZIPF``
        if none): the table knows no other script, and a word it cannot judge says nothing."""
        total = 0.0
        n = 0
        get, floor = self.zipf.get, self.floor
        for word in read:
            if word.isascii() and word.isalpha():
                total += get(word, floor)
                n += 1
        return total / n if n else EVERYDAY_ZIPF

    def offset(self, read: Iterable[str]) -> float:
        """The heads' input: ``mean_zipf`` less ``EVERYDAY_ZIPF`` (negative: rarer words)."""
        return self.mean_zipf(read) - EVERYDAY_ZIPF


def load_word_frequency(path: str | Path | None = None) -> WordFrequency:
    """Read a word-frequency file (the shipped one by default)."""
    data = read_data_file(path, DEFAULT_WORD_FREQUENCY, (FORMAT,), WordFrequencyError, "the word-frequency table")
    try:
        zipf = {word: float(value) for value, listed in data["words"].items() for word in listed.split()}
        return WordFrequency(zipf, float(data["floor"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise WordFrequencyError(f"the word-frequency table is malformed: {exc}") from exc


@functools.cache
def default_word_frequency() -> WordFrequency:
    """The shipped table, read once."""
    return load_word_frequency()
