"""Evaluate the complexity classifier on public prompts, out of source; writes bench/results/classifier.md.

    .venv/bin/python -m bench.classifier              # needs ../shared/data, scikit-learn and the semantic extra
    .venv/bin/python -m bench.classifier --no-embedding # the static head and the n-gram model (no embedding model)

The prompts and their hard/easy/middle labels are ``bench.classifier_data``'s. For each fold
protocol of ``scripts/train_classifier.py`` (``sources``: leave-one-source-out; ``whole-sources``:
the same with arena-hard's categories held out together, the heads' calibration folds;
``easy-sources``: every easy source held out with a random share of the hard prompts;
``random``), every labelled prompt is scored by a model trained without its fold, through the
shipped model's calibration, and the out-of-fold scores are pooled: a held-out source of one
class alone has no AUC. Beside them, every pair of a hard and an easy group is held out
together and both are scored by the one model that read neither (``pairs_held_out``): the shipped model's case on
sources it never saw, with no pooling of two models' logits. Four classifiers: the static
head (``routing.static_head``, ``scripts/train_static_head.py``), the n-gram model it
replaced (the baseline), the embedding head (``routing.embedding_head``, its recipe
``bench.classifier_training.HeadRecipe``), and the two heads as the gateway mixes them when
the semantic cache is what embeds (``embedding: auto``): the embedding head for texts the
cache embeds (at most ``cache.semantic.max_text_chars``), the static head for longer ones.
Reported on the
same prompts: AUC hard vs easy, of prompt length in characters and of the old keyword rule
(``bench.classifier_keywords``); the tier confusion at the default boundaries; each held-out
group's tiers. The middle kinds (never trained on) are scored by models trained on every
labelled prompt. Candidates: the head's recipes (length, n-gram logit, characters per token,
the words' frequency)
side by side. Cost:
single ``classify`` calls on every prompt, ``REPEATS`` times, wall and thread CPU time
(``timing``), with and without a vector, and the n-gram model's own call; and the embedding
itself, one text at a time.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.classifier_data import EASY, HARD, MIDDLE, Prompt, available, data_dir, load
from bench.classifier_keywords import keyword_score
from bench.classifier_training import (
    CALIBRATION_PROTOCOL,
    HEAD_CALIBRATION_PROTOCOL,
    HEAD_EASY_QUANTILE,
    HEAD_HARD_QUANTILE,
    SHORT_ASK_CHARS,
    HeadRecipe,
    PromptVectors,
    TextInputs,
    embed,
    fit_head,
    fit_on,
    head_out_of_fold,
    out_of_fold,
    short_real_user_ask,
    train_final,
    train_final_head,
)
from bench.static_head_training import StaticInputs
from bench.static_head_training import fit as fit_static
from bench.static_head_training import out_of_fold as static_out_of_fold
from dialects.openai import CHAT
from routing.classifier import (
    DEFAULT_TIERS,
    LinearModel,
    classify,
    default_model,
    features,
)
from routing.embedding_head import EmbeddingHead, default_head, embedding_text
from routing.static_head import HEAD_CHARS, TAIL_CHARS, StaticHead, default_static_head

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "classifier.md"
PROTOCOLS = ("sources", "whole-sources", "easy-sources", "random")
# The head's recipes are compared on these (``RECIPES``).
CANDIDATE_PROTOCOLS = ("sources", "easy-sources", "random")
# The bars of issue 34 (hard -> large) and issue 19 (the others), on held-out sources.
LARGE_BAR = 0.55
SMALL_BAR = 0.8
REPEATS = 20
# The semantic cache's default max_text_chars: longer texts it does not embed (``embedding: auto``).
CACHE_MAX_TEXT_CHARS = 1000
# Texts embedded one at a time for the embedding's own cost.
EMBED_COST_SAMPLE = 300
# The head's recipes compared (``bench.classifier_training.HeadRecipe``).
RECIPES = (
    ("embedding", HeadRecipe(length=False, ngram_weight=0.0)),
    ("embedding + log length", HeadRecipe(length=True, ngram_weight=0.0)),
    ("embedding + n-gram logit", HeadRecipe(length=False, ngram_weight=1.0)),
    ("embedding + n-gram logit x 0.5", HeadRecipe(length=False, ngram_weight=0.5)),
    ("embedding + log length + n-gram logit", HeadRecipe(length=True, ngram_weight=1.0)),
    ("embedding, C = 1", HeadRecipe(length=False, ngram_weight=0.0, c=1.0)),
    ("embedding, C = 3", HeadRecipe(length=False, ngram_weight=0.0, c=3.0)),
    ("embedding + log length, C = 1", HeadRecipe(length=True, ngram_weight=0.0, c=1.0)),
)
# Each recipe above without and with characters per token in the model's window (the shipped
# head has it): the rows say "+ chars per token". None of them weighs the words' frequency; the
# shipped recipe, which does, is the last row.
PER_TOKEN = (False, True)
TIERS = [t.name for t in DEFAULT_TIERS]
# What ``embedding: auto`` gives a tenant whose semantic cache is on.
MIXED = "head where the cache embeds, else static head"
# A section written by hand after the generated ones (experiments run apart, their method
# stated in it): a rerun keeps it instead of dropping it.
KEPT_SECTION = "## Tried and not shipped"
# "About the same length" for ``length_matched``: within this factor of each other.
LENGTH_MATCH = 1.25


def auc(pos: Sequence[float], neg: Sequence[float]) -> float:
    """Probability that a random hard prompt outscores a random easy one (ties count half)."""
    values = np.concatenate([np.asarray(pos, float), np.asarray(neg, float)])
    order = values.argsort(kind="mergesort")
    ranks = np.empty(len(values))
    sorted_values = values[order]
    # Average ranks over ties.
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and sorted_values[j + 1] == sorted_values[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    n_pos, n_neg = len(pos), len(neg)
    return float((ranks[:n_pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def tier_of(score: float) -> str:
    for t in DEFAULT_TIERS:
        if t.min_score <= score < t.max_score:
            return t.name
    return DEFAULT_TIERS[-1].name


def body_of(text: str) -> dict[str, Any]:
    return {"model": "auto", "messages": [{"role": "user", "content": text}]}


def tiers_row(scores: Sequence[float]) -> str:
    tiers = [tier_of(s) for s in scores]
    return " | ".join(f"{tiers.count(t) / len(tiers):.0%}" for t in TIERS)


def auc_rows(prompts: Sequence[Prompt], idx: Sequence[int], scores: np.ndarray, title: str) -> list[str]:
    """``| title | hard / easy | AUC | length | AUC - length | keyword rule | hard -> large | easy -> small |``."""
    hard = [i for i in idx if prompts[i].label == HARD]
    easy = [i for i in idx if prompts[i].label == EASY]
    length = {i: float(len(prompts[i].text)) for i in idx}
    keywords = {i: keyword_score(body_of(prompts[i].text)) for i in idx}
    learned = auc(scores[hard], scores[easy])
    by_length = auc([length[i] for i in hard], [length[i] for i in easy])
    by_keywords = auc([keywords[i] for i in hard], [keywords[i] for i in easy])
    large = np.mean([tier_of(scores[i]) == "large" for i in hard])
    small = np.mean([tier_of(scores[i]) == "small" for i in easy])
    return [
        f"| {title} | {len(hard)} / {len(easy)} | **{learned:.3f}** | {by_length:.3f} | {learned - by_length:+.3f} | "
        f"{by_keywords:.3f} | {large:.0%} | {small:.0%} |"
    ]


def length_matched(prompts: Sequence[Prompt], idx: Sequence[int], values: np.ndarray) -> tuple[int, float]:
    """Over the pairs of a hard and an easy prompt of ``idx`` whose lengths are within
    ``LENGTH_MATCH`` times each other: (how many pairs, the share in which the hard one has the
    higher value, ties counting half)."""
    hard = np.array([i for i in idx if prompts[i].label == HARD])
    easy = np.array([i for i in idx if prompts[i].label == EASY])
    log_length = np.log([max(1, len(p.text)) for p in prompts])
    near = np.abs(log_length[hard][:, None] - log_length[easy][None, :]) <= np.log(LENGTH_MATCH)
    ahead = values[hard][:, None] - values[easy][None, :]
    won = (ahead > 0) + 0.5 * (ahead == 0)
    return int(near.sum()), float(won[near].mean())


def bars(prompts: Sequence[Prompt], idx: Sequence[int], scores: np.ndarray, cpu_p99_us: float, name: str) -> str:
    """One sentence against the bars (issue 19's, hard -> large issue 34's) for ``scores``, with the figures."""
    hard = [i for i in idx if prompts[i].label == HARD]
    easy = [i for i in idx if prompts[i].label == EASY]
    learned = auc(scores[hard], scores[easy])
    by_length = auc([float(len(prompts[i].text)) for i in hard], [float(len(prompts[i].text)) for i in easy])
    large = float(np.mean([tier_of(scores[i]) == "large" for i in hard]))
    small = float(np.mean([tier_of(scores[i]) == "small" for i in easy]))
    return against_bars(name, learned, by_length, large, small, cpu_p99_us)


def against_bars(name: str, learned: float, by_length: float, large: float, small: float, cpu_p99_us: float) -> str:
    def verdict(ok: bool) -> str:
        return "met" if ok else "**not met**"

    return (
        f"{name}: AUC {learned:.3f} >= 0.85 {verdict(learned >= 0.85)}; {learned - by_length:+.3f} over length "
        f"({by_length:.3f}), bar +0.08 {verdict(learned - by_length >= 0.08)}; hard -> large {large:.0%} "
        f"{verdict(large >= LARGE_BAR)}; easy -> small {small:.0%} {verdict(small >= SMALL_BAR)}; "
        f"classification CPU p99 {cpu_p99_us:.0f} µs {verdict(cpu_p99_us <= 1000)}."
    )


def confusion(prompts: Sequence[Prompt], idx: Sequence[int], scores: np.ndarray) -> list[str]:
    lines = ["| label \\ tier | " + " | ".join(TIERS) + " |", "| --- | " + " | ".join("---:" for _ in TIERS) + " |"]
    for label in (HARD, EASY):
        rows = [i for i in idx if prompts[i].label == label]
        counts = [sum(tier_of(scores[i]) == t for i in rows) for t in TIERS]
        lines.append(f"| {label} ({len(rows)}) | " + " | ".join(str(c) for c in counts) + " |")
    return lines


@dataclass(frozen=True, slots=True)
class HeldPair:
    """One hard and one easy group held out together: both scored by the one model (of each
    classifier) trained on every other group, as a shipped model meets two sources it never
    read. ``scores``: each classifier's scores of ``hard + easy``, in that order."""

    hard_group: str
    easy_group: str
    hard: list[int]
    easy: list[int]
    scores: dict[str, np.ndarray]


