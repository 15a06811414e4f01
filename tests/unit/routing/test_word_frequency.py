"""The classifier's word-frequency input: the shipped table, the mean, the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dialects.openai import CHAT
from routing.classifier import classify
from routing.static_head import read_words
from routing.word_frequency import (
    EVERYDAY_ZIPF,
    WordFrequencyError,
    default_word_frequency,
    load_word_frequency,
)

SHIPPED = Path(__file__).resolve().parents[3] / "routing" / "data" / "word-frequency.json"


def test_mean_zipf_counts_alphabetic_words_only_and_unknown_ones_at_the_floor() -> None:
    frequency = default_word_frequency()
    assert frequency.mean_zipf(["the", "the"]) == frequency.zipf["the"] > 7
    assert "qqzxv" not in frequency.zipf
    assert frequency.mean_zipf(["the", "(", "2", "qqzxv"]) == pytest.approx(
        (frequency.zipf["the"] + frequency.floor) / 2
    )
    assert frequency.mean_zipf(["2", "+", "2"]) == EVERYDAY_ZIPF  # no word at all: the neutral value
    assert frequency.mean_zipf([]) == EVERYDAY_ZIPF
    # The heads' input is the offset from everyday text's: 0 for no words, negative for rare ones.
    assert frequency.offset([]) == 0.0
    assert frequency.offset(["qqzxv"]) == frequency.floor - EVERYDAY_ZIPF < 0


def test_only_words_of_ascii_letters_are_read() -> None:
    """Another script's words are not in the table; counted, each would read as rare and push
    every Russian or Chinese prompt up. They say nothing instead."""
    frequency = default_word_frequency()
    assert frequency.offset(read_words("Как приготовить борщ?")) == 0.0
    assert frequency.offset(read_words("法国的首都是哪里?")) == 0.0
    # Mixed: only the ASCII words count.
    mixed = read_words("Напиши скрипт для samba")
    assert frequency.mean_zipf(mixed) == frequency.mean_zipf(["samba"])


def test_everyday_questions_in_other_latin_script_languages_read_as_common() -> None:
    frequency = default_word_frequency()
    for text in (
        "¿Cuál es la capital de Francia?",
        "Quelle est la meilleure façon de se faire des amis ?",
        "Wie spät ist es in Tokio?",
    ):
        assert frequency.offset(read_words(text)) > 0.5, text


# Everyday questions in Latin-script languages past the seven most used: before their common
# words were in the table, each read as rare English and the static head sent it large
# (0.62-0.88).
EVERYDAY_ELSEWHERE = (
    "Jaka jest stolica Francji?",  # Polish
    "Kilo vermek için ne yemeliyim?",  # Turkish
    "Bagaimana cara belajar memasak dengan cepat?",  # Indonesian
    "Tại sao bầu trời có màu xanh?",  # Vietnamese
    "Vad är huvudstaden i Frankrike?",  # Swedish
)


@pytest.mark.parametrize("text", EVERYDAY_ELSEWHERE)
def test_everyday_questions_in_the_other_latin_script_languages_read_as_common_too(text: str) -> None:
    assert default_word_frequency().offset(read_words(text)) > 0
    classified = classify(CHAT.prompt({"messages": [{"role": "user", "content": text}]}))
    assert classified.head == "static" and classified.tier == "small", classified.header()


def test_technical_asks_read_rarer_than_everyday_questions() -> None:
    frequency = default_word_frequency()
    samba = frequency.mean_zipf(read_words("write a shellscript configuration samba server"))
    friends = frequency.mean_zipf(read_words("what is the best way to make new friends"))
    assert samba < friends - 1.0


def test_the_shipped_table_says_whose_data_it_is_and_keeps_common_words_only() -> None:
    data = json.loads(SHIPPED.read_text())
    assert "wordfreq" in data["source"] and "Attribution-ShareAlike 4.0" in data["license"]
    frequency = default_word_frequency()
    assert frequency.floor == data["floor"] < min(data["min_zipf"].values()) <= min(frequency.zipf.values())
    assert all(word.isascii() and word.isalpha() and word == word.lower() for word in frequency.zipf)
    assert all(language in data["source"] for language in ("en", "es", "de", "pl", "tr"))
    assert len(frequency.zipf) > 20000


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(WordFrequencyError, match="cannot read"):
        load_word_frequency(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": 99}))
    with pytest.raises(WordFrequencyError, match="format"):
        load_word_frequency(bad)
    for broken in ({"format": 1, "floor": 2.0}, {"format": 1, "floor": 2.0, "words": {"x": "the"}}):
        bad.write_text(json.dumps(broken))
        with pytest.raises(WordFrequencyError, match="malformed"):
            load_word_frequency(bad)
    bad.write_text(json.dumps({"format": 1, "floor": 1.5, "words": {"6.0": "cat dog", "3.2": "axolotl"}}))
    own = load_word_frequency(bad)
    assert own.mean_zipf(["cat", "axolotl", "zyzzyva"]) == pytest.approx((6.0 + 3.2 + 1.5) / 3)
