"""Continuing OpenAI's chat completions and completions streams.

Chat: the relayed text becomes a trailing assistant message that vLLM continues
(``continue_final_message: true``, ``add_generation_prompt: false``: the prompt renders as
the original's generation prompt followed by the partial text, without an end of turn).
Completions: the prompt string followed by the relayed text.

Counting the relayed tokens: a chunk carries at least one token (an empty ``content`` or
``text`` when the token ends inside a UTF-8 character, whose bytes the detokenizer holds),
and more when vLLM merges the outputs of a stream its client reads late (seen under load).
So a chunk counts as one token, a lower bound, unless the stream says exactly: the chunk's
``token_ids`` (``return_token_ids: true``), or the cumulative ``usage`` every chunk carries
with ``stream_options.continuous_usage_stats``. Tokens after the last text are not counted:
their bytes never reached the client, and the continuation generates them again. A caller
that knows better (``/tokenize`` of the partial text) passes ``tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dialects.continuation.base import Continuation, counts, data_event, events, remaining, stop_may_straddle

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# vLLM's default ``max_tokens`` for completions (``CompletionRequest``), made explicit so
# the continuation asks only for what is left of it.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Requests whose continuation would not be the same answer: several answers, log
# probabilities (the continuation's would start from another context), the prompt echoed,
# constrained decoding (its grammar would restart at the partial text's end).
_CONSTRAINED = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
_CHAT_REFUSED: tuple[str, ...] = ("logprobs", "top_logprobs", "echo", "prompt_logprobs", *_CONSTRAINED)
_COMPLETIONS_REFUSED: tuple[str, ...] = ("logprobs", "echo", "suffix", "prompt_logprobs", *_CONSTRAINED)


@dataclass(slots=True)
class _Relayed:
    """What the relayed chunks say: the stream's identity and its one choice's text."""

    id: Any = None
    created: Any = None
    model: Any = None
    pieces: list[str] = field(default_factory=list)
    tokens: int = 0
    # The tokens up to the last chunk with text: what the client has.
    shown: int = 0


def plan_chat(call_body: dict[str, Any], relayed: bytes, tokens: int | None = None) -> Continuation | None:
    """The continuation of a chat stream cut after ``relayed``, or None when it cannot be exact;
    ``tokens``: the relayed text's tokens when the caller knows them (else counted)."""
    if _refused(call_body, _CHAT_REFUSED) or _calls_tools(call_body):
        return None
    messages = call_body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    seen = _read(relayed, chat=True)
    if seen is None:
        return None
    partial = "".join(seen.pieces)
    if not partial or stop_may_straddle(call_body.get("stop"), partial):
        return None
    tokens = seen.shown if tokens is None else tokens
    body = dict(call_body)
    if call_body.get("continue_final_message"):
        # The client's own prefill, already continued: the partial text extends it.
        last = messages[-1]
        if not isinstance(last, dict) or last.get("role") != "assistant" or not isinstance(last.get("content"), str):
            return None
        body["messages"] = [*messages[:-1], {**last, "content": last["content"] + partial}]
    else:
        body["messages"] = [*messages, {"role": "assistant", "content": partial}]
    body["continue_final_message"] = True
    body["add_generation_prompt"] = False
    for name in ("max_completion_tokens", "max_tokens"):
        left = remaining(call_body.get(name), tokens)
        if left is not None:
            body[name] = left
    _lower_min_tokens(body, tokens)
    _stream_with_usage(body)
    splicer = ChunkSplicer(seen, tokens, drop_opening=True)
    return Continuation(CHAT_PATH, body, tokens, partial, splicer)


def plan_completions(call_body: dict[str, Any], relayed: bytes, tokens: int | None = None) -> Continuation | None:
    """The continuation of a completions stream: one string prompt, one choice."""
    if _refused(call_body, _COMPLETIONS_REFUSED) or call_body.get("best_of") not in (None, 1):
        return None
    prompt = call_body.get("prompt")
    if not isinstance(prompt, str):
        return None
    seen = _read(relayed, chat=False)
    if seen is None:
        return None
    partial = "".join(seen.pieces)
    if not partial or stop_may_straddle(call_body.get("stop"), partial):
        return None
    tokens = seen.shown if tokens is None else tokens
    body = dict(call_body)
    body["prompt"] = prompt + partial
    limit = call_body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    body["max_tokens"] = remaining(limit, tokens)
    _lower_min_tokens(body, tokens)
    _stream_with_usage(body)
    return Continuation(COMPLETIONS_PATH, body, tokens, partial, ChunkSplicer(seen, tokens, drop_opening=False))


