"""Write routing/data/word-frequency.json, the classifier heads' word-frequency table.

    .venv/bin/python -m scripts.build_word_frequency   # needs the train extra (wordfreq)

The table is wordfreq's English list ("best": its large list where it has one), each word's
Zipf frequency to one decimal, for the alphabetic ASCII words at or above ``MIN_ZIPF`` (the
heads read words as BERT's uncased tokenisation cuts them: lower case, accents stripped, so
no other key could be looked up). Every other word counts ``FLOOR``. Held-out figures were the
same with the whole list (bench/results/classifier.md), and the file stays small.

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

from routing.word_frequency import DEFAULT_WORD_FREQUENCY, FORMAT
from scripts.train_classifier import OUT

WORD_FREQUENCY_OUT = OUT.with_name(DEFAULT_WORD_FREQUENCY)
MIN_ZIPF = 3.0
FLOOR = 2.0
LICENSE = (
    "Word frequencies from wordfreq by Robyn Speer (https://github.com/rspeer/wordfreq), "
    "Creative Commons Attribution-ShareAlike 4.0 (https://creativecommons.org/licenses/by-sa/4.0/); "
    "this table keeps the words at or above min_zipf, rounded to one decimal."
)


def table() -> dict[str, str]:
    """Zipf value (one decimal, as text) -> the words that have it, sorted, space-separated."""
    import wordfreq

    by_value: defaultdict[str, list[str]] = defaultdict(list)
    for word, frequency in wordfreq.get_frequency_dict("en", wordlist="best").items():
        zipf = round(math.log10(frequency) + 9, 1)
        if zipf >= MIN_ZIPF and word.isascii() and word.isalpha():
            by_value[f"{zipf:.1f}"].append(word)
    return {value: " ".join(sorted(by_value[value])) for value in sorted(by_value, key=float, reverse=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=WORD_FREQUENCY_OUT)
    args = parser.parse_args()
    words = table()
    data = {
        "format": FORMAT,
        "source": f"wordfreq {metadata.version('wordfreq')}, English, wordlist 'best'",
        "license": LICENSE,
        "min_zipf": MIN_ZIPF,
        "floor": FLOOR,
        "words": words,
    }
    args.out.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    count = sum(len(listed.split()) for listed in words.values())
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB, {count} words)")


if __name__ == "__main__":
    main()
