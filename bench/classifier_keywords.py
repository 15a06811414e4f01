"""The keyword rule fleetgate routed with before the learned classifier: a baseline only.

A capped sum of hand-weighted cues (length, code, maths, reasoning words, simple-request
words), kept verbatim from the old ``routing/classifier.py`` so that ``bench/classifier.py``
scores it on the same prompts as the learned model. Nothing in the gateway uses it.
"""

from __future__ import annotations

import math
import re
from typing import Any

from dialects.base import text_of as _content_text

# ~4 characters per token on English text, as in dialects.base.
CHARS_PER_TOKEN = 4
# Only the head and tail of the instruction are scanned for cues: instructions sit at the
# start or the end of a pasted document, and scanning it all would make cost grow with size.
INSTRUCTION_HEAD = 400
INSTRUCTION_TAIL = 400
# Prompt length contributes from LENGTH_FLOOR tokens (shorter says nothing) up to
# LENGTH_CEIL tokens, on a log scale: 4x longer is one more step of complexity.
LENGTH_FLOOR_TOKENS = 50
LENGTH_CEIL_TOKENS = 4000
# Requested output: long generations (code, reports) need the bigger tier; tiny ones do not.
LONG_OUTPUT_TOKENS = 2000
SHORT_OUTPUT_TOKENS = 100
# A bare base keeps an empty signal inside the small tier but off zero, so single cues matter.
BASE_SCORE = 0.2

# Contribution weights (tuned on the tuning half; see module docstring).
W_LENGTH = 0.35
W_TURNS = 0.04
MAX_TURNS_SCORE = 0.20
W_CODE_BLOCK = 0.12
W_CODE_TASK = 0.25
W_MATH = 0.15
MAX_MATH_SCORE = 0.35
W_REASONING = 0.2
MAX_REASONING_SCORE = 0.5
W_PROOF = 0.35
W_CODE_TOPIC = 0.12
W_STEPS = 0.15
W_EXPLAIN = 0.15
W_LONG_OUTPUT = 0.15
W_SHORT_OUTPUT = -0.10
W_SIMPLE = -0.2
# A system prompt is mostly a fixed persona (and prefix-cached): it counts at this rate.
SYSTEM_LENGTH_RATE = 0.25
# Simple-request cues are ignored past this many instruction characters: editing or
# translating a long text is real work even when the ask sounds trivial.
SIMPLE_MAX_CHARS = 240
# Contributions smaller than this are left out of the explanation.
REASON_MIN = 0.05
MAX_REASONS = 3

REASONING_WORDS = frozenset(
    "justify analyze analyse evaluate critique compare trade-offs tradeoffs "
    "design architecture risks rollback reasoning assess recommend root cause contradictions".split()
)
REASONING_PHRASES = ("step by step", "root cause", "trade-off", "think through", "walk me through")
PROOF_WORDS = frozenset("prove proof rigorous rigorously derive".split())
CODE_TOPIC_WORDS = frozenset(
    "code csv regex sql query function class python typescript javascript rust java golang bash api json".split()
)
CODE_TASK_WORDS = frozenset("implement refactor port unit tests review debug".split())
MATH_WORDS = frozenset(
    "integral derivative equation equations recurrence probability theorem lemma matrix eigenvalue integer "
    "solutions solve sum prime primes irrational converge diverges bound".split()
)
EXPLAIN_WORDS = frozenset(
    "explain summarize summarise summary tl;dr difference why email regex function query example overview "
    "points".split()
)
SIMPLE_WORDS = frozenset(
    "hi hello hey thanks thank ok capital define synonym translate haiku joke grammar typo typos politely "
    "convert currency hours".split()
)
MATH_SYMBOLS = ("^", "=", "∫", "∑", "√", "≤", "≥", "\\frac", "\\sum")

_WORD = re.compile(r"[a-z][a-z0-9;'-]*")
_NUMBERED_LINE = re.compile(r"(?m)^\s*\d+[.)]\s")


