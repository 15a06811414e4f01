"""Turn a ``CachedCompletion`` back into the response a client asked for.

JSON: the body the API sends (``chat.completion`` / ``text_completion`` as vLLM sends them,
a Responses ``response`` object, a Messages ``message``). SSE: the events the API streams,
in shape with a live stream relayed by the gateway:

    chat        role delta {"role": "assistant", "content": ""} first, then content deltas,
                tool-call deltas, finish_reason on the last choice event
    completion  text chunks, finish_reason on the last one
    both        a usage-only event (``choices: []``) only if the client asked for
                ``stream_options.include_usage``, then ``data: [DONE]``
    responses   typed events numbered by ``sequence_number`` from 0: response.created,
                response.in_progress; per output item response.output_item.added, for a
                message response.content_part.added, response.output_text.delta...,
                response.output_text.done, response.content_part.done, for a function call
                response.function_call_arguments.delta..., .done; response.output_item.done;
                then response.completed (vLLM's last event, whatever the status) with the
                whole response, usage included
    messages    message_start (input tokens), per block content_block_start,
                content_block_delta (text_delta, or input_json_delta for a tool's input),
                content_block_stop; message_delta (stop_reason, output tokens), message_stop

Each replay gets a fresh ``id`` and ``created`` from the caller (time and randomness are
passed in); a Responses item's id derives from the response's, so a replay is a function
of its arguments. ``usage`` is the cached answer's own, since that is what the client
receives. A Responses object echoes the request's settings (instructions, tools, sampling,
metadata...), as vLLM's does: they come from the request being answered (``request``), not
from the cache, whose key leaves some of them out. The text is cut at word boundaries into
at most ``MAX_CHUNKS`` events so a client's incremental rendering behaves as it does on a
live stream.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

import orjson

from cache.entry import CachedCompletion

# Enough events to look like a stream, few enough that a long answer stays cheap to send.
MAX_CHUNKS = 64
_WORDS = re.compile(r"\s*\S+|\s+")
_ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-", "responses": "resp_", "messages": "msg_"}
_SEP = b"\n\n"
DONE = b"data: [DONE]\n\n"
# vLLM's echo of Responses settings a request leaves out (ResponsesRequest's defaults).
_RESPONSES_DEFAULTS: dict[str, Any] = {
    "parallel_tool_calls": True,
    "temperature": 1.0,
    "tool_choice": "auto",
    "top_p": 1.0,
    "service_tier": "auto",
    "truncation": "disabled",
}


def new_completion_id(kind: str, entropy: bytes | None = None) -> str:
    """An id in the API's format: ``chatcmpl-<32 hex>`` / ``cmpl-<32 hex>`` as vLLM's,
    ``resp_<32 hex>``, ``msg_<32 hex>``."""
    return f"{_ID_PREFIX[kind]}{(entropy or os.urandom(16)).hex()}"


def replay_object(
    completion: CachedCompletion, *, completion_id: str, created: int, request: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The non-streamed response as the API's JSON object; ``request``: the body it answers."""
    if completion.kind == "responses":
        return _response(completion, completion_id, created, request or {}, completion.finish_reason)
    if completion.kind == "messages":
        return _message(completion, completion_id)
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
    return {
        "id": completion_id,
        "object": obj,
        "created": created,
        "model": completion.model,
        "choices": [choice],
        "usage": completion.usage,
    }


def replay_json(
    completion: CachedCompletion, *, completion_id: str, created: int, request: dict[str, Any] | None = None
) -> bytes:
    """The non-streamed response body."""
    return orjson.dumps(replay_object(completion, completion_id=completion_id, created=created, request=request))


def replay_events(
    completion: CachedCompletion,
    *,
    completion_id: str,
    created: int,
    include_usage: bool,
    request: dict[str, Any] | None = None,
) -> list[bytes]:
    """The SSE events of the streamed response (``[DONE]`` included where the API sends it),
    one bytes per event."""
    if completion.kind == "responses":
        return _response_events(completion, completion_id, created, request or {})
    if completion.kind == "messages":
        return _message_events(completion, completion_id)
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


