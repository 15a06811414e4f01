"""Evaluate the complexity classifier on public prompts, out of source; writes bench/results/classifier.md.

    .venv/bin/python -m bench.classifier                 # needs ../shared/data and scikit-learn
    .venv/bin/python -m bench.classifier --embedding     # also the sentence-embedding candidates

The prompts and their hard/easy/middle labels are ``bench.classifier_data``'s. For each fold
protocol of ``scripts/train_classifier.py`` (``sources``: leave-one-source-out; ``easy-sources``:
every easy source held out with a random share of the hard prompts; ``random``), every
labelled prompt is scored by a model trained without its fold, through the shipped model's
calibration, and the out-of-fold scores are pooled: a held-out source of one class alone has
no AUC. Reported on the same prompts: AUC hard vs easy of the learned score, of prompt
length in characters and of the old keyword rule (``bench.classifier_keywords``); the tier
confusion at the default boundaries; each held-out group's tiers. The middle kinds (never
trained on) are scored by a model trained on every labelled prompt. Cost: single
``classify`` calls on every prompt, ``REPEATS`` times, wall and thread CPU time (``timing``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.classifier_data import EASY, HARD, MIDDLE, Prompt, available, data_dir, load
from bench.classifier_keywords import keyword_score
from routing.classifier import (
    DEFAULT_TIERS,
    HEAD_CHARS,
    TAIL_CHARS,
    LinearModel,
    classify,
    default_model,
    features,
)
from scripts.train_classifier import CALIBRATION_PROTOCOL, out_of_fold, train_final

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "classifier.md"
PROTOCOLS = ("sources", "easy-sources", "random")
REPEATS = 20
TIERS = [t.name for t in DEFAULT_TIERS]


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


def confusion(prompts: Sequence[Prompt], idx: Sequence[int], scores: np.ndarray) -> list[str]:
    lines = ["| label \\ tier | " + " | ".join(TIERS) + " |", "| --- | " + " | ".join("---:" for _ in TIERS) + " |"]
    for label in (HARD, EASY):
        rows = [i for i in idx if prompts[i].label == label]
        counts = [sum(tier_of(scores[i]) == t for i in rows) for t in TIERS]
        lines.append(f"| {label} ({len(rows)}) | " + " | ".join(str(c) for c in counts) + " |")
    return lines


def group_rows(prompts: Sequence[Prompt], scores: np.ndarray, label: str) -> list[str]:
    lines = []
    for group in sorted({p.group for p in prompts if p.label == label}):
        idx = [i for i, p in enumerate(prompts) if p.group == group]
        lines.append(f"| {group} | {label} | {len(idx)} | {tiers_row(scores[idx])} |")
    return lines


@dataclass(frozen=True, slots=True)
class Cost:
    """Per-call percentiles in µs: wall clock and the calling thread's CPU time."""

    wall_p50: float
    wall_p99: float
    cpu_p50: float
    cpu_p99: float
    worst_median: float  # the slowest prompt's median wall time


def timing(texts: Sequence[str], score: Callable[[dict[str, Any]], object]) -> Cost:
    """Every prompt ``REPEATS`` times, one call at a time.

    Wall time (``perf_counter_ns``) includes whatever the scheduler does to this process on
    a shared machine; CPU time (``thread_time_ns``) is what the call itself costs.
    """
    bodies = [body_of(t) for t in texts]
    wall: list[list[int]] = [[] for _ in bodies]
    cpu: list[int] = []
    for _ in range(REPEATS):
        for i, body in enumerate(bodies):
            start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
            score(body)
            cpu.append(time.thread_time_ns() - start_cpu)
            wall[i].append(time.perf_counter_ns() - start)
    walls = sorted(ns for runs in wall for ns in runs)
    cpu.sort()

    def pct(xs: list[int], q: float) -> float:
        return xs[min(len(xs) - 1, int(len(xs) * q))] / 1000

    worst = max(statistics.median(runs) for runs in wall) / 1000
    return Cost(pct(walls, 0.5), pct(walls, 0.99), pct(cpu, 0.5), pct(cpu, 0.99), worst)