def pairs_held_out(
    prompts: Sequence[Prompt],
    feats: Sequence[set[str]],
    shipped: LinearModel,
    static: tuple[StaticHead, StaticInputs],
    head: tuple[EmbeddingHead, PromptVectors, HeadRecipe, np.ndarray] | None,
) -> list[HeldPair]:
    """Every (hard group, easy group) pair held out, through the shipped calibrations.

    ``static``: the shipped static head (for its calibration) and the prompts' inputs to it;
    ``head``: the shipped embedding head, the prompts' vectors, the recipe, and which prompts
    the semantic cache embeds (for the mixed classifier); None: no embedding head.
    """
    labelled = [i for i, p in enumerate(prompts) if p.scored]
    trained = [i for i, p in enumerate(prompts) if p.trained]
    groups = {c: sorted({prompts[i].group for i in labelled if prompts[i].label == c}) for c in (HARD, EASY)}
    text = TextInputs.of(prompts, head[1]) if head is not None else None
    pairs = []
    for hard_group, easy_group in itertools.product(groups[HARD], groups[EASY]):
        hard = [i for i in labelled if prompts[i].group == hard_group]
        easy = [i for i in labelled if prompts[i].group == easy_group]
        held = hard + easy
        pair = (hard_group, easy_group)
        rest = [
            i
            for i in trained
            if prompts[i].group not in pair and (prompts[i].origin < 0 or prompts[prompts[i].origin].group not in pair)
        ]
        ngram = fit_on(prompts, feats, [i for i in rest if prompts[i].scored]).logits([feats[i] for i in held])
        scores = {"n-gram": scores_of(shipped.score, ngram)}
        static_head, inputs = static
        coef, bias = fit_static(inputs, prompts, rest)
        scores["static head"] = scores_of(static_head.score, inputs.x[held] @ coef + bias)
        if head is not None and text is not None:
            calibrated, vectors, recipe, cached = head
            y = [int(prompts[i].label == HARD) for i in rest]
            fitted = fit_head(vectors.x, text, rest, y, [prompts[i].group for i in rest], recipe)
            logits = fitted.logits(vectors.x, text, held, ngram)
            scores["embedding head"] = scores_of(calibrated.score, logits)
            scores[MIXED] = np.where(cached[held], scores["embedding head"], scores["static head"])
        pairs.append(HeldPair(hard_group, easy_group, hard, easy, scores))
    return pairs