def replay_sse(
    completion: CachedCompletion,
    *,
    completion_id: str,
    created: int,
    include_usage: bool,
    request: dict[str, Any] | None = None,
) -> bytes:
    """The whole streamed response body at once (a cached answer need not trickle)."""
    return b"".join(
        replay_events(
            completion, completion_id=completion_id, created=created, include_usage=include_usage, request=request
        )
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


def _typed_event(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + _SEP


# -- Responses --------------------------------------------------------------------------------


def _response(
    completion: CachedCompletion, response_id: str, created: int, request: dict[str, Any], status: str
) -> dict[str, Any]:
    """The response object, as vLLM's ``ResponsesResponse``: ``status`` "in_progress" (empty,
    as the stream's first events carry it) or the cached answer's own."""
    done = status != "in_progress"
    settings = {name: request.get(name, default) for name, default in _RESPONSES_DEFAULTS.items()}
    for name in ("temperature", "top_p"):  # floats in vLLM's model: 0 is echoed 0.0
        value = settings[name]
        if isinstance(value, int) and not isinstance(value, bool):
            settings[name] = float(value)
    return {
        "id": response_id,
        "created_at": created,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.get("instructions"),
        "metadata": request.get("metadata"),
        "model": completion.model,
        "object": "response",
        "output": _output(completion, response_id) if done else [],
        "parallel_tool_calls": settings["parallel_tool_calls"],
        "temperature": settings["temperature"],
        "tool_choice": settings["tool_choice"],
        "tools": request.get("tools") or [],
        "top_p": settings["top_p"],
        "background": False,
        "max_output_tokens": request.get("max_output_tokens"),
        "max_tool_calls": request.get("max_tool_calls"),
        # The turn the request continues, as OpenAI's answer names it (the gateway puts it
        # back in a live answer too: the replica, sent the expanded input, says null).
        "previous_response_id": request.get("previous_response_id"),
        "prompt": None,
        "reasoning": request.get("reasoning"),
        "service_tier": settings["service_tier"],
        "status": status,
        "text": request.get("text"),
        "top_logprobs": None,
        "truncation": settings["truncation"],
        "usage": _response_usage(completion) if done else None,
        "user": request.get("user"),
    }


def _response_usage(completion: CachedCompletion) -> dict[str, Any]:
    return {
        "input_tokens": completion.prompt_tokens,
        # cache_write_tokens: newer SDKs require it (vLLM leaves it out).
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": completion.total_tokens,
    }


def _output(completion: CachedCompletion, response_id: str) -> list[dict[str, Any]]:
    return [_output_item(completion, response_id, i, item, done=True) for i, item in enumerate(completion.output)]


def _output_item(
    completion: CachedCompletion, response_id: str, index: int, item: dict[str, Any], *, done: bool
) -> dict[str, Any]:
    """An output item as the response (``done``) or its ``output_item.added`` event shows it."""
    if item["type"] == "function_call":
        # vLLM marks a call the token limit cut short "incomplete".
        status = ("completed" if completion.finish_reason == "completed" else "incomplete") if done else "in_progress"
        return {
            "arguments": item["arguments"] if done else "",
            "call_id": item["call_id"],
            "name": item["name"],
            "type": "function_call",
            "id": _item_id("fc", response_id, index),
            "status": status,
        }
    text = item["text"]
    return {
        "id": _item_id("msg", response_id, index),
        "content": [_output_text(text, None)] if done and text else [],
        "role": "assistant",
        "status": "completed" if done else "in_progress",
        "type": "message",
    }


def _output_text(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def _item_id(prefix: str, response_id: str, index: int) -> str:
    """An output item's id, unique to its response: ``msg_<32 hex>`` / ``fc_<32 hex>``."""
    return f"{prefix}_{hashlib.sha256(f'{response_id}/{index}'.encode()).hexdigest()[:32]}"


def _response_events(
    completion: CachedCompletion, response_id: str, created: int, request: dict[str, Any]
) -> list[bytes]:
    events: list[bytes] = []

    def emit(kind: str, **fields: Any) -> None:
        # Fields in alphabetical order, as vLLM dumps the SDK's event models.
        payload = dict(sorted({**fields, "sequence_number": len(events), "type": kind}.items()))
        events.append(_typed_event(kind, payload))

    started = _response(completion, response_id, created, request, "in_progress")
    emit("response.created", response=started)
    emit("response.in_progress", response=started)
    for index, item in enumerate(completion.output):
        item_id = _item_id("fc" if item["type"] == "function_call" else "msg", response_id, index)
        emit(
            "response.output_item.added",
            item=_output_item(completion, response_id, index, item, done=False),
            output_index=index,
        )
        if item["type"] == "function_call":
            where: dict[str, Any] = {"item_id": item_id, "output_index": index}
            for piece in split_text(item["arguments"]):
                emit("response.function_call_arguments.delta", delta=piece, **where)
            emit("response.function_call_arguments.done", arguments=item["arguments"], name=item["name"], **where)
        elif item["text"]:
            where = {"item_id": item_id, "output_index": index, "content_index": 0}
            emit("response.content_part.added", part=_output_text("", []), **where)
            for piece in split_text(item["text"]):
                emit("response.output_text.delta", delta=piece, logprobs=[], **where)
            emit("response.output_text.done", text=item["text"], logprobs=[], **where)
            emit("response.content_part.done", part=_output_text(item["text"], None), **where)
        emit(
            "response.output_item.done",
            item=_output_item(completion, response_id, index, item, done=True),
            output_index=index,
        )
    emit("response.completed", response=_response(completion, response_id, created, request, completion.finish_reason))
    return events


# -- Messages ---------------------------------------------------------------------------------


def _message(completion: CachedCompletion, message_id: str) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": [dict(block) for block in completion.output],
        "model": completion.model,
        "stop_reason": completion.finish_reason,
        "stop_sequence": completion.stop_sequence,
        "usage": {"input_tokens": completion.prompt_tokens, "output_tokens": completion.completion_tokens},
    }


def _message_events(completion: CachedCompletion, message_id: str) -> list[bytes]:
    def event(kind: str, **fields: Any) -> bytes:
        return _typed_event(kind, {"type": kind, **fields})

    started = {
        **_message(completion, message_id),
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": completion.prompt_tokens, "output_tokens": 0},
    }
    events = [event("message_start", message=started)]
    for index, block in enumerate(completion.output):
        if block["type"] == "tool_use":
            opened = {**block, "input": {}}
            given = orjson.dumps(block["input"]).decode() if block["input"] else ""
            deltas = [{"type": "input_json_delta", "partial_json": p} for p in split_text(given)]
        else:
            opened = {**block, "text": ""}
            deltas = [{"type": "text_delta", "text": p} for p in split_text(block["text"])]
        events.append(event("content_block_start", index=index, content_block=opened))
        events.extend(event("content_block_delta", index=index, delta=d) for d in deltas)
        events.append(event("content_block_stop", index=index))
    usage = {"input_tokens": completion.prompt_tokens, "output_tokens": completion.completion_tokens}
    stop = {"stop_reason": completion.finish_reason, "stop_sequence": completion.stop_sequence}
    events.append(event("message_delta", delta=stop, usage=usage))
    events.append(event("message_stop"))
    return events
