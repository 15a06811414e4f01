"""Each model's prompt-token counter: its tokenizer where one is configured, else the estimate.

``PromptCounter.count`` replaces a request's estimated prompt tokens (``Call.prompt_tokens``)
with the model's tokenizer's count before the context-length check, admission and routing
read them. A long prompt is counted on a worker thread (``tokenizers`` releases the GIL
while it encodes), a short one inline, where the hop to a thread would cost more than the
count (bench/results/tokenize-cost.md). A body the gateway cannot count exactly (an image,
a template that refuses the conversation) keeps its estimate: the replica is the judge of
what it accepts, and the fallback is logged, at most once a minute per model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dialects.base import Call
from tokens.locate import tokenizer_directory
from tokens.model_tokenizer import ModelTokenizer, TokenizerError

log = logging.getLogger("fleetgate.tokens")

# Prompts estimated at up to this many tokens are counted on the event loop: rendering and
# encoding them takes less than handing them to a thread and back.
INLINE_MAX_TOKENS = 512
# Worker threads: tokenising runs outside the GIL, so two keep long prompts from queueing
# behind each other without taking every core from the event loop.
WORKERS = 2
# A model's fallbacks to the estimate are logged at most this often.
FALLBACK_LOG_INTERVAL_S = 60.0


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """A model's tokenizer as configured: ``reference`` is a directory or a model id (None:
    none); ``explicit`` when ``models[].tokenizer`` names it (it must load), not when it
    defaults to a managed replica's ``model_path`` (a warning, then the estimate);
    ``env`` is the replicas' environment, where a model id's Hugging Face cache is found."""

    model: str
    reference: str | None
    explicit: bool
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class _Tally:
    counted: int = 0
    fallbacks: int = 0
    last_logged: float | None = None
    unlogged: int = 0


class PromptCounter:
    """Counts a request's prompt tokens with its model's tokenizer, where the model has one."""

    def __init__(
        self,
        tokenizers: Mapping[str, ModelTokenizer],
        *,
        inline_max_tokens: int = INLINE_MAX_TOKENS,
        workers: int = WORKERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tokenizers = dict(tokenizers)
        self._inline_max_tokens = inline_max_tokens
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="tokens") if self._tokenizers else None
        self._clock = clock
        self._tallies = {model: _Tally() for model in self._tokenizers}

    @classmethod
    def load(cls, specs: Sequence[TokenizerSpec], **options: Any) -> PromptCounter:
        """Every model's tokenizer, loaded now. An explicit one that cannot be read raises
        ``TokenizerError`` naming the model; a defaulted one is warned about and skipped."""
        loaded: dict[str, ModelTokenizer] = {}
        for spec in specs:
            if spec.reference is None:
                continue
            directory = tokenizer_directory(spec.reference, spec.env)
            try:
                if directory is None:
                    raise TokenizerError(
                        f"{spec.reference} is neither a directory nor a model in the Hugging Face cache"
                    )
                loaded[spec.model] = ModelTokenizer.load(directory)
            except TokenizerError as exc:
                if spec.explicit:
                    raise TokenizerError(f"model {spec.model!r}: {exc}") from exc
                log.warning(
                    "no tokenizer for this model: its prompt tokens are estimated (set models[].tokenizer)",
                    extra={"model": spec.model, "reason": str(exc)},
                )
                continue
            log.info(
                "prompt tokens counted with the model's tokenizer",
                extra={"model": spec.model, "tokenizer": str(directory)},
            )
        return cls(loaded, **options)

    def counts(self, model: str) -> bool:
        """Whether ``model`` has a tokenizer (requests of the others keep their estimate)."""
        return model in self._tokenizers

    def source(self, model: str) -> str:
        """``tokenizer`` or ``estimate``: what the model's requests' prompt tokens are."""
        return "tokenizer" if model in self._tokenizers else "estimate"

    async def count(self, model: str, call: Call, *, ids: bool = False) -> None:
        """``call.prompt_tokens`` counted with ``model``'s tokenizer (unchanged without one, or
        for a body it cannot count); with ``ids``, the token ids kept too
        (``call.prompt_token_ids``: a model whose replicas publish KV events)."""
        tokenizer = self._tokenizers.get(model)
        if tokenizer is None or call.prompt_tokens_counted:
            return
        work: Callable[[Any, dict[str, Any]], int | list[int]] = tokenizer.token_ids if ids else tokenizer.count
        try:
            if call.prompt_tokens <= self._inline_max_tokens or self._executor is None:
                result = work(call.dialect, call.body)
            else:
                loop = asyncio.get_running_loop()
                result = await loop.run_in_executor(self._executor, work, call.dialect, call.body)
        except Exception as exc:  # whatever the template or the body does, the estimate stands in
            self._fell_back(model, call, exc)
            return
        if isinstance(result, list):
            call.prompt_token_ids = result
            tokens = len(result)
        else:
            tokens = result
        call.prompt_tokens, call.prompt_tokens_counted = tokens, True
        self._tallies[model].counted += 1

    def _fell_back(self, model: str, call: Call, exc: Exception) -> None:
        tally = self._tallies[model]
        tally.fallbacks += 1
        now = self._clock()
        if tally.last_logged is not None and now - tally.last_logged < FALLBACK_LOG_INTERVAL_S:
            tally.unlogged += 1
            return
        log.warning(
            "prompt tokens estimated: the model's tokenizer could not count this request",
            extra={
                "model": model,
                "api": call.dialect.name,
                "reason": f"{type(exc).__name__}: {exc}"[:300],
                "not_logged_since": tally.unlogged,
            },
        )
        tally.last_logged, tally.unlogged = now, 0

    def describe(self, models: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Per model: where its prompt tokens come from (``/admin/fleet``)."""
        out: dict[str, dict[str, Any]] = {}
        for model in models:
            tokenizer = self._tokenizers.get(model)
            if tokenizer is None:
                out[model] = {"prompt_tokens": "estimate"}
                continue
            tally = self._tallies[model]
            out[model] = {
                "prompt_tokens": "tokenizer",
                "tokenizer": str(tokenizer.directory),
                "chat_templates": sorted(tokenizer.templates),
                "counted": tally.counted,
                "estimated": tally.fallbacks,
            }
        return out

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