@dataclass(frozen=True, slots=True)
class PairFigures:
    """A classifier's figures over held-out pairs: the AUCs are the pairs' AUCs weighted by
    hard x easy prompts (each comparison of a hard and an easy prompt made by the model that
    read neither); the tier shares count a prompt once per pair it is held out in."""

    auc: float
    length: float
    keywords: float
    hard_large: float
    easy_small: float


def pair_figures(prompts: Sequence[Prompt], pairs: Sequence[HeldPair], name: str) -> PairFigures:
    sums = np.zeros(3)
    weight = 0
    large: list[bool] = []
    small: list[bool] = []
    for pair in pairs:
        n = len(pair.hard)
        scores = pair.scores[name]
        w = n * len(pair.easy)
        sums += w * np.array(
            [
                auc(scores[:n], scores[n:]),
                auc([len(prompts[i].text) for i in pair.hard], [len(prompts[i].text) for i in pair.easy]),
                auc(
                    [keyword_score(body_of(prompts[i].text)) for i in pair.hard],
                    [keyword_score(body_of(prompts[i].text)) for i in pair.easy],
                ),
            ]
        )
        weight += w
        large += [tier_of(v) == "large" for v in scores[:n]]
        small += [tier_of(v) == "small" for v in scores[n:]]
    a, length, keywords = sums / weight
    return PairFigures(float(a), float(length), float(keywords), float(np.mean(large)), float(np.mean(small)))


