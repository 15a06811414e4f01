"""Complexity classifier: the shipped model, its explanations, tiers, and out-of-source quality.

Core tests use the shipped model (routing/data/classifier.json) and the repository's own
hand-written prompts (tests/data/classifier_fixture.jsonl: none of them from the training
sources). The last test retrains on the public prompts in ../shared/data and skips when
they (or scikit-learn, the ``train`` extra) are absent.
"""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dialects.base import PromptView
from dialects.openai import CHAT, COMPLETIONS
from routing.classifier import (
    DEFAULT_TIERS,
    Classification,
    ClassifierModelError,
    LinearModel,
    TierRange,
    _header_safe,
    classify,
    classify_text,
    default_model,
    features,
    load_model,
    resolve_tier,
    validate_tiers,
)
from routing.static_head import HEAD_CHARS, TAIL_CHARS, StaticHead, default_static_head

FIXTURE = Path(__file__).resolve().parents[2] / "data" / "classifier_fixture.jsonl"


def user(text: str) -> PromptView:
    return CHAT.prompt({"model": "auto", "messages": [{"role": "user", "content": text}]})


def prompt_of(body: dict[str, Any]) -> PromptView:
    """A body's prompt as its dialect sees it: chat with messages, else completions."""
    return (CHAT if "messages" in body else COMPLETIONS).prompt(body)


def fixture() -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]
    return [(r["label"], r["prompt"]) for r in rows]


def auc(pos: list[float], neg: list[float]) -> float:
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def test_hand_written_prompts_are_ranked_and_tiered() -> None:
    """Prompts no training source holds, including the kinds that fooled the keyword rule
    (short technical asks, "translate this code", "why"/"difference" questions)."""
    scored = [(label, classify_text(text)) for label, text in fixture()]
    hard = [c for label, c in scored if label == "hard"]
    easy = [c for label, c in scored if label == "easy"]
    assert len(hard) >= 15 and len(easy) >= 15
    assert auc([c.score for c in hard], [c.score for c in easy]) >= 0.9
    assert sum(c.tier == "large" for c in hard) / len(hard) >= 0.5
    assert sum(c.tier == "small" for c in easy) / len(easy) >= 0.8


def test_hand_written_hard_asks_go_large_at_the_default_boundaries() -> None:
    """The boundaries of issue 34 on prompts no training source holds: 12 of the 15 hand-written
    hard asks go large (11 with the wide medium band before, one stopped in medium), the three
    the static head ranks among the easy ones stay small, and all 20 easy prompts stay small."""
    tiers: dict[str, list[str]] = {"hard": [], "easy": []}
    for label, text in fixture():
        tiers[label].append(classify_text(text).tier)
    assert (tiers["hard"].count("large"), tiers["hard"].count("medium"), tiers["hard"].count("small")) == (12, 0, 3)
    assert tiers["easy"] == ["small"] * 20


def test_reasons_are_the_word_pieces_and_the_words_frequency_that_moved_the_score() -> None:
    text = "Compute the integral of x^2 * sin(x) dx from 0 to pi."
    c = classify(user(text))
    assert c.tier == "large" and c.head == "static"
    assert c.header() == f"score={c.score:.2f}; static; {','.join(c.reasons)}"
    parts = default_static_head().logit(text, reasons=12)
    assert [abs(v) for _, v in parts.pieces] == sorted((abs(v) for _, v in parts.pieces), reverse=True)
    # The three largest parts either way, among the pieces' and the words' frequency's.
    frequency = ("wf:rare" if parts.word_zipf > 0 else "wf:common", parts.word_zipf)
    candidates = [("t:" + piece, part) for piece, part in parts.pieces] + [frequency]
    top = sorted(candidates, key=lambda kv: abs(kv[1]), reverse=True)[:3]
    assert c.reasons == tuple(("+" if part > 0 else "-") + name for name, part in top)
    easy = classify(user("What is the capital of France?"))
    assert easy.tier == "small" and easy.head == "static"
    # A text in a Latin-script language the table does not hold (Estonian) reads as rare
    # words, and the header says that is what moved it.
    estonian = classify(user("Kuidas keeta punast borši?"))
    assert estonian.reasons[0] == "+wf:rare"
    assert classify(user("What is the best way to make new friends?")).reasons[0] == "-wf:common"


