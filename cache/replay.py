"""Turn a ``CachedCompletion`` back into the response a client asked for.

JSON: the ``chat.completion`` / ``text_completion`` body vLLM sends. SSE: the chunk events
vLLM streams, byte-compatible in shape with a live stream relayed by the gateway:

    chat        role delta {"role": "assistant", "content": ""} first, then content deltas,
                tool-call deltas, finish_reason on the last choice event
    completion  text chunks, finish_reason on the last one
    both        a usage-only event (``choices: []``) only if the client asked for
                ``stream_options.include_usage``, then ``data: [DONE]``

Each replay gets a fresh ``id`` and ``created`` from the caller (time and randomness are
passed in); ``usage`` is the cached answer's own, since that is what the client receives.
The text is cut at word boundaries into at most ``MAX_CHUNKS`` content events so a client's
incremental rendering behaves as it does on a live stream.
"""

from __future__ import annotations

import os
import re
from typing import Any

import orjson

from cache.entry import CachedCompletion

# Enough events to look like a stream, few enough that a long answer stays cheap to send.
MAX_CHUNKS = 64
_WORDS = re.compile(r"\s*\S+|\s+")
_ID_PREFIX = {"chat": "chatcmpl", "completion": "cmpl"}
_SEP = b"\n\n"
DONE = b"data: [DONE]\n\n"


def new_completion_id(kind: str, entropy: bytes | None = None) -> str:
    """An id in vLLM's format (``chatcmpl-<32 hex>`` / ``cmpl-<32 hex>``)."""
    return f"{_ID_PREFIX[kind]}-{(entropy or os.urandom(16)).hex()}"


def replay_json(completion: CachedCompletion, *, completion_id: str, created: int) -> bytes:
    """The non-streamed response body."""
    if completion.kind == "chat":
        message: dict[str, Any] = {
            "role": "assistant",
            # OpenAI sends null content alongside tool calls.
            "content": None if not completion.content and completion.tool_calls else completion.content,
            "tool_calls": list(completion.tool_calls),
        }
        if completion.reasoning_content is not None:
            message["reasoning_content"] = completion.reasoning_content
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": completion.finish_reason,
            "stop_reason": None,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": completion.content,
            "logprobs": None,
            "finish_reason": completion.finish_reason,
            "stop_reason": None,
        }
        obj = "text_completion"
    payload = {
        "id": completion_id,
        "object": obj,
        "created": created,
        "model": completion.model,
        "choices": [choice],
        "usage": completion.usage,
    }
    return orjson.dumps(payload)


def replay_events(
    completion: CachedCompletion, *, completion_id: str, created: int, include_usage: bool
) -> list[bytes]:
    """The SSE events of the streamed response, ``[DONE]`` included, one bytes per event."""
    chat = completion.kind == "chat"
    head = {
        "id": completion_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": completion.model,
    }
    choices: list[dict[str, Any]] = []
    if chat:
        choices.append(_delta({"role": "assistant", "content": ""}))
        if completion.reasoning_content:
            choices.extend(_delta({"reasoning_content": p}) for p in split_text(completion.reasoning_content))
        choices.extend(_delta({"content": p}) for p in split_text(completion.content))
        for index, call in enumerate(completion.tool_calls):
            choices.append(_delta({"tool_calls": [{"index": index, **call}]}))
        if len(choices) == 1:
            # No content and no tool calls: one empty delta still carries the finish reason.
            choices.append(_delta({"content": ""}))
    else:
        choices.extend(
            {"index": 0, "text": p, "logprobs": None, "finish_reason": None, "stop_reason": None}
            for p in split_text(completion.content) or [""]
        )
    choices[-1]["finish_reason"] = completion.finish_reason
    events = [_event({**head, "choices": [c]}) for c in choices]
    if include_usage:
        events.append(_event({**head, "choices": [], "usage": completion.usage}))
    events.append(DONE)
    return events


def replay_sse(completion: CachedCompletion, *, completion_id: str, created: int, include_usage: bool) -> bytes:
    """The whole streamed response body at once (a cached answer need not trickle)."""
    return b"".join(
        replay_events(completion, completion_id=completion_id, created=created, include_usage=include_usage)
    )


def split_text(text: str, max_chunks: int = MAX_CHUNKS) -> list[str]:
    """``text`` in word-sized pieces (leading whitespace kept), at most ``max_chunks``."""
    if not text:
        return []
    words = _WORDS.findall(text)
    if len(words) <= max_chunks:
        return words
    per = -(-len(words) // max_chunks)  # ceiling division: never more than max_chunks pieces
    return ["".join(words[i : i + per]) for i in range(0, len(words), per)]


def _delta(delta: dict[str, Any]) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + _SEP