@dataclass(frozen=True, slots=True)
class Cost:
    """Per-call percentiles in µs: wall clock and the calling thread's CPU time."""

    wall_p50: float
    wall_p99: float
    cpu_p50: float
    cpu_p99: float
    worst_median: float  # the slowest prompt's median wall time


def timing(texts: Sequence[str], score: Callable[[int, dict[str, Any]], object]) -> Cost:
    """Every prompt ``REPEATS`` times, one call at a time (``score(index, body)``).

    Wall time (``perf_counter_ns``) includes whatever the scheduler does to this process on
    a shared machine; CPU time (``thread_time_ns``) is what the call itself costs.
    """
    bodies = [body_of(t) for t in texts]
    wall: list[list[int]] = [[] for _ in bodies]
    cpu: list[int] = []
    for _ in range(REPEATS):
        for i, body in enumerate(bodies):
            start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
            score(i, body)
            cpu.append(time.thread_time_ns() - start_cpu)
            wall[i].append(time.perf_counter_ns() - start)
    walls = sorted(ns for runs in wall for ns in runs)
    cpu.sort()

    def pct(xs: list[int], q: float) -> float:
        return xs[min(len(xs) - 1, int(len(xs) * q))] / 1000

    worst = max(statistics.median(runs) for runs in wall) / 1000
    return Cost(pct(walls, 0.5), pct(walls, 0.99), pct(cpu, 0.5), pct(cpu, 0.99), worst)


def embedding_cost(texts: Sequence[str]) -> Cost:
    """The embedding of one text at a time, as an idle gateway's embedder runs it: the model
    call in the calling thread (wall and CPU), each text once after a warm-up."""
    import asyncio

    from cache.semantic.embedder import SentenceTransformerEmbedder

    async def run() -> Cost:
        async with SentenceTransformerEmbedder() as e:
            e._embed_now(texts[:8])
            wall: list[int] = []
            cpu: list[int] = []
            for text in texts:
                start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
                e._embed_now([text])
                cpu.append(time.thread_time_ns() - start_cpu)
                wall.append(time.perf_counter_ns() - start)
        wall.sort()
        cpu.sort()

        def pct(xs: list[int], q: float) -> float:
            return xs[min(len(xs) - 1, int(len(xs) * q))] / 1000

        return Cost(pct(wall, 0.5), pct(wall, 0.99), pct(cpu, 0.5), pct(cpu, 0.99), wall[-1] / 1000)

    return asyncio.run(run())


def window_cost(texts: Sequence[str]) -> Cost:
    """What reporting a text's token window adds to its embedding: the window read from the
    tokenisation the embedding runs anyway (``OnnxModel._windows``), every text ``REPEATS``
    times, one at a time as a lone lookup runs it."""
    import asyncio

    from cache.semantic.embedder import SentenceTransformerEmbedder

    async def run() -> Cost:
        async with SentenceTransformerEmbedder() as e:
            model = e._model
            assert model is not None
            tokenizer, width = model._tokenizer, model._max_length
            encoded = [
                tokenizer([t], padding=False, truncation=True, max_length=width, return_tensors="np") for t in texts
            ]
            return timing(texts, lambda i, body: model._windows([texts[i]], encoded[i]))

    return asyncio.run(run())


def scores_of(score: Callable[[float], float], logits: np.ndarray) -> np.ndarray:
    """Logits through a head's calibration (``score``); NaN (not scored) stays NaN."""
    return np.array([score(v) if not np.isnan(v) else np.nan for v in logits])


