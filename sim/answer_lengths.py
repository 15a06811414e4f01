"""How long the simulated model's answers are when nothing holds them to ``max_tokens``.

A real model ends its answer with its end-of-sequence token, and vLLM reports that as
``finish_reason`` "stop" (Messages "end_turn", Responses "completed"). Agents depend on it: a
turn of Claude Code or of the Agents SDK ends only on a natural stop, never on "length". So the
simulator draws each answer's length from a log-normal, the shape chat answers have (a body
around the median, a long right tail), as ``capacity/workload.py`` models output lengths.

The draw is a pure function of the request: seeded by its ``seed`` and its prompt, so the same
request ends at the same token on every replica and in every run, whatever else the engine was
given, and tests can count on it. A drawn length past ``max_tokens`` is cut there with "length",
as a real model's long answer is.

vLLM's ``ignore_eos`` request field skips the draw (the answer runs to ``max_tokens``), and so
does the server's ``--ignore-eos`` for every request: benchmarks that need answers of exactly
``max_tokens`` tokens use one or the other.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class AnswerLengths:
    """Answer lengths in tokens: log-normal with this ``median`` and log-space ``sigma``."""

    median: float
    sigma: float

    def __post_init__(self) -> None:
        if self.median < 1 or self.sigma < 0:
            raise ValueError("answer lengths need median >= 1 and sigma >= 0")

    def end_of(self, prompt: str, seed: int | None) -> int:
        """The token after which this request's answer ends on its own (at least 1)."""
        rng = random.Random(f"answer-length|{seed}|{prompt}")
        return max(1, round(rng.lognormvariate(math.log(self.median), self.sigma)))


# An instruct model answering chat: median 250 tokens, a tenth of the answers past ~540 and one
# in a hundred past ~1,000 (the chat-assistant workload of capacity/profiles/ draws its answers
# the same way).
CHAT_ANSWERS = AnswerLengths(median=250, sigma=0.6)