def test_reasons_are_header_safe() -> None:
    c = classify(user('请证明: "a, b; c" \\ ∑ x² — naïve café?'))
    for reason in c.reasons:
        assert reason.isascii() and not any(ch in reason for ch in ' ,;"\\\r\n')
    c.header().encode("latin-1")


def test_reasons_show_pieces_of_other_scripts_percent_encoded() -> None:
    """A Cyrillic or Chinese piece is shown as a URL would carry it, not cut down to ``##``."""
    text = "Почему небо голубое?"
    c = classify(user(text))
    pieces = [urllib.parse.unquote(reason[len("+t:") :]) for reason in c.reasons if reason[1:3] == "t:"]
    assert pieces and all(piece.strip("#") and piece.strip("#") in text.lower() for piece in pieces), c.reasons
    assert [_header_safe(f) for f in ("t:平", "s:,", "s:%", "w:a b")] == ["t:%E5%B9%B3", "s:%2C", "s:%25", "w:a_b"]


def test_only_the_latest_user_message_is_scored() -> None:
    trivial = {"role": "user", "content": "thanks!"}
    body = {
        "messages": [
            {"role": "system", "content": "You are the support bot. Prove theorems with integrals. " * 30},
            {"role": "user", "content": "Compute the integral of x^2 * sin(x) dx from 0 to pi."},
            {"role": "assistant", "content": "It is pi^2 - 4."},
            trivial,
        ]
    }
    assert CHAT.prompt(body).instruction == "thanks!"
    assert classify(CHAT.prompt(body)) == classify(user("thanks!"))


def test_completion_prompt_and_content_parts_are_read() -> None:
    text = "Find all real solutions of x^4 - 5x^2 + 4 = 0 and verify them."
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    assert classify(prompt_of({"prompt": text})) == classify(prompt_of(parts)) == classify(user(text))
    assert classify(prompt_of({"prompt": [text]})) == classify(user(text))


def test_only_head_and_tail_of_a_long_prompt_are_read() -> None:
    head, tail = "a" * HEAD_CHARS, "z" * TAIL_CHARS
    long_text = head + " middle words " * 50_000 + tail
    assert features(long_text) == features(head + " " + tail)
    static = default_static_head()
    read = static.logit(long_text)
    short = static.logit(head + " " + tail)
    assert read.pieces == short.pieces and read.chars_per_piece == short.chars_per_piece
    assert read.length > short.length  # the length is the whole text's


def test_empty_or_odd_bodies_do_not_raise() -> None:
    bodies: list[dict[str, object]] = [{}, {"messages": []}, {"messages": [None, {"role": "user"}]}, {"prompt": [1, 2]}]
    static = default_static_head()
    bias_only = static.score(static.bias)  # no pieces, log1p(0) = 0, log(1 / 1) = 0, no words: offset 0
    for body in bodies:
        c = classify(prompt_of(body))
        assert c.score == round(bias_only, 3) and c.reasons == ()


def toy_static_head() -> StaticHead:
    """Three pieces on two axes: "integral" up, "capital" down, "[UNK]" neither; the score is
    the vector's part alone (no length, no characters per piece)."""
    table = np.array([[0.0, 1.0], [1.0, 0.0], [-1.0, 0.0]], dtype=np.float32)
    return StaticHead(["[UNK]", "integral", "capital"], table, np.array([2.0, 0.0]), 0.0, 0.0, 0.0, 1.0, 0.0)


def test_score_maps_to_configured_ranges_and_a_given_head() -> None:
    tiers = (TierRange("cheap", 0.0, 0.5), TierRange("big", 0.5, 1.0))
    static = toy_static_head()
    assert classify(user("integral"), tiers, static=static) == Classification(
        "big", round(1 / (1 + 2.718281828**-2), 3), ("+t:integral",)
    )
    # Two pieces of one word are one reason; their sum is a unit vector still.
    assert classify(user("Integral integral"), tiers, static=static).score == round(1 / (1 + 2.718281828**-2), 3)
    assert classify(user("a capital"), tiers, static=static).tier == "cheap"  # "a": [UNK], on no axis
    assert classify(user("nothing known"), tiers, static=static) == Classification("big", 0.5, ())