def cost_row(name: str, c: Cost, unit: str = "µs") -> str:
    if unit == "ms":
        return (
            f"| {name} | {c.wall_p50 / 1000:.2f} ms | {c.wall_p99 / 1000:.2f} ms | {c.cpu_p50 / 1000:.2f} ms | "
            f"{c.cpu_p99 / 1000:.2f} ms | {c.worst_median / 1000:.2f} ms |"
        )
    return (
        f"| {name} | {c.wall_p50:.1f} µs | {c.wall_p99:.1f} µs | {c.cpu_p50:.1f} µs | {c.cpu_p99:.1f} µs | "
        f"{c.worst_median:.1f} µs |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-embedding", action="store_true", help="leave the embedding head out")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if not available():
        raise SystemExit(f"no classifier data under {data_dir()} (set FLEETGATE_CLASSIFIER_DATA)")
    prompts = load()
    feats = [features(p.text) for p in prompts]
    shipped = default_model()
    labelled = [i for i, p in enumerate(prompts) if p.scored]
    arena = [i for i in labelled if prompts[i].label == EASY or prompts[i].group.startswith("arena-hard/")]
    # The heads' large boundary is placed on these hard prompts (``short_real_user_ask``).
    short_asks = [i for i in labelled if prompts[i].label == EASY or short_real_user_ask(prompts[i])]
    subsets = (
        (labelled, ""),
        (arena, ", arena only"),
        (short_asks, ", short real-user asks"),
    )
    retrained = train_final(prompts, feats)
    fresh = LinearModel(retrained.weights, retrained.bias, shipped.scale, shipped.shift)
    ngram_all = np.array([fresh.logit(f)[0] for f in feats])
    ngram_logits = {protocol: out_of_fold(prompts, feats, protocol) for protocol in PROTOCOLS}
    ngram_scores = {protocol: scores_of(shipped.score, ngram_logits[protocol]) for protocol in PROTOCOLS}
    middle: dict[str, np.ndarray] = {"n-gram": np.array([fresh.score(v) for v in ngram_all])}
    scores: dict[str, dict[str, np.ndarray]] = {"n-gram": ngram_scores}
    head: EmbeddingHead | None = None
    candidates: list[str] = []
    embed_s = 0.0
    static = default_static_head()
    static_inputs = StaticInputs.of(static, prompts)
    static_logits = {p: static_out_of_fold(static_inputs, prompts, p) for p in PROTOCOLS}
    scores["static head"] = {p: scores_of(static.score, static_logits[p]) for p in PROTOCOLS}
    coef, bias = fit_static(static_inputs, prompts, [i for i, p in enumerate(prompts) if p.trained])
    middle["static head"] = scores_of(static.score, static_inputs.x @ coef + bias)
    if not args.no_embedding:
        head = default_head()
        started = time.perf_counter()
        vectors = embed(prompts)
        x = vectors.x
        embed_s = time.perf_counter() - started
        if vectors.identity != head.embedder:
            raise SystemExit(
                f"the shipped head was trained on embedder {head.embedder}, this one is {vectors.identity}"
            )
        recipe = HeadRecipe(
            length=head.length_weight != 0.0,
            ngram_weight=head.ngram_weight,
            chars_per_token=head.uses_window,
            word_zipf=head.uses_words,
        )
        head_logits = {p: head_out_of_fold(prompts, vectors, ngram_logits[p], p, recipe) for p in PROTOCOLS}
        scores["embedding head"] = {p: scores_of(head.score, head_logits[p]) for p in PROTOCOLS}
        cached = np.array([len(embedding_text(p.text)) <= CACHE_MAX_TEXT_CHARS for p in prompts])
        scores[MIXED] = {p: np.where(cached, scores["embedding head"][p], scores["static head"][p]) for p in PROTOCOLS}
        final = train_final_head(prompts, vectors, recipe)
        middle["embedding head"] = scores_of(
            head.score, final.logits(x, TextInputs.of(prompts, vectors), range(len(prompts)), ngram_all)
        )
        middle[MIXED] = np.where(cached, middle["embedding head"], middle["static head"])
        hard = [i for i in labelled if prompts[i].label == HARD]
        easy = [i for i in labelled if prompts[i].label == EASY]
        arena_hard = [i for i in hard if prompts[i].group.startswith("arena-hard/")]
        variants = [
            (name + (" + chars per token" if per_token else ""), replace(r, chars_per_token=per_token, word_zipf=False))
            for per_token in PER_TOKEN
            for name, r in RECIPES
        ]
        variants.append(("shipped: embedding + log length + chars per token + word frequency", recipe))
        for name, r in variants:
            row = [name]
            for p in CANDIDATE_PROTOCOLS:
                logits = head_logits[p] if r == recipe else head_out_of_fold(prompts, vectors, ngram_logits[p], p, r)
                row.append(f"{auc(logits[hard], logits[easy]):.3f}")
                if p == "sources":
                    row.append(f"{auc(logits[arena_hard], logits[easy]):.3f}")
            candidates.append("| " + " | ".join(row) + " |")
        short = int(cached[labelled].sum())
    pairs = pairs_held_out(
        prompts, feats, shipped, (static, static_inputs), None if head is None else (head, vectors, recipe, cached)
    )
    lines = [
        "# Complexity classifier",
        "",
        "Command: `.venv/bin/python -m bench.classifier` (data: `../shared/data`, see "
        '`bench/classifier_data.py`; labels and reasons: docs/routing.md, "Complexity classifier").',
        "",
        f"{len(labelled)} labelled prompts ({sum(prompts[i].label == HARD for i in labelled)} hard, "
        f"{sum(prompts[i].label == EASY for i in labelled)} easy) and "
        f"{sum(p.label == MIDDLE for p in prompts)} middle ones (never trained on); the heads also train on "
        f"{sum(p.origin >= 0 for p in prompts)} humaneval tasks asked in words (`asked_in_words`, never scored, "
        "held out with their task). Scores are out of fold "
        "(each prompt scored by a model trained without its fold) through the shipped calibrations; "
        f"the n-gram model's default boundaries come from its `{CALIBRATION_PROTOCOL}` folds, the two heads' "
        f"from their `{HEAD_CALIBRATION_PROTOCOL}` folds ({HEAD_EASY_QUANTILE:.0%} of easy prompts below "
        f"{DEFAULT_TIERS[0].max_score:g}, {1 - HEAD_HARD_QUANTILE:.0%} of real users' short hard asks above "
        f"{DEFAULT_TIERS[-1].min_score:g}: arena-hard's, under {SHORT_ASK_CHARS} characters, in the Latin alphabet, "
        f"{len(short_asks) - sum(prompts[i].label == EASY for i in short_asks)} of them; every group weighing "
        "the same; `bench/classifier_training.py`).",
        "",
        "Classifiers: **n-gram** (`routing/data/classifier.json`, the head without an embedding before the static "
        "head, kept as a baseline); **static head** (`routing/data/classifier-static.json`: word-piece vectors "
        "distilled from all-MiniLM-L6-v2, what classifies without an embedding); **embedding head** "
        "(`routing/data/classifier-embedding.json`, over the semantic cache's all-MiniLM-L6-v2 vector"
        + (
            f", recipe: length {'on' if head.length_weight else 'off'}, characters per token "
            f"{'on' if head.uses_window else 'off'}, n-gram logit weight {head.ngram_weight:g}"
            if head is not None
            else ""
        )
        + f"); **{MIXED}**: what `routing.classifier.embedding: auto` gives "
        f"a tenant with the semantic cache on, which embeds texts of at most {CACHE_MAX_TEXT_CHARS} characters"
        + (f" ({short} of the {len(labelled)} labelled prompts)" if head is not None else "")
        + "; `always` gives the embedding head on every prompt.",
        "",
        "## AUC hard vs easy, and the bars' tier shares, per fold protocol",
        "",
        "`sources`: every group held out whole (arena-hard coding and maths apart: those folds "
        "learn hard prompts from the other hard kinds only). `whole-sources`: the same with arena-hard's "
        "coding and maths held out together (no fold has read a real user's hard ask of arena-hard's); "
        "the heads' calibration folds. `easy-sources`: every easy source "
        "held out whole with a random sixth of the hard prompts. `random`: 5 random folds. "
        '"arena only": the same scores, hard side restricted to arena-hard\'s real-user prompts; '
        '"short real-user asks": to those the large boundary is placed on. '
        "Bars (issue 19): AUC >= 0.85 and >= length + 0.08 on held-out sources; easy -> small >= "
        f"{SMALL_BAR:.0%}; hard -> large >= {LARGE_BAR:.0%} (issue 34).",
        "",
        "| folds | classifier | hard / easy | AUC | length | AUC - length | keyword rule | hard -> large | "
        "easy -> small |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for protocol in PROTOCOLS:
        for subset, suffix in subsets:
            for name, by_protocol in scores.items():
                row = auc_rows(prompts, subset, by_protocol[protocol], f"{protocol}{suffix} | {name}")
                lines += row
    arena_pairs = [pair for pair in pairs if pair.hard_group.startswith("arena-hard/")]
    lines += [
        "",
        "## Both sides held out: one hard and one easy group at a time",
        "",
        f"Each of the {len(pairs)} pairs of a hard and an easy group is held out together; one model of each "
        "classifier, trained on every other group, scores both (through the shipped calibrations). This is the "
        "case of the shipped model on two sources it never read. In the `sources` folds above, a hard prompt's "
        "score and an easy prompt's come from two models, whose logits differ in scale; here every comparison "
        "is made by one model. The pooled rows weigh each pair's AUC by its hard x easy prompts; the tier shares "
        "count a prompt once per pair it is held out in.",
        "",
        "| hard group | easy group | hard / easy | length | keyword rule | " + " | ".join(scores) + " |",
        "| --- | --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in scores) + " |",
    ]
    for pair in pairs:
        figures = [pair_figures(prompts, [pair], name) for name in scores]
        lines.append(
            f"| {pair.hard_group} | {pair.easy_group} | {len(pair.hard)} / {len(pair.easy)} | "
            f"{figures[0].length:.3f} | {figures[0].keywords:.3f} | "
            + " | ".join(f"{f.auc:.3f}" for f in figures)
            + " |"
        )
    lines += [
        "",
        "| pairs | classifier | AUC | length | AUC - length | keyword rule | hard -> large | easy -> small |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for subset, title in ((pairs, f"all {len(pairs)}"), (arena_pairs, f"the {len(arena_pairs)} with arena-hard")):
        for name in scores:
            f = pair_figures(prompts, subset, name)
            lines.append(
                f"| {title} | {name} | **{f.auc:.3f}** | {f.length:.3f} | {f.auc - f.length:+.3f} | {f.keywords:.3f} | "
                f"{f.hard_large:.0%} | {f.easy_small:.0%} |"
            )
    lengths = np.array([float(len(p.text)) for p in prompts])
    keywords = np.array([keyword_score(body_of(p.text)) for p in prompts])
    lines += [
        "",
        "## Length held equal: hard and easy prompts of about the same length",
        "",
        f"Every pair of a hard and an easy prompt whose lengths are within {LENGTH_MATCH:g} times each other; "
        "each column is the share of those pairs in which the hard prompt has the higher value (ties count "
        "half): an AUC restricted to comparable lengths. Length itself stays a little above 0.5 (within a band "
        "the hard prompt is still often the longer). What a classifier shows here is what it reads beyond "
        "length. `sources` folds.",
        "",
        "| prompts | pairs | length | keyword rule | " + " | ".join(scores) + " |",
        "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in scores) + " |",
    ]
    for subset, title in ((labelled, "all labelled"), (arena, "arena-hard vs easy")):
        n, by_length = length_matched(prompts, subset, lengths)
        cells = [f"{length_matched(prompts, subset, by['sources'])[1]:.3f}" for by in scores.values()]
        lines.append(
            f"| {title} | {n} | {by_length:.3f} | {length_matched(prompts, subset, keywords)[1]:.3f} | "
            + " | ".join(cells)
            + " |"
        )
    for name, by_protocol in scores.items():
        lines += ["", f"## Tiers at the default boundaries: {name} (out of fold)"]
        for protocol in ("sources", "whole-sources"):
            lines += ["", f"`{protocol}` folds:", ""]
            lines += confusion(prompts, labelled, by_protocol[protocol])
        lines += ["", "`easy-sources` folds:", ""]
        lines += confusion(prompts, labelled, np.nan_to_num(by_protocol["easy-sources"]))
    lines += [
        "",
        "## Each held-out group's tiers (`whole-sources` folds; middle kinds: models trained on all labelled prompts)",
        "",
        "| group | label | n | " + " | ".join(f"{name}: {t}" for name in scores for t in TIERS) + " |",
        "| --- | --- | ---: | " + " | ".join("---:" for _ in scores for _ in TIERS) + " |",
    ]
    for label in (HARD, EASY, MIDDLE):
        for group in sorted({p.group for p in prompts if p.label == label and p.origin < 0}):
            idx = [i for i, p in enumerate(prompts) if p.group == group]
            cells = [
                tiers_row((middle[name] if label == MIDDLE else scores[name]["whole-sources"])[idx]) for name in scores
            ]
            lines.append(f"| {group} | {label} | {len(idx)} | " + " | ".join(cells) + " |")
        if label == HARD:
            idx = [i for i in short_asks if prompts[i].label == HARD]
            cells = [tiers_row(scores[name]["whole-sources"][idx]) for name in scores]
            lines.append(f"| arena-hard, short real-user asks | {label} | {len(idx)} | " + " | ".join(cells) + " |")
    texts = [p.text for p in prompts if p.origin < 0]
    load_average = os.getloadavg()[0]
    costs = [
        ("static head (`classify(CHAT.prompt(body))`)", timing(texts, lambda i, body: classify(CHAT.prompt(body)))),
        (
            "n-gram model (`model.logit(features(CHAT.prompt(body).instruction))`)",
            timing(texts, lambda i, body: shipped.score(shipped.logit(features(CHAT.prompt(body).instruction))[0])),
        ),
    ]
    if head is not None:
        rows = x.astype(np.float32)
        windows = [(int(pieces), int(chars)) for pieces, chars in vectors.windows]
        costs.append(
            (
                "embedding head, on a given vector and window (`classify(prompt, vector=v, window=w)`)",
                timing(
                    texts,
                    lambda i, body: classify(CHAT.prompt(body), vector=rows[i], window=windows[i], head=head),
                ),
            )
        )
    costs.append(("keyword rule (old)", timing(texts, lambda i, body: keyword_score(body))))
    lines += [
        "",
        f"## Cost per classification ({len(texts)} prompts x {REPEATS} runs, Python {platform.python_version()}, "
        "one core of a shared 2-core machine)",
        "",
        "Single calls on the whole request body; the static head and the n-gram model read the head and tail of a "
        "prompt only "
        f"({HEAD_CHARS} + {TAIL_CHARS} characters), so the cost is bounded whatever its size. Wall time includes "
        f"preemption by other processes (load average {load_average:.1f} on 2 cores as timing began); "
        "CPU time is the calling thread's, the call's own cost. The embedding head's cost is on top of a vector "
        "already computed.",
        "",
        "| classifier | wall p50 | wall p99 | CPU p50 | CPU p99 | slowest prompt (median wall) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [cost_row(name, c) for name, c in costs]
    lines += ["", "## Against the bars (every source held out whole)", "", "`whole-sources` folds:", ""]
    cpu_p99 = {"static head": costs[0][1].cpu_p99, "n-gram": costs[1][1].cpu_p99}
    if head is not None:
        cpu_p99["embedding head"] = costs[2][1].cpu_p99
        cpu_p99[MIXED] = max(cpu_p99["embedding head"], cpu_p99["static head"])
    for subset, suffix in subsets:
        for name in scores:
            lines.append("- " + bars(prompts, subset, scores[name]["whole-sources"], cpu_p99[name], name + suffix))
    lines += [
        "",
        "Both sides held out (the pairs above; every recipe was chosen on the `sources` folds, before this "
        "protocol was measured, and the heads' calibration on the `whole-sources` folds):",
        "",
    ]
    for subset, suffix in ((pairs, ""), (arena_pairs, ", arena-hard pairs")):
        for name in scores:
            f = pair_figures(prompts, subset, name)
            lines.append("- " + against_bars(name + suffix, f.auc, f.length, f.hard_large, f.easy_small, cpu_p99[name]))
    if head is not None:
        lines += [
            "",
            "The embedding head's cost is on top of the vector (the bar's \"on top of an embedding the cache "
            'computes anyway"); with `embedding: always` and no semantic cache the embedding itself is paid '
            "too (below).",
        ]
    if head is not None:
        sample = texts[:: max(1, len(texts) // EMBED_COST_SAMPLE)][:EMBED_COST_SAMPLE]
        embedding = embedding_cost([embedding_text(t) for t in sample])
        window = window_cost([embedding_text(t) for t in texts])
        lines += [
            "",
            f"The embedding itself (what `embedding: always` adds to a request the semantic cache does not embed): "
            f"{len(sample)} prompts of the set, one at a time, in the calling thread (the gateway runs it in the "
            "embedder's worker thread, off the event loop; under load texts share batches and cost less each). "
            f"The whole set embedded in batches of 64 took {embed_s:.1f} s here. Load average "
            f"{os.getloadavg()[0]:.1f} on 2 cores as this began: on a quiet core one query costs 5.1 ms (p50) / "
            "9.9 ms (p99) of CPU (docs/semantic-cache.md, Latency).",
            "",
            "| embedding (all-MiniLM-L6-v2, ONNX Runtime, 1 thread) | wall p50 | wall p99 | CPU p50 | CPU p99 | "
            "slowest |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
            cost_row("one text", embedding, "ms"),
            cost_row(
                f"its token window, read from the same tokenisation (all {len(texts)} prompts x {REPEATS})", window
            ),
            "",
            "The token window (word pieces the model read, characters they cover) is what `embed_windowed` adds to "
            "the embedding for the head's characters-per-token input; it is in the embedding's time above.",
            "",
            "## Candidates: the head's recipes (AUC hard vs easy, out of fold)",
            "",
            "The vector alone, with log length as an input of the regression, and with the n-gram model's logit "
            "added (its out-of-fold logit of the same folds, times a fixed weight); each also with characters per "
            "token of the model's window as an input (`+ chars per token`: log of the characters the window covers "
            "over its word pieces, as the embedder reports them); all at C = "
            f"{HeadRecipe().c:g} unless the row says otherwise, none with the words' frequency; the last row is "
            "the shipped recipe, which adds the mean Zipf frequency of the words (`routing/word_frequency.py`). "
            "The shipped recipe and its C were picked on these same `sources` folds (and the words' frequency "
            "on the pairs held out as well), and characters per token and the words' frequency among several "
            'extra inputs tried on them ("Tried and not shipped"): a selection on the figures reported.',
            "",
            "| recipe | sources | sources, arena only | " + " | ".join(CANDIDATE_PROTOCOLS[1:]) + " |",
            "| --- | " + " | ".join("---:" for _ in range(len(CANDIDATE_PROTOCOLS) + 1)) + " |",
            *candidates,
        ]
    kept = kept_section(args.out)
    args.out.write_text("\n".join(lines) + "\n" + kept)
    print("\n".join(lines))


def kept_section(path: Path) -> str:
    """``KEPT_SECTION`` and what follows it in the results file already there, or ""."""
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    start = text.find("\n" + KEPT_SECTION)
    return text[start:] if start >= 0 else ""


if __name__ == "__main__":
    main()
