"""The complexity classifier's labelled prompts: public prompts, and what each kind means for a tier.

Read from ``../shared/data`` beside the repository (``FLEETGATE_CLASSIFIER_DATA`` to point
elsewhere): ``classifier/prompts.jsonl`` (3,035 prompts with source and category, see its
README) and ``qqp_val.csv`` (short everyday questions, the first question of each pair).

Labels (the reasoning is in docs/routing.md, "Complexity classifier"): a prompt is *hard*
when a large model answers it clearly better than a small one, *easy* when a small model
answers it about as well. Kinds with a real but smaller gap are *middle*: never trained on,
reported with the tier they land in.

- hard: arena-hard ``hard_prompt/coding`` and ``hard_prompt/math`` (real users' prompts,
  picked for being hard; strong and weak models differ most there), gsm8k (multi-step
  arithmetic) and humaneval (writing a function to a specification): small models get a
  fifth to a half of these wrong where large ones get nearly all right.
- easy: alpaca-eval (self-instruct tasks, OpenAssistant, Koala, Anthropic helpful-base),
  vicuna-bench generic, knowledge, common-sense, roleplay, writing and counterfactual
  questions, and ``QQP_SAMPLE`` everyday questions from QQP.
- middle: arena-hard ``creative_writing`` and vicuna-bench coding, maths and fermi
  questions: taste or textbook exercises, where the gap between model sizes is small or
  unclear.

Each prompt carries a ``group``, the unit held out in the leave-one-source-out folds: its
source, except for alpaca-eval, a compilation of sets written by different people
(self-instruct, OpenAssistant, Koala, Anthropic helpful-base: one group each), and
arena-hard, whose coding and maths prompts are held out apart.

Training also reads each humaneval task *asked in words* (``asked_in_words``): its
docstring's description without the signature and the examples, as a person would ask for
the same function. Hard prompts otherwise hold no coding ask in plain language when
arena-hard's coding prompts are held out, only humaneval's code template, and the heads
learnt the template. These derived prompts (``origin``: the index of the prompt they come
from) are trained on, never scored: every figure is on the public prompts as they are, and a
derived prompt is held out whenever its origin is.
"""

from __future__ import annotations

import csv
import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QQP_SAMPLE = 800
QQP_SEED = 19

HARD = "hard"
EASY = "easy"
MIDDLE = "middle"

HARD_SOURCES = frozenset({"gsm8k-test", "humaneval"})
EASY_VICUNA = frozenset({"generic", "knowledge", "common-sense", "roleplay", "writing", "counterfactual"})


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    source: str
    category: str
    label: str  # HARD, EASY or MIDDLE
    group: str  # what a leave-one-source-out fold holds out
    # The index of the prompt this one was derived from (``asked_in_words``); -1: a public prompt.
    origin: int = -1

    @property
    def trained(self) -> bool:
        """Trained on: a hard or easy prompt, public or derived."""
        return self.label in (HARD, EASY)

    @property
    def scored(self) -> bool:
        """Measured: a hard or easy public prompt (derived ones are only trained on)."""
        return self.label in (HARD, EASY) and self.origin < 0


def data_dir() -> Path:
    return Path(os.environ.get("FLEETGATE_CLASSIFIER_DATA", ROOT.parent / "shared" / "data"))


def available() -> bool:
    d = data_dir()
    return (d / "classifier" / "prompts.jsonl").is_file() and (d / "qqp_val.csv").is_file()


def label_of(source: str, category: str) -> str:
    if source == "arena-hard-v2.0":
        return HARD if category.startswith("hard_prompt/") else MIDDLE
    if source == "alpaca-eval":
        return EASY
    if source == "vicuna-bench":
        return EASY if category in EASY_VICUNA else MIDDLE
    if source == "qqp":
        return EASY
    if source in HARD_SOURCES:
        return HARD
    return MIDDLE


def group_of(source: str, category: str, label: str) -> str:
    if source == "arena-hard-v2.0":
        return f"arena-hard/{category.split('/')[-1]}"
    if source == "alpaca-eval":
        return f"alpaca-eval/{category}"
    if source == "vicuna-bench" and label == MIDDLE:
        return "vicuna-bench/coding-math-fermi"
    return source


def load() -> list[Prompt]:
    """Every prompt with its label and group (QQP sampled with a fixed seed)."""
    d = data_dir()
    prompts: list[Prompt] = []
    for line in (d / "classifier" / "prompts.jsonl").read_text(encoding="utf-8").split("\n"):
        if not line.strip():
            continue
        r = json.loads(line)
        label = label_of(r["source"], r["category"])
        prompts.append(
            Prompt(r["prompt"], r["source"], r["category"], label, group_of(r["source"], r["category"], label))
        )
    with (d / "qqp_val.csv").open(newline="", encoding="utf-8") as f:
        questions = sorted({row["question1"].strip() for row in csv.DictReader(f) if row["question1"].strip()})
    for q in random.Random(QQP_SEED).sample(questions, QQP_SAMPLE):
        prompts.append(Prompt(q, "qqp", "question", EASY, "qqp"))
    return prompts + asked_in_words(prompts)


ASKED_GROUP = "humaneval/asked"
_DOCSTRING = re.compile(r'"""(.*?)(?:"""|$)|\'\'\'(.*?)(?:\'\'\'|$)', re.S)
_EXAMPLES = re.compile(r">>>|\n\s*(?:for example|examples?)\b", re.I)


def asked_in_words(prompts: list[Prompt]) -> list[Prompt]:
    """Each humaneval task as a plain-language ask: its docstring up to the examples, on one
    line (at least 20 characters). Hard, group ``ASKED_GROUP`` (weighed as a group of its own),
    ``origin`` the task's index."""
    derived = []
    for i, p in enumerate(prompts):
        if p.source != "humaneval":
            continue
        found = _DOCSTRING.search(p.text)
        if found is None:
            continue
        words = " ".join(_EXAMPLES.split(found.group(1) or found.group(2))[0].split())
        if len(words) >= 20:
            derived.append(Prompt(words, p.source, "asked in words", HARD, ASKED_GROUP, origin=i))
    return derived
