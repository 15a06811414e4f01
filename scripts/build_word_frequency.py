"""Write routing/data/word-frequency.json, the classifier heads' word-frequency table.

    .venv/bin/python -m scripts.build_word_frequency   # needs the train extra (wordfreq)

The table is wordfreq's lists ("best": the large list where there is one) of English and of
every other language written in the Latin alphabet that wordfreq has, each word cut as the
heads cut it (BERT's uncased words: lower case, accents stripped; kept if that leaves one word
of ASCII letters) with its Zipf frequency to one decimal, the highest of the languages'. It
keeps the words at or above ``MIN_ZIPF`` in English and the six other most used of these
languages (``LANGUAGES``), at or above ``OTHER_MIN_ZIPF`` in the rest (``OTHER_LANGUAGES``:
an everyday question's words are common ones, and their words down to Zipf 3 would more than
double the table). Every other word counts ``FLOOR``. The other languages are there so that an
everyday question in Spanish, Polish or Turkish does not read as rare English. On the
(English) labelled prompts the pooled held-out figures moved by 0.001 at most with them,
arena-hard's by up to 0.006: its maths prompts in those languages no longer read as rare for
being foreign (bench/results/classifier.md, "The words' frequency").

wordfreq's data is under the Creative Commons Attribution-ShareAlike 4.0 licence; the file
says so and whose it is, and so must any file derived from it.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from importlib import metadata
from pathlib import Path

from routing.static_head import words
from routing.word_frequency import DEFAULT_WORD_FREQUENCY, FORMAT
from scripts.train_classifier import OUT

WORD_FREQUENCY_OUT = OUT.with_name(DEFAULT_WORD_FREQUENCY)
LANGUAGES = ("en", "es", "fr", "de", "pt", "it", "nl")
MIN_ZIPF = 3.0
OTHER_LANGUAGES = (
    "ca", "cs", "da", "fi", "fil", "hu", "id", "is", "lt", "lv",
    "ms", "nb", "pl", "ro", "sh", "sk", "sl", "sv", "tr", "vi",
)  # fmt: skip
OTHER_MIN_ZIPF = 4.0
MIN_ZIPF_BY_LANGUAGE = {**dict.fromkeys(LANGUAGES, MIN_ZIPF), **dict.fromkeys(OTHER_LANGUAGES, OTHER_MIN_ZIPF)}
FLOOR = 2.0
LICENSE = (
    "Word frequencies from wordfreq by Robyn Speer (https://github.com/rspeer/wordfreq), "
    "Creative Commons Attribution-ShareAlike 4.0 (https://creativecommons.org/licenses/by-sa/4.0/); "
    "this table keeps the words at or above min_zipf (its language's) in any of its languages, "
    "the highest Zipf frequency of theirs, rounded to one decimal."
)


def table() -> dict[str, str]:
    """Zipf value (one decimal, as text) -> the words that have it, sorted, space-separated."""
    import wordfreq

    best: dict[str, float] = {}
    for language, min_zipf in MIN_ZIPF_BY_LANGUAGE.items():
        for listed, frequency in wordfreq.get_frequency_dict(language, wordlist="best").items():
            zipf = round(math.log10(frequency) + 9, 1)
            if zipf < min_zipf:
                continue
            cut = words(listed)
            if len(cut) != 1 or not (cut[0].isascii() and cut[0].isalpha()):
                continue
            best[cut[0]] = max(zipf, best.get(cut[0], 0.0))
    by_value: defaultdict[str, list[str]] = defaultdict(list)
    for word, zipf in best.items():
        by_value[f"{zipf:.1f}"].append(word)
    return {value: " ".join(sorted(by_value[value])) for value in sorted(by_value, key=float, reverse=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=WORD_FREQUENCY_OUT)
    args = parser.parse_args()
    listed = table()
    data = {
        "format": FORMAT,
        "source": f"wordfreq {metadata.version('wordfreq')}, wordlist 'best' of {', '.join(MIN_ZIPF_BY_LANGUAGE)}",
        "license": LICENSE,
        "min_zipf": MIN_ZIPF_BY_LANGUAGE,
        "floor": FLOOR,
        "words": listed,
    }
    args.out.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    count = sum(len(value_words.split()) for value_words in listed.values())
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB, {count} words)")


if __name__ == "__main__":
    main()
