"""A batch's token ``usage``: what each answered item's upstream ``usage`` adds, summed.

OpenAI's batch object carries ``usage`` (``openai.types.BatchUsage``): input and output
tokens, their total, and two details, cached input tokens and reasoning output tokens. An
item adds its answer's counts as the answer's own API reports them, read by that API's
dialect (``dialects.registry``): chat and completions ``prompt_tokens`` /
``completion_tokens``, Responses ``input_tokens`` / ``output_tokens``, Messages its input
tokens with cache reads and writes among them, embeddings ``prompt_tokens``. A detail the
answer does not report counts 0 (vLLM reports cached tokens only with
``--enable-prompt-tokens-details``, reasoning tokens only with a reasoning parser).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dialects.registry import BY_PATH

# Where each API's answer reports the two details (the field holding the details, the count).
_CACHED = (("prompt_tokens_details", "cached_tokens"), ("input_tokens_details", "cached_tokens"))
_REASONING = (("completion_tokens_details", "reasoning_tokens"), ("output_tokens_details", "reasoning_tokens"))
# Anthropic's Messages report cache reads beside the input tokens, not inside a details object.
_ANTHROPIC_CACHED = "cache_read_input_tokens"


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens of the items answered so far; ``cached`` is part of ``input``, ``reasoning`` of ``output``."""

    input: int = 0
    output: int = 0
    cached: int = 0
    reasoning: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.input + other.input,
            self.output + other.output,
            self.cached + other.cached,
            self.reasoning + other.reasoning,
        )

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``usage`` object of a batch."""
        return {
            "input_tokens": self.input,
            "input_tokens_details": {"cached_tokens": self.cached},
            "output_tokens": self.output,
            "output_tokens_details": {"reasoning_tokens": self.reasoning},
            "total_tokens": self.input + self.output,
        }

    def to_json(self) -> dict[str, int]:
        """As a batch record keeps it."""
        return {"input": self.input, "output": self.output, "cached": self.cached, "reasoning": self.reasoning}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Usage:
        return cls(**{k: int(data.get(k) or 0) for k in ("input", "output", "cached", "reasoning")})


# No tokens: a new batch's usage, and what an item without an answer's usage adds.
ZERO = Usage()


def usage_of(endpoint: str, answer: Any) -> Usage:
    """What an answered item adds to its batch's usage (nothing when the answer has none)."""
    dialect = BY_PATH.get(endpoint)
    if dialect is None or not isinstance(answer, dict):
        return ZERO
    counted = dialect.usage(answer) or {}
    raw = answer.get("usage")
    raw = raw if isinstance(raw, dict) else {}
    cached = _count(raw.get(_ANTHROPIC_CACHED)) + sum(_detail(raw, field, key) for field, key in _CACHED)
    reasoning = sum(_detail(raw, field, key) for field, key in _REASONING)
    return Usage(_count(counted.get("prompt_tokens")), _count(counted.get("completion_tokens")), cached, reasoning)


def _detail(usage: dict[str, Any], field: str, key: str) -> int:
    details = usage.get(field)
    return _count(details.get(key)) if isinstance(details, dict) else 0


def _count(value: Any) -> int:
    """A token count as reported, or 0 for anything that is not a count."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
