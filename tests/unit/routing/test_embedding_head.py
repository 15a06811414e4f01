"""The classifier's embedding head: its arithmetic, its file, and how ``classify`` uses it.

Heads here are written out by hand (a few dimensions, known weights) so the expected
scores can be computed in the test; the shipped head is checked for shape and calibration.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from dialects.base import PromptView
from dialects.openai import CHAT
from routing.classifier import (
    DEFAULT_TIERS,
    EMBEDDING,
    STATIC,
    LinearModel,
    classify,
    features,
)
from routing.embedding_head import (
    EMBED_MAX_CHARS,
    EmbeddingHead,
    EmbeddingHeadError,
    chars_per_token,
    default_head,
    embedding_text,
    load_head,
)
from routing.word_frequency import EVERYDAY_ZIPF, default_word_frequency

SHIPPED = Path(__file__).resolve().parents[3] / "routing" / "data" / "classifier-embedding.json"


def user(text: str) -> PromptView:
    return CHAT.prompt({"model": "auto", "messages": [{"role": "user", "content": text}]})


def head(
    ngram_weight: float = 0.0, length_weight: float = 0.0, per_token_weight: float = 0.0, zipf_weight: float = 0.0
) -> EmbeddingHead:
    return EmbeddingHead(
        np.array([2.0, -1.0, 0.0]), -0.5, ngram_weight, length_weight, per_token_weight, 1.0, 0.0, "emb-1", zipf_weight
    )


def sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z))


def test_the_head_scores_the_vector_and_says_so() -> None:
    vector = np.array([0.6, 0.8, 0.0], dtype=np.float32)
    c = classify(user("What is the capital of France?"), vector=vector, head=head())
    # 2 * 0.6 - 1 * 0.8 - 0.5 = -0.1
    assert c.head == EMBEDDING
    assert c.score == round(sigmoid(-0.1), 3)
    assert c.tier == "medium"  # 0.475 in [0.45, 0.5)
    assert c.reasons == ()  # no n-gram part: no word features to show
    assert c.header() == f"score={c.score:.2f}; embedding(emb-0.10); none"


def test_the_ngram_part_and_length_add_to_the_logit_and_show_their_features() -> None:
    text = "Compute the integral of x^2 * sin(x) dx from 0 to pi."
    model = LinearModel({"w:integral": 2.0, "w:capital": -2.0}, 0.0, 1.0, 0.0)
    vector = np.array([1.0, 0.0, 0.0], dtype=np.float32)
    c = classify(user(text), model=model, vector=vector, head=head(ngram_weight=0.5, length_weight=0.1))
    ngram_logit = model.logit(features(text))[0]
    assert ngram_logit == 2.0  # one known feature: 2.0 / sqrt(1)
    embedding, ngram, length = 2.0 - 0.5, 0.5 * 2.0, 0.1 * math.log1p(len(text))
    assert c.score == round(sigmoid(embedding + ngram + length), 3)
    assert c.reasons == ("+w:integral",)
    assert c.header() == f"score={c.score:.2f}; embedding(emb+1.50,ngram+1.00,len+{length:.2f}); +w:integral"


def test_characters_per_token_of_the_window_add_to_the_logit_and_show_in_the_header() -> None:
    text = "def f(x): return x**2"
    vector = np.array([1.0, 0.0, 0.0], dtype=np.float32)
    # The model read 12 word pieces (its two end markers included) covering all 21 characters.
    c = classify(user(text), vector=vector, window=(12, 21), head=head(length_weight=0.1, per_token_weight=-2.0))
    length, per_token = 0.1 * math.log1p(21), -2.0 * math.log(21 / 12)
    assert per_token == pytest.approx(-1.119, abs=1e-3)
    assert c.score == round(sigmoid(2.0 - 0.5 + length + per_token), 3)
    assert c.header() == f"score={c.score:.2f}; embedding(emb+1.50,len+{length:.2f},cpt-1.12); none"


def test_the_words_frequency_adds_to_the_logit_and_shows_in_the_header() -> None:
    text = "Configure samba on a server"
    vector = np.array([1.0, 0.0, 0.0], dtype=np.float32)
    c = classify(user(text), vector=vector, head=head(zipf_weight=-0.5))
    # The words the static head reads, looked up in the shipped table (a word not in it counts
    # the floor); their mean less everyday text's is the input.
    table = default_word_frequency().zipf
    expected = [table["configure"], table["samba"], table["on"], table["a"], table["server"]]
    zipf = -0.5 * (sum(expected) / 5 - EVERYDAY_ZIPF)
    assert c.score == round(sigmoid(2.0 - 0.5 + zipf), 3)
    assert c.header() == f"score={c.score:.2f}; embedding(emb+1.50,wf{zipf:+.2f}); none"
    with pytest.raises(ValueError, match="frequency"):
        head(zipf_weight=-0.5).logit(vector, 0.0, len(text), None)


def test_a_head_that_weighs_the_window_needs_one() -> None:
    h = head(per_token_weight=-2.0)
    assert h.uses_window and not head().uses_window
    with pytest.raises(ValueError, match="token window"):
        h.logit(np.array([1.0, 0.0, 0.0]), 0.0, 10)
    # A head without the input ignores a window given to it.
    assert head().logit(np.array([1.0, 0.0, 0.0]), 0.0, 10, (3, 10)).chars_per_token == 0.0


def test_chars_per_token_is_the_log_ratio_and_never_infinite() -> None:
    assert chars_per_token(4, 20) == pytest.approx(math.log(5.0))
    assert chars_per_token(2, 0) == pytest.approx(math.log(0.5))  # an empty text: one character counted
    assert chars_per_token(0, 0) == 0.0


def test_without_a_vector_the_static_head_decides_and_the_header_says_why() -> None:
    plain = classify(user("What is the capital of France?"))
    assert plain.head == STATIC and plain.header().startswith(f"score={plain.score:.2f}; static; ")
    late = classify(user("What is the capital of France?"), fallback="timeout")
    assert late.head == STATIC and late.score == plain.score
    assert late.header().startswith(f"score={late.score:.2f}; static(timeout); ")


def test_calibration_maps_logits_through_scale_and_shift() -> None:
    h = EmbeddingHead(np.array([1.0]), 0.0, 0.0, 0.0, 0.0, 2.0, -1.0, "e")
    assert h.score(0.5) == pytest.approx(0.5)
    assert h.score(1.5) == pytest.approx(sigmoid(2.0))
    assert h.score(-800.0) == 0.0 and h.score(800.0) == 1.0  # no overflow either way


def test_the_head_accepts_only_its_own_embedders_vectors() -> None:
    h = head()
    assert h.accepts("emb-1", 3)
    assert not h.accepts("emb-2", 3)
    assert not h.accepts("emb-1", 384)


def test_embedding_text_is_stripped_and_bounded() -> None:
    assert embedding_text("  What is 2+2?\n") == "What is 2+2?"
    assert len(embedding_text("x" * (EMBED_MAX_CHARS + 100))) == EMBED_MAX_CHARS


def test_head_file_errors(tmp_path: Path) -> None:
    with pytest.raises(EmbeddingHeadError, match="cannot read"):
        load_head(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": 99}))
    with pytest.raises(EmbeddingHeadError, match="format"):
        load_head(bad)
    bad.write_text(json.dumps({"format": 1, "weights": [1.0], "bias": 0.0}))
    with pytest.raises(EmbeddingHeadError, match="malformed"):
        load_head(bad)
    good = {
        "format": 1,
        "weights": [0.5, -0.5],
        "bias": 0.1,
        "ngram_weight": 0.0,
        "length_weight": 0.0,
        "scale": 1.0,
        "shift": 0.0,
        "embedder": "e",
    }
    bad.write_text(json.dumps(good))
    # Format 1 (before the window's input): read as it scored, with that input's weight 0.
    old = load_head(bad)
    assert old.dimension == 2 and old.chars_per_token_weight == 0.0 and not old.uses_window
    # Format 2 must carry the weight.
    bad.write_text(json.dumps({**good, "format": 2}))
    with pytest.raises(EmbeddingHeadError, match="malformed"):
        load_head(bad)
    bad.write_text(json.dumps({**good, "format": 2, "chars_per_token_weight": -1.5}))
    assert load_head(bad).chars_per_token_weight == -1.5
    assert load_head(bad).word_zipf_weight == 0.0 and not load_head(bad).uses_words
    # Format 3 must carry the words' frequency weight.
    bad.write_text(json.dumps({**good, "format": 3, "chars_per_token_weight": -1.5}))
    with pytest.raises(EmbeddingHeadError, match="malformed"):
        load_head(bad)
    bad.write_text(json.dumps({**good, "format": 3, "chars_per_token_weight": -1.5, "word_zipf_weight": -0.7}))
    assert load_head(bad).word_zipf_weight == -0.7 and load_head(bad).uses_words


def test_shipped_head_fits_the_semantic_cache_embedder_and_the_default_tiers() -> None:
    h = default_head()
    assert h.dimension == 384  # all-MiniLM-L6-v2
    data = json.loads(SHIPPED.read_text())
    assert data["embedder"] == h.embedder and len(h.embedder) == 16
    assert data["format"] == 3 and h.uses_window and h.uses_words and h.length_weight != 0.0
    bounds = data["info"]["boundary_logits"]
    assert h.score(bounds["small_top"]) == pytest.approx(DEFAULT_TIERS[0].max_score, abs=1e-3)
    assert h.score(bounds["large_bottom"]) == pytest.approx(DEFAULT_TIERS[-1].min_score, abs=1e-3)