def keyword_score(body: dict[str, Any]) -> float:
    """The old classifier's score in [0, 1] for ``body``."""
    return min(1.0, max(0.0, BASE_SCORE + sum(_contributions(body).values())))


def _contributions(body: dict[str, Any]) -> dict[str, float]:
    chars, fences, instruction, turns = _scan(body)
    full_instruction_chars = len(instruction)
    if full_instruction_chars > INSTRUCTION_HEAD + INSTRUCTION_TAIL:
        instruction = instruction[:INSTRUCTION_HEAD] + "\n" + instruction[-INSTRUCTION_TAIL:]
    lowered = instruction.lower()
    words = set(_WORD.findall(lowered))

    c: dict[str, float] = {}
    tokens = chars / CHARS_PER_TOKEN
    if tokens > LENGTH_FLOOR_TOKENS:
        span = math.log(LENGTH_CEIL_TOKENS / LENGTH_FLOOR_TOKENS)
        c["long_prompt"] = W_LENGTH * min(1.0, math.log(tokens / LENGTH_FLOOR_TOKENS) / span)
    if turns > 2:
        c["deep_conversation"] = min(MAX_TURNS_SCORE, W_TURNS * (turns - 2))
    if fences:
        c["code"] = W_CODE_BLOCK
    elif words & CODE_TOPIC_WORDS:
        c["code_topic"] = W_CODE_TOPIC
    code_tasks = len(words & CODE_TASK_WORDS)
    if code_tasks:
        c["code_task"] = W_CODE_TASK * min(1.0, code_tasks / 2)
    math_hits = len(words & MATH_WORDS)
    if not fences:
        # Symbols inside code are syntax, not maths.
        math_hits += sum(1 for s in MATH_SYMBOLS if s in instruction)
    if math_hits:
        c["maths"] = min(MAX_MATH_SCORE, W_MATH * math_hits)
    # An explicit ask to reason in steps counts double: it asks for a long chain of thought.
    reasoning = len(words & REASONING_WORDS) + 2 * sum(1 for p in REASONING_PHRASES if p in lowered)
    if reasoning:
        c["reasoning"] = min(MAX_REASONING_SCORE, W_REASONING * reasoning)
    if words & PROOF_WORDS or "show that" in lowered:
        c["proof"] = W_PROOF
    if len(_NUMBERED_LINE.findall(instruction)) >= 3:
        c["multi_step"] = W_STEPS
    if words & EXPLAIN_WORDS:
        c["explain"] = W_EXPLAIN
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if isinstance(max_tokens, int):
        if max_tokens >= LONG_OUTPUT_TOKENS:
            c["long_output"] = W_LONG_OUTPUT
        elif max_tokens <= SHORT_OUTPUT_TOKENS:
            c["short_output"] = W_SHORT_OUTPUT
    if words & SIMPLE_WORDS and not reasoning and not code_tasks and full_instruction_chars <= SIMPLE_MAX_CHARS:
        c["simple_request"] = W_SIMPLE
    return c


def _scan(body: dict[str, Any]) -> tuple[float, int, str, int]:
    """Weighted prompt characters, code blocks, the latest user message (the instruction), turns."""
    messages = body.get("messages")
    if isinstance(messages, list):
        chars = 0.0
        fences = 0
        instruction = ""
        turns = 0
        for message in messages:
            if not isinstance(message, dict):
                continue
            text = _content_text(message.get("content"))
            fences += text.count("```")
            role = message.get("role")
            if role in ("system", "developer"):
                chars += len(text) * SYSTEM_LENGTH_RATE
                continue
            chars += len(text)
            if role == "user":
                instruction = text
            if role in ("user", "assistant"):
                turns += 1
        return chars, fences // 2, instruction, turns
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else ""
    text = prompt if isinstance(prompt, str) else ""
    return float(len(text)), text.count("```") // 2, text, 1
