"""The semantic verifier: pair features, the tree evaluator, and the hit/miss decision."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from cache.semantic.pair_features import FEATURE_NAMES, feature_names, lexical_features, pair_features
from cache.semantic.verifier import (
    BELOW_COSINE_FLOOR,
    LOW_SCORE,
    NO_CANDIDATE,
    SAME_WORDS,
    VERIFIED,
    Candidate,
    SemanticVerifier,
    TreeEnsemble,
    VerifierParams,
    VerifierParamsError,
)

LEX = {name: i - 1 for i, name in enumerate(FEATURE_NAMES)}  # lexical_features skips the cosine


def unit_vector(seed: int, dim: int = 384) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(dim).astype(np.float32)
    return v / np.linalg.norm(v)


# -- features ---------------------------------------------------------------------------------


def test_lexical_features_are_symmetric() -> None:
    a = "How do I buy a gun with a license in India?"
    b = "How can I buy a gun without a license in India in 2017?"
    assert lexical_features(a, b) == lexical_features(b, a)
    assert len(lexical_features(a, b)) == len(FEATURE_NAMES) - 1


def test_lexical_features_see_numbers_negations_names_and_question_words() -> None:
    years = lexical_features("IIT JEE Mains 2017 tips?", "IIT JEE Mains 2016 tips?")
    assert years[LEX["number_mismatch"]] == 1.0 and years[LEX["has_number"]] == 1.0
    negated = lexical_features("How do I buy a gun with a license?", "How do I buy a gun without a license?")
    assert negated[LEX["negation_mismatch"]] == 1.0
    names = lexical_features("Best rehab in Martin County?", "Best rehab in Johnson County?")
    assert names[LEX["name_mismatch"]] == 1.0
    # {martin} ^ {johnson} has 2 names: log1p(2)
    assert names[LEX["log_names_unmatched"]] == pytest.approx(math.log1p(2))
    kinds = lexical_features("Why is the sky blue?", "When is the sky blue?")
    assert kinds[LEX["question_word_same"]] == 0.0


def test_identical_texts_agree_on_every_feature() -> None:
    text = "What is the best way to learn Python?"
    same = lexical_features(text, text)
    for name in ("word_jaccard", "content_jaccard", "trigram_jaccard", "bigram_jaccard", "same_words"):
        assert same[LEX[name]] == 1.0
    for name in ("number_mismatch", "negation_mismatch", "name_mismatch", "log_unmatched_content_max"):
        assert same[LEX[name]] == 0.0


def test_word_order_is_visible() -> None:
    swapped = lexical_features(
        "Do Indian women find Pakistani men attractive?", "Do Pakistani women find Indian men attractive?"
    )
    assert swapped[LEX["content_jaccard"]] == 1.0  # the same words...
    assert swapped[LEX["common_word_order"]] < 1.0  # ...in another order


def test_pair_features_layout() -> None:
    u, v = unit_vector(1), unit_vector(2)
    projection = np.eye(3, 384, dtype=np.float32)
    mean = np.zeros(384, dtype=np.float32)
    row = pair_features("a b", "a c", u, v, 0.5, projection, mean)
    assert row.shape == (len(FEATURE_NAMES) + 6,)
    assert row[0] == 0.5
    np.testing.assert_allclose(row[-6:-3], np.abs(u[:3] - v[:3]), rtol=1e-6)
    np.testing.assert_allclose(row[-3:], u[:3] * v[:3], rtol=1e-6)
    assert len(feature_names(3)) == row.shape[0]


# -- tree evaluator ---------------------------------------------------------------------------


def two_stumps() -> TreeEnsemble:
    # Tree 1: x0 <= 0.5 ? -1.0 : +2.0.  Tree 2: x1 <= 0 ? +0.5 : (x0 <= 0.9 ? 0.25 : 1.0)
    return TreeEnsemble.from_json(
        {
            "baseline": -0.5,
            "depth": 3,
            "trees": [
                {
                    "feature": [0, -1, -1],
                    "threshold": [0.5, 0, 0],
                    "left": [1, 0, 0],
                    "right": [2, 0, 0],
                    "value": [0, -1.0, 2.0],
                },
                {
                    "feature": [1, -1, 0, -1, -1],
                    "threshold": [0.0, 0, 0.9, 0, 0],
                    "left": [1, 0, 3, 0, 0],
                    "right": [2, 0, 4, 0, 0],
                    "value": [0, 0.5, 0, 0.25, 1.0],
                },
            ],
        }
    )


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_tree_ensemble_adds_one_leaf_per_tree() -> None:
    trees = two_stumps()
    rows = np.array([[0.2, -1.0], [0.7, 1.0], [0.95, 1.0], [0.5, 0.0]], dtype=np.float32)
    expected = [
        sigmoid(-0.5 - 1.0 + 0.5),  # left, left
        sigmoid(-0.5 + 2.0 + 0.25),  # right, right then left
        sigmoid(-0.5 + 2.0 + 1.0),  # right, right then right
        sigmoid(-0.5 - 1.0 + 0.5),  # ties go left (x <= threshold)
    ]
    np.testing.assert_allclose(trees.predict(rows), expected, rtol=1e-6)


# -- the decision with the shipped parameters ---------------------------------------------------


@pytest.fixture(scope="module")
def verifier() -> SemanticVerifier:
    return SemanticVerifier()


def test_shipped_parameters_load(verifier: SemanticVerifier) -> None:
    params = verifier.params
    assert params.projection.shape[1] == 384
    assert 0.0 < verifier.threshold < 1.0
    assert 0.0 < verifier.min_cosine < 1.0
    assert params.info["split_seed"] == 20240611


def test_the_shipped_threshold_keeps_the_out_of_fold_margin(verifier: SemanticVerifier) -> None:
    info = verifier.params.info
    oof = info["out_of_fold"]
    # Chosen under the 2% bar, for pairs alone and for lookups in an index alike...
    assert info["target_false_hits"] < 0.02
    assert oof["false_hits"] <= info["target_false_hits"]
    assert oof["index_false_hits"] <= info["target_false_hits"]
    # ...so it is at least as strict as the looser 2% setting reported beside it.
    assert verifier.threshold >= info["threshold_at_2pct_oof"]


def test_averaged_ensembles_are_one_ensemble() -> None:
    # Two one-split models averaged in log-odds: every leaf halved, baselines averaged.
    stump = {"feature": [0, -1, -1], "threshold": [0.5, 0, 0], "left": [1, 0, 0], "right": [2, 0, 0]}
    averaged = TreeEnsemble.from_json(
        {
            "baseline": (0.2 + 0.4) / 2,
            "depth": 2,
            "trees": [{**stump, "value": [0, -1.0 / 2, 3.0 / 2]}, {**stump, "value": [0, 1.0 / 2, 1.0 / 2]}],
        }
    )
    rows = np.array([[0.1], [0.9]], dtype=np.float32)
    expected = [sigmoid(((0.2 - 1.0) + (0.4 + 1.0)) / 2), sigmoid(((0.2 + 3.0) + (0.4 + 1.0)) / 2)]
    np.testing.assert_allclose(averaged.predict(rows), expected, rtol=1e-6)


def test_the_same_words_are_a_hit_whatever_the_model_says(verifier: SemanticVerifier) -> None:
    u = unit_vector(3)
    verdict = verifier.verify("How can I lose weight quickly?", "how can I lose weight quickly ?", u, u, 0.99)
    assert verdict == type(verdict)(True, 1.0, SAME_WORDS)


def test_a_rephrasing_is_scored_by_the_model(verifier: SemanticVerifier) -> None:
    u = unit_vector(8)
    verdict = verifier.verify("How can I lose weight quickly?", "How do I lose weight fast?", u, u, 0.95)
    assert verdict.reason in (VERIFIED, LOW_SCORE) and 0.0 < verdict.score < 1.0
    assert verdict.hit == (verdict.score >= verifier.threshold)


@pytest.mark.parametrize("disagreement", ["number_mismatch", "negation_mismatch", "name_mismatch"])
def test_a_disagreement_never_raises_the_score(verifier: SemanticVerifier, disagreement: str) -> None:
    # All else equal: the same rows (real pairs' features, at cosines across the range where
    # the model is asked) with the disagreement off and on.
    pairs = [
        ("What is a registration key for Visual Studio 2010 Express?", "What is the registration key for it?"),
        ("How do I buy a gun with a licence in India?", "How can I buy a gun in India?"),
        ("Which laptop should I buy?", "Which laptop I should buy for college?"),
        ("Where is Martin County?", "Where is Johnson County?"),
    ]
    rows = np.array(
        [[cosine, *lexical_features(a, b)] for a, b in pairs for cosine in np.linspace(verifier.min_cosine, 1.0, 25)],
        dtype=np.float32,
    )
    column = FEATURE_NAMES.index(disagreement)
    agree, disagree = rows.copy(), rows.copy()
    agree[:, column], disagree[:, column] = 0.0, 1.0
    assert np.all(verifier.params.ensemble.predict(disagree) <= verifier.params.ensemble.predict(agree))


def test_the_score_never_falls_as_the_cosine_rises(verifier: SemanticVerifier) -> None:
    a, b = "How can I lose weight quickly?", "How do I lose weight fast?"
    cosines = np.linspace(verifier.min_cosine, 1.0, 50)
    rows = np.array([[c, *lexical_features(a, b)] for c in cosines], dtype=np.float32)
    assert np.all(np.diff(verifier.params.ensemble.predict(rows)) >= 0)


def test_below_the_cosine_floor_the_model_is_not_asked(verifier: SemanticVerifier) -> None:
    u, v = unit_vector(5), unit_vector(6)
    verdict = verifier.verify("a", "a", u, v, verifier.min_cosine - 0.01)
    assert verdict == type(verdict)(False, 0.0, BELOW_COSINE_FLOOR)
    assert not verifier.verify("a", "a", u, v, float("nan")).hit


def test_choose_takes_the_best_score_not_the_best_cosine(verifier: SemanticVerifier) -> None:
    u = unit_vector(7)
    query = "How do I buy a gun with a license in India?"
    candidates = [
        Candidate("neg", "How do I buy a gun without a license in India?", u, 0.99),
        Candidate("dup", "How do I buy a gun with a license in India?", u, 0.98),
    ]
    best, verdict = verifier.choose(query, u, candidates)
    assert best is not None and best.key == "dup" and verdict.hit
    assert verifier.choose(query, u, []) == (None, type(verdict)(False, 0.0, NO_CANDIDATE))
    strict = SemanticVerifier(verifier.params, threshold=1.0)
    none, miss = strict.choose(query, u, candidates[:1])
    assert none is None and miss.reason == LOW_SCORE


def test_overrides_and_bad_parameters(verifier: SemanticVerifier) -> None:
    assert SemanticVerifier(verifier.params, threshold=0.9, min_cosine=0.5).min_cosine == 0.5
    with pytest.raises(ValueError):
        SemanticVerifier(verifier.params, threshold=1.5)
    with pytest.raises(VerifierParamsError, match="format"):
        VerifierParams.from_json({"format": 99})
    broken: dict[str, Any] = {"format": 1, "projection": [[0.0] * 4], "features": feature_names(1)}
    with pytest.raises(VerifierParamsError, match="malformed"):
        VerifierParams.from_json(broken)
    with pytest.raises(VerifierParamsError, match="cannot read"):
        VerifierParams.load("/nonexistent/verifier.json")