class ChunkSplicer:
    """Rewrites the continuation's chunks into the original stream's: its ``id``,
    ``created`` and ``model``; chat's opening role chunk dropped (the client had it); the
    usage made the client's.

    Usage: ``completion_tokens`` = relayed tokens + the continuation's; ``prompt_tokens`` =
    the continuation's minus the relayed tokens. The original's prompt count comes only with
    its final chunk, which never came; the continuation's prompt is the original's plus the
    partial text re-tokenised, which is the relayed tokens unless re-tokenising changed them.
    """

    __slots__ = ("_drop_opening", "_seen", "_tokens", "_usage")

    def __init__(self, seen: _Relayed, tokens: int, *, drop_opening: bool) -> None:
        self._seen = seen
        self._tokens = tokens
        self._drop_opening = drop_opening
        self._usage: dict[str, int] | None = None

    @property
    def usage(self) -> dict[str, int] | None:
        return self._usage

    def splice(self, block: bytes) -> bytes:
        out: list[bytes] = []
        for event in events(block):
            chunk = event.data
            if not isinstance(chunk, dict) or "error" in chunk:
                out.append(event.raw)  # comments, [DONE], an error event: as they came
                continue
            chunk = dict(chunk)
            if self._drop_opening and _opening(chunk):
                self._drop_opening = False
                continue
            chunk["id"], chunk["created"], chunk["model"] = self._seen.id, self._seen.created, self._seen.model
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                chunk["usage"] = self._client_usage(usage)
            out.append(data_event(chunk))
        return b"".join(out)

    def _client_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(completion, int):
            return usage
        mine = counts(max(0, prompt - self._tokens), completion + self._tokens)
        self._usage = mine
        return {**usage, **mine}


def _read(relayed: bytes, *, chat: bool) -> _Relayed | None:
    """The relayed chunks of one choice still generating text; None for anything else."""
    seen = _Relayed()
    for event in events(relayed):
        if event.done:
            return None
        chunk = event.data
        if chunk is None:
            continue  # a comment (keep-alive)
        if not isinstance(chunk, dict) or "error" in chunk:
            return None
        if seen.id is None:
            seen.id, seen.created, seen.model = chunk.get("id"), chunk.get("created"), chunk.get("model")
        choices = chunk.get("choices")
        if not isinstance(choices, list) or len(choices) > 1:
            return None
        if not choices:
            if chunk.get("usage"):
                return None  # the final usage: the stream had ended
            continue
        choice = choices[0]
        if not isinstance(choice, dict) or choice.get("index", 0) != 0 or choice.get("finish_reason") is not None:
            return None
        if chat:
            delta = choice.get("delta")
            if not isinstance(delta, dict) or delta.get("tool_calls") or delta.get("function_call"):
                return None
            if delta.get("reasoning_content") or delta.get("reasoning"):
                return None
            text = delta.get("content")
            if "role" in delta and not text:
                continue  # the opening chunk: no token
        else:
            text = choice.get("text")
        if text is not None and not isinstance(text, str):
            return None
        seen.tokens = _count(seen.tokens, chunk, choice)
        if text:
            seen.pieces.append(text)
            seen.shown = seen.tokens
    return seen if seen.pieces else None


def _count(before: int, chunk: dict[str, Any], choice: dict[str, Any]) -> int:
    """The tokens generated up to ``chunk``: exact from its cumulative usage or token ids,
    else one more (a chunk carries at least one)."""
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return max(before, int(usage["completion_tokens"]))
    ids = choice.get("token_ids")
    return before + (len(ids) if isinstance(ids, list) and ids else 1)


def _opening(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    delta = choices[0].get("delta")
    return isinstance(delta, dict) and "role" in delta and not delta.get("content")


def _refused(body: dict[str, Any], names: tuple[str, ...]) -> bool:
    if body.get("n") not in (None, 1):
        return True
    return any(body.get(name) not in (None, False, 0) for name in names)


def _calls_tools(body: dict[str, Any]) -> bool:
    """Tools the model may call: its parser reads the continuation's text alone, not the
    partial text before it, so a call would be parsed from half its markup."""
    return bool(body.get("tools") or body.get("functions")) and body.get("tool_choice") != "none"


def _lower_min_tokens(body: dict[str, Any], tokens: int) -> None:
    least = body.get("min_tokens")
    if isinstance(least, int) and not isinstance(least, bool) and least > 0:
        body["min_tokens"] = max(0, least - tokens)


def _stream_with_usage(body: dict[str, Any]) -> None:
    """Streamed, with the final usage asked for: the splicer rewrites it into the client's
    (the gateway drops it again when the client did not ask, as for any stream)."""
    body["stream"] = True
    body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