def embedding_rows(prompts: Sequence[Prompt], ngram: dict[str, np.ndarray]) -> list[str]:
    """The sentence-embedding head and the combination, same folds (needs the semantic extra)."""
    import asyncio

    from sklearn.linear_model import LogisticRegression

    from cache.semantic.embedder import SentenceTransformerEmbedder
    from scripts.train_classifier import folds, group_weights

    async def embed() -> np.ndarray:
        async with SentenceTransformerEmbedder(max_batch_size=64) as e:
            parts = [await e.embed([p.text for p in prompts[i : i + 64]]) for i in range(0, len(prompts), 64)]
        return np.concatenate(parts)

    x = asyncio.run(embed())
    train = [i for i, p in enumerate(prompts) if p.label in (HARD, EASY)]
    y = np.array([int(p.label == HARD) for p in prompts])
    g = [p.group for p in prompts]
    lines = []
    for protocol in PROTOCOLS:
        emb = np.full(len(prompts), np.nan)
        for held in folds(prompts, protocol):
            out = set(held)
            rest = [i for i in train if i not in out]
            clf = LogisticRegression(C=1.0, max_iter=3000)
            clf.fit(x[rest], y[rest], sample_weight=group_weights(list(y[rest]), [g[i] for i in rest]))
            emb[held] = clf.decision_function(x[held])
        both = emb + ngram[protocol]
        hard = [i for i in train if y[i] == 1]
        easy = [i for i in train if y[i] == 0]
        lines.append(
            f"| {protocol} | {auc(emb[hard], emb[easy]):.3f} | {auc(both[hard], both[easy]):.3f} | "
            f"{auc(ngram[protocol][hard], ngram[protocol][easy]):.3f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--embedding", action="store_true", help="also the sentence-embedding candidates")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if not available():
        raise SystemExit(f"no classifier data under {data_dir()} (set FLEETGATE_CLASSIFIER_DATA)")
    prompts = load()
    feats = [features(p.text) for p in prompts]
    shipped = default_model()
    labelled = [i for i, p in enumerate(prompts) if p.label in (HARD, EASY)]
    arena = [i for i in labelled if prompts[i].label == EASY or prompts[i].group.startswith("arena-hard/")]
    retrained = train_final(prompts, feats)
    fresh = LinearModel(retrained.weights, retrained.bias, shipped.scale, shipped.shift)
    middle_scores = np.array([fresh.score(fresh.logit(f)[0]) for f in feats])
    logits: dict[str, np.ndarray] = {}
    lines = [
        "# Complexity classifier",
        "",
        "Command: `.venv/bin/python -m bench.classifier` (data: `../shared/data`, see "
        '`bench/classifier_data.py`; labels and reasons: docs/routing.md, "Complexity classifier").',
        "",
        f"{len(labelled)} labelled prompts ({sum(prompts[i].label == HARD for i in labelled)} hard, "
        f"{sum(prompts[i].label == EASY for i in labelled)} easy) and "
        f"{sum(p.label == MIDDLE for p in prompts)} middle ones (never trained on). Scores are out of fold "
        "(each prompt scored by a model trained without its fold) through the shipped calibration; "
        f"the default boundaries come from the `{CALIBRATION_PROTOCOL}` folds "
        "(`scripts/train_classifier.py`).",
        "",
        "## AUC hard vs easy, and the bars' tier shares, per fold protocol",
        "",
        "`sources`: every group held out whole (arena-hard coding and maths apart: those folds "
        "learn hard prompts from the other hard kinds only). `easy-sources`: every easy source "
        "held out whole with a random sixth of the hard prompts. `random`: 5 random folds. "
        '"arena only": the same scores, hard side restricted to arena-hard\'s real-user prompts.',
        "",
        "| folds | hard / easy | learned | length | learned - length | keyword rule | hard -> large | easy -> small |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for protocol in PROTOCOLS:
        x = out_of_fold(prompts, feats, protocol)
        logits[protocol] = x
        scores = np.array([shipped.score(v) if not np.isnan(v) else np.nan for v in x])
        lines += auc_rows(prompts, labelled, scores, protocol)
        lines += auc_rows(prompts, arena, scores, f"{protocol}, arena only")
        if protocol == "sources":
            source_scores = scores
    lines += ["", "## Tiers at the default boundaries (`sources` folds, out of fold)", ""]
    lines += confusion(prompts, labelled, source_scores)
    lines += ["", "Easy-sources folds (the calibration's):", ""]
    lines += confusion(prompts, labelled, np.array([shipped.score(v) for v in np.nan_to_num(logits["easy-sources"])]))
    lines += [
        "",
        "## Each held-out group's tiers (`sources` folds; middle kinds: model trained on all labelled prompts)",
        "",
        "| group | label | n | " + " | ".join(TIERS) + " |",
        "| --- | --- | ---: | " + " | ".join("---:" for _ in TIERS) + " |",
    ]
    lines += group_rows(prompts, source_scores, HARD) + group_rows(prompts, source_scores, EASY)
    lines += group_rows(prompts, middle_scores, MIDDLE)
    default_model()
    texts = [p.text for p in prompts]
    load_average = os.getloadavg()[0]
    learned_cost = timing(texts, classify)
    rule_cost = timing(texts, keyword_score)
    lines += [
        "",
        f"## Cost per classification ({len(prompts)} prompts x {REPEATS} runs, Python {platform.python_version()}, "
        "one core of a shared 2-core machine)",
        "",
        "Single calls of `classify` on the whole request body; the head and tail of a prompt only are read "
        f"({HEAD_CHARS} + {TAIL_CHARS} characters), so the cost is bounded whatever its size. Wall time includes "
        f"preemption by other processes (load average {load_average:.1f} on 2 cores as timing began); "
        "CPU time is the calling thread's, the call's own cost.",
        "",
        "| classifier | wall p50 | wall p99 | CPU p50 | CPU p99 | slowest prompt (median wall) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, c in (("learned (shipped)", learned_cost), ("keyword rule (old)", rule_cost)):
        lines.append(
            f"| {name} | {c.wall_p50:.1f} µs | {c.wall_p99:.1f} µs | {c.cpu_p50:.1f} µs | {c.cpu_p99:.1f} µs | "
            f"{c.worst_median:.1f} µs |"
        )
    if args.embedding:
        lines += [
            "",
            "## Candidates: sentence-embedding head and the combination (AUC hard vs easy, same folds)",
            "",
            "Logistic regression over the semantic cache's embedding (all-MiniLM-L6-v2 with the shipped "
            "layers, first 256 word pieces); the combination adds the two logits. The head itself is one "
            "384-wide dot product (microseconds); the embedding costs 5.1 ms (p50) / 9.9 ms (p99) of CPU per "
            "query on ONNX Runtime (docs/semantic-cache.md), paid anyway only when the tenant's semantic cache "
            "is on. Not shipped: see docs/routing.md.",
            "",
            "| folds | embedding head | embedding + n-grams | n-grams |",
            "| --- | ---: | ---: | ---: |",
        ]
        lines += embedding_rows(prompts, logits)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