def test_the_ngram_model_weighs_known_features_over_the_root_of_their_count() -> None:
    """The n-gram model (the benchmark's baseline, the embedding head's optional input)."""
    model = LinearModel({"w:integral": 2.0, "w:capital": -2.0}, 0.5, 1.0, 0.0)
    assert model.logit(features("the integral")) == (2.5, [("w:integral", 2.0)])
    logit, parts = model.logit(features("integral capital"))
    assert logit == pytest.approx(0.5) and sorted(parts) == [
        ("w:capital", pytest.approx(-2.0 / 2**0.5)),
        ("w:integral", pytest.approx(2.0 / 2**0.5)),
    ]
    assert model.logit(features("nothing known")) == (0.5, [])


def test_model_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ClassifierModelError, match="cannot read"):
        load_model(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": 99}))
    with pytest.raises(ClassifierModelError, match="format"):
        load_model(bad)
    bad.write_text(json.dumps({"format": 1, "weights": {}, "bias": 0.0}))
    with pytest.raises(ClassifierModelError, match="malformed"):
        load_model(bad)


def test_shipped_model_is_small_and_calibrated_into_the_default_tiers() -> None:
    model = default_model()
    assert 1000 <= len(model.weights) <= 50_000
    data = json.loads(Path(__file__).resolve().parents[3].joinpath("routing", "data", "classifier.json").read_text())
    bounds = data["info"]["boundary_logits"]
    assert model.score(bounds["small_top"]) == pytest.approx(DEFAULT_TIERS[0].max_score, abs=1e-3)
    assert model.score(bounds["large_bottom"]) == pytest.approx(DEFAULT_TIERS[-1].min_score, abs=1e-3)


def test_validate_tiers() -> None:
    validate_tiers(DEFAULT_TIERS)
    with pytest.raises(ValueError, match="ends at"):
        validate_tiers((TierRange("a", 0.0, 0.4), TierRange("b", 0.5, 1.0)))
    with pytest.raises(ValueError, match="start at 0"):
        validate_tiers((TierRange("a", 0.1, 1.0),))


def test_forced_tier_only_where_allowed() -> None:
    c = Classification("small", 0.1, ())
    assert resolve_tier(c, "large", {"large", "medium"}) == ("large", "forced")
    assert resolve_tier(c, "large", set()) == ("small", "force_denied")
    assert resolve_tier(c, None, {"large"}) == ("small", "classified")


def test_out_of_source_quality_on_the_public_prompts() -> None:
    """Retrains with every easy source held out in turn (the calibration's folds) and checks
    the pooled out-of-fold AUC against the figure in bench/results/classifier.md, with margin."""
    from bench.classifier_data import EASY, HARD, available, data_dir

    if not available():
        pytest.skip(f"the public prompts are not under {data_dir()} (../shared/data beside the repository)")
    pytest.importorskip("sklearn", reason="retraining needs scikit-learn (the 'train' extra)")
    from bench.classifier_data import load
    from bench.classifier_training import out_of_fold

    prompts = load()
    logits = out_of_fold(prompts, [features(p.text) for p in prompts], "easy-sources")
    hard = [float(x) for x, p in zip(logits, prompts, strict=True) if p.scored and p.label == HARD]
    easy = [float(x) for x, p in zip(logits, prompts, strict=True) if p.scored and p.label == EASY]
    assert not np.isnan(hard + easy).any(), "every public hard and easy prompt is scored out of fold"
    assert np.isnan(logits[[p.origin >= 0 for p in prompts]]).all(), "derived prompts are never scored"
    assert auc(hard[::4], easy[::2]) >= 0.9


@pytest.mark.parametrize("protocol", ["sources", "whole-sources", "easy-sources", "random"])
def test_a_derived_prompt_is_held_out_with_its_origin_and_never_scored(protocol: str) -> None:
    from bench.classifier_data import EASY, HARD, Prompt
    from bench.classifier_training import logits_out_of_fold

    prompts = [Prompt(f"hard {i}", "t", "c", HARD, f"h{i % 2}") for i in range(10)]
    prompts += [Prompt(f"easy {i}", "t", "c", EASY, f"e{i % 2}") for i in range(10)]
    prompts += [Prompt(f"hard {i}, asked", "t", "asked", HARD, "h/asked", origin=i) for i in range(10)]
    seen: list[tuple[list[int], list[int]]] = []

    def spy(rest: list[int], held: list[int]) -> np.ndarray:
        seen.append((rest, held))
        return np.zeros(len(held))

    logits = logits_out_of_fold(prompts, protocol, spy)
    assert sorted(i for _, held in seen for i in held) == list(range(20)), "each public prompt scored once"
    assert np.isnan(logits[20:]).all()
    for rest, held in seen:
        # Trained on: the derived prompt of every hard prompt not held out, and no other.
        assert {prompts[i].origin for i in rest if prompts[i].origin >= 0} == set(range(10)) - set(held)


def test_whole_sources_hold_arena_hard_out_as_one_source() -> None:
    """``sources`` holds arena-hard's coding and maths prompts out apart (each fold still reads
    the other's real-user asks); ``whole-sources`` holds them out together."""
    from bench.classifier_data import EASY, HARD, Prompt
    from bench.classifier_training import folds

    groups = [("arena-hard/coding", HARD), ("arena-hard/math", HARD), ("gsm8k-test", HARD), ("qqp", EASY)]
    prompts = [Prompt(f"{g} {i}", "t", "c", label, g) for g, label in groups for i in range(2)]
    prompts.append(Prompt("a story", "t", "creative_writing", "middle", "arena-hard/creative_writing"))
    assert folds(prompts, "sources") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert folds(prompts, "whole-sources") == [[0, 1, 2, 3], [4, 5], [6, 7]]


def test_the_heads_large_boundary_is_placed_on_real_users_short_asks() -> None:
    """``calibration(..., large_on=short_real_user_ask)``: the large boundary is the logit above
    which 1 - ``hard_quantile`` of the chosen hard prompts fall; the other hard prompts, however
    high they score, do not move it; the small boundary is the easy prompts' as before."""
    from bench.classifier_data import EASY, HARD, Prompt
    from bench.classifier_training import SHORT_ASK_CHARS, calibration, short_real_user_ask

    ask = Prompt("How do I count unresponsive pods per namespace in PromQL?", "t", "c", HARD, "arena-hard/coding")
    assert short_real_user_ask(ask)
    assert short_real_user_ask(Prompt("Résous x² = 4 dans les réels.", "t", "c", HARD, "arena-hard/math"))
    assert not short_real_user_ask(Prompt("x" * SHORT_ASK_CHARS, "t", "c", HARD, "arena-hard/coding"))
    assert not short_real_user_ask(Prompt("求函数 f(x)=x² 的导数", "t", "c", HARD, "arena-hard/math"))  # other script
    assert not short_real_user_ask(Prompt(ask.text, "t", "c", HARD, "gsm8k-test"))
    assert not short_real_user_ask(Prompt(ask.text, "t", "c", EASY, "arena-hard/coding"))

    # Ten short asks at logits 0..9 (one group), ten humaneval tasks at 100, ten easy at -10..-1.
    prompts = [Prompt(f"ask {i}", "t", "c", HARD, "arena-hard/coding") for i in range(10)]
    prompts += [Prompt("x" * SHORT_ASK_CHARS, "t", "c", HARD, "humaneval") for _ in range(10)]
    prompts += [Prompt(f"easy {i}", "t", "c", EASY, "qqp") for i in range(10)]
    logits = np.array([*range(10), *[100.0] * 10, *range(-10, 0)], dtype=float)
    _, _, t_small, t_large = calibration(logits, prompts, 0.8, 0.4, short_real_user_ask)
    # Easy: the first logit with 80% of the weight at or below it: -3 (the 8th of 10).
    # Asks: the first with 40% at or below it: 3 (the 4th); 7 of the 10 asks score at least 3.
    assert (t_small, t_large) == (-3.0, 3.0)
    # Over every hard prompt, the humaneval tasks would lift it: half the hard weight is at 100.
    assert calibration(logits, prompts, 0.8, 0.4)[3] == 7.0


def test_held_out_short_real_user_asks_go_large_and_easy_prompts_stay_small() -> None:
    """Issue 34's bars on the public prompts, for the static head (the default): retrained with
    every source held out whole in turn, arena-hard as one, and scored through the shipped
    calibration, at least 55% of real users' short hard asks go large (60% is where the large
    boundary was put), and of all hard prompts; at least 80% of easy prompts stay small."""
    from bench.classifier_data import EASY, HARD, available, data_dir

    if not available():
        pytest.skip(f"the public prompts are not under {data_dir()} (../shared/data beside the repository)")
    pytest.importorskip("sklearn", reason="retraining needs scikit-learn (the 'train' extra)")
    from bench.classifier_data import load
    from bench.classifier_training import short_real_user_ask
    from bench.static_head_training import StaticInputs, out_of_fold

    prompts = load()
    static = default_static_head()
    logits = out_of_fold(StaticInputs.of(static, prompts), prompts, "whole-sources")
    tiers = {i: classify_tier(static.score(float(logits[i]))) for i, p in enumerate(prompts) if p.scored}
    asks = [i for i in tiers if short_real_user_ask(prompts[i])]
    hard = [i for i in tiers if prompts[i].label == HARD]
    easy = [i for i in tiers if prompts[i].label == EASY]
    assert len(asks) == 175
    assert sum(tiers[i] == "large" for i in asks) / len(asks) >= 0.55
    assert sum(tiers[i] == "large" for i in hard) / len(hard) >= 0.55
    assert sum(tiers[i] == "small" for i in easy) / len(easy) >= 0.8


def classify_tier(score: float) -> str:
    """The default tier holding ``score``."""
    return next((t.name for t in DEFAULT_TIERS if t.min_score <= score < t.max_score), DEFAULT_TIERS[-1].name)


def test_pairs_held_out_train_on_neither_group_and_weigh_pairs_by_their_comparisons(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The benchmark's both-sides-held-out protocol: every (hard group, easy group) pair once,
    each scored by a model that read neither group (nor a prompt derived from one: the heads
    train on derived prompts, the n-gram model does not); pooled AUC weighs a pair by hard x easy."""
    import bench.classifier as bench
    from bench.classifier_data import EASY, HARD, Prompt
    from bench.classifier_training import Fitted

    texts = {
        ("hard", "h1"): ["prove the integral of x^2 sin x", "implement a lock-free queue in C++", "x"],
        ("hard", "h2"): ["derive the gradient of softmax cross-entropy", "write a parser for JSON in Rust"],
        ("easy", "e1"): ["what is the capital of France", "tell me a joke"],
        ("easy", "e2"): ["say hello", "what colour is the sky", "name a fruit"],
    }
    prompts = [
        Prompt(text, "test", group, HARD if label == "hard" else EASY, group)
        for (label, group), items in texts.items()
        for text in items
    ]
    prompts.append(Prompt("a lock-free queue, asked in words", "test", "asked", HARD, "h1/asked", origin=1))
    trained_on: list[set[str]] = []

    def spy(ps: list[Prompt], feats: list[set[str]], idx: list[int]) -> Fitted:
        """Records what each model would be trained on (too few prompts here to train one)."""
        trained_on.append({ps[i].group for i in idx})
        return Fitted({}, 0.0)

    monkeypatch.setattr(bench, "fit_on", spy)
    static_trained_on: list[set[str]] = []

    def static_spy(inputs: Any, ps: list[Prompt], idx: list[int]) -> tuple[Any, float]:
        static_trained_on.append({ps[i].group for i in idx})
        return np.zeros(inputs.x.shape[1]), 0.0

    monkeypatch.setattr(bench, "fit_static", static_spy)
    static = default_static_head()
    inputs = bench.StaticInputs.of(static, prompts)
    pairs = bench.pairs_held_out(prompts, [features(p.text) for p in prompts], default_model(), (static, inputs), None)
    assert [(p.hard_group, p.easy_group) for p in pairs] == [("h1", "e1"), ("h1", "e2"), ("h2", "e1"), ("h2", "e2")]
    assert trained_on == [{"h2", "e2"}, {"h2", "e1"}, {"h1", "e2"}, {"h1", "e1"}]
    assert static_trained_on == [{"h2", "e2"}, {"h2", "e1"}, {"h1", "h1/asked", "e2"}, {"h1", "h1/asked", "e1"}]

    # Pooled figures, by hand: pair AUCs 1.0 (3 x 2 comparisons) and 0.5 (2 x 2) -> 0.8.
    perfect = bench.HeldPair("h1", "e1", [0, 1, 2], [5, 6], {"c": np.array([0.9, 0.8, 0.7, 0.1, 0.2])})
    tied = bench.HeldPair("h2", "e1", [3, 4], [5, 6], {"c": np.array([0.47, 0.47, 0.47, 0.47])})
    figures = bench.pair_figures(prompts, [perfect, tied], "c")
    assert figures.auc == pytest.approx(0.8)
    assert figures.hard_large == pytest.approx(3 / 5)  # 0.9, 0.8, 0.7 are large; 0.47 is medium
    assert figures.easy_small == pytest.approx(2 / 4)  # 0.1, 0.2 small; the tied pair's 0.47 medium
