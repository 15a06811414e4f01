"""The engine behind the simulated replica: what decides when each token comes out.

The simulator's HTTP surface (``sim.server``) speaks vLLM's API; everything about
*timing* lives behind the small ``SimEngine`` protocol below, so a trivial fixed-rate engine
(this module) and the faithful continuous-batching model (``sim.model``) slot in
the same way.

    engine.submit(SimRequest) -> SimStream      # admitted at once, tokens come later
    async for piece in stream: ...               # one generated token's text per item
    stream.cancel()                              # client left: free the slot
    engine.gauges() -> {"vllm:num_requests_running": 3.0, ...}
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from sim.answer_lengths import CHAT_ANSWERS, AnswerLengths

# A simulated "token" is this many characters of text: close to what BPE tokenizers
# average on English (OpenAI quotes ~4 characters per token).
CHARS_PER_TOKEN = 4

_WORDS = (
    "the fleet serves tokens quickly while the gateway routes each request to a warm "
    "replica and the cache answers repeated questions without a GPU"
).split()


def count_tokens(text: str) -> int:
    """The simulator's tokenizer: one token per ``CHARS_PER_TOKEN`` characters (at least one)."""
    return max(1, -(-len(text) // CHARS_PER_TOKEN))


@dataclass(frozen=True)
class SimRequest:
    """One generation request as the engine sees it."""

    request_id: str
    prompt: str
    max_tokens: int
    seed: int | None = None
    # vLLM's ``ignore_eos``: no natural end, the answer runs to ``max_tokens``.
    ignore_eos: bool = False
    # The prompt's ids from a real tokenizer (the server's ``--tokenizer``), else None: the
    # simulator's own (``sim.model.prompt_token_ids``).
    token_ids: list[int] | None = None


def natural_end(request: SimRequest, lengths: AnswerLengths, ignore_eos: bool) -> int | None:
    """Where the request's answer ends on its own; None: it runs to ``max_tokens``.

    ``ignore_eos`` is the engine's (the server's ``--ignore-eos``), for every request.
    """
    if ignore_eos or request.ignore_eos:
        return None
    return lengths.end_of(request.prompt, request.seed)


class SimStream(Protocol):
    """Generated text, one token per item; ``finish_reason`` is set when iteration ends."""

    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None

    def __aiter__(self) -> AsyncIterator[str]: ...

    def cancel(self) -> None: ...


class SimEngine(Protocol):
    """What a simulated GPU does with requests."""

    def submit(self, request: SimRequest) -> SimStream: ...

    def gauges(self) -> dict[str, float]: ...

    def cache_config(self) -> dict[str, int] | None:
        """The KV cache's ``num_gpu_blocks`` and ``block_size`` (vLLM's ``vllm:cache_config_info``); None: no cache."""
        ...

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (vLLM's dev endpoint of that name); False while requests hold blocks."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class FixedRateConfig:
    """Every request waits ``ttft_s`` for its first token, then gets ``tokens_per_s``.

    Its answer ends on its own after a length drawn from ``answer_lengths``
    (``sim.answer_lengths``) unless ``ignore_eos``, or the request's, makes it run to ``max_tokens``.
    """

    ttft_s: float = 0.05
    tokens_per_s: float = 50.0
    answer_lengths: AnswerLengths = CHAT_ANSWERS
    ignore_eos: bool = False


@dataclass
class _FixedRateStream:
    engine: FixedRateEngine
    request: SimRequest
    prompt_tokens: int
    completion_tokens: int = 0
    finish_reason: str | None = None
    _cancelled: bool = field(default=False, repr=False)

    def cancel(self) -> None:
        self._cancelled = True

    async def __aiter__(self) -> AsyncIterator[str]:
        cfg = self.engine.config
        rng = random.Random(self.request.seed if self.request.seed is not None else self.request.prompt)
        self.engine.running += 1
        try:
            await asyncio.sleep(cfg.ttft_s)
            gap = 1.0 / cfg.tokens_per_s if cfg.tokens_per_s > 0 else 0.0
            end = natural_end(self.request, cfg.answer_lengths, cfg.ignore_eos)
            stops = end is not None and end <= self.request.max_tokens
            for i in range(end if stops and end is not None else self.request.max_tokens):
                if self._cancelled:
                    self.finish_reason = "abort"
                    return
                if i:
                    await asyncio.sleep(gap)
                self.completion_tokens += 1
                yield (" " if i else "") + rng.choice(_WORDS)
            self.finish_reason = "stop" if stops else "length"
        finally:
            self.engine.running -= 1


class FixedRateEngine:
    """Unlimited parallelism, constant TTFT and decode speed: the simplest honest stand-in."""

    def __init__(self, config: FixedRateConfig) -> None:
        self.config = config
        self.running = 0
        # Requests ever submitted (tests count upstream calls with it).
        self.submitted = 0

    def submit(self, request: SimRequest) -> SimStream:
        self.submitted += 1
        return _FixedRateStream(self, request, count_tokens(request.prompt))

    def gauges(self) -> dict[str, float]:
        return {
            "vllm:num_requests_running": float(self.running),
            "vllm:num_requests_waiting": 0.0,
            "vllm:kv_cache_usage_perc": 0.0,
        }

    def cache_config(self) -> dict[str, int] | None:
        return None

    def reset_prefix_cache(self) -> bool:
        return True

    async def close(self) -> None:
        return None
