"""The answers of OpenAI's Responses API: folded, replayed, keyed.

What an entry keeps: the output items in order (an assistant message's text; a function
call's call_id, name and arguments), the status, usage and model. Kept: status
``completed``, or ``incomplete`` because of ``max_output_tokens`` (chat's ``length``). A
reasoning item, a refusal, annotations (citations) or any other item would be lost in
replay: such an answer yields None.

A stream ends with ``response.completed``, whose ``response`` is the whole answer: the entry
is read from that object (the scanner's ``final``), exactly as from a JSON answer. A replay
streams typed events numbered by ``sequence_number`` from 0: response.created,
response.in_progress; per output item response.output_item.added, for a message
response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, for a function call response.function_call_arguments.delta...,
.done; response.output_item.done; then response.completed (vLLM's last event, whatever the
status) with the whole response, usage included.

A replayed response echoes the request's settings (instructions, tools, sampling,
metadata...), as vLLM's does: they come from the request being answered, not from the
cache, whose key leaves some of them out. An item's id derives from the response's, so a
replay is a function of its arguments.
"""

from __future__ import annotations

import hashlib
from typing import Any

from dialects.answer import Answers, CachedCompletion, StreamCollector, split_text, typed_event

# A Responses answer that finished, or that the client's max_output_tokens cut (chat's "length").
RESPONSES_STATUS = frozenset({"completed", "incomplete"})
INCOMPLETE_REASON = "max_output_tokens"
# The ``include`` value that asks for the text's log-probabilities.
RESPONSES_LOGPROBS = "message.output_text.logprobs"
# vLLM's echo of Responses settings a request leaves out (ResponsesRequest's defaults).
_RESPONSES_DEFAULTS: dict[str, Any] = {
    "parallel_tool_calls": True,
    "temperature": 1.0,
    "tool_choice": "auto",
    "top_p": 1.0,
    "service_tier": "auto",
    "truncation": "disabled",
}


class ResponsesAnswers(Answers):
    """Responses answers; ids ``resp_<32 hex>``."""

    # The gateway has already expanded it into ``input`` (``gateway.responses_state``),
    # which the key covers whole.
    key_excluded = frozenset({"previous_response_id"})

    def collector(self, max_chars: int) -> StreamCollector:
        return ResponsesCollector(self, max_chars=max_chars)

    def from_object(self, data: dict[str, Any]) -> CachedCompletion | None:
        return self.from_response(data)

    def from_response(self, response: Any) -> CachedCompletion | None:
        """The entry for a Responses answer (a JSON body, or a stream's final ``response``)."""
        if not isinstance(response, dict) or response.get("error") is not None:
            return None
        status, model, output = response.get("status"), response.get("model"), response.get("output")
        details = response.get("incomplete_details")
        if status == "incomplete" and not (isinstance(details, dict) and details.get("reason") == INCOMPLETE_REASON):
            return None
        usage = responses_usage(response.get("usage"))
        if (
            status not in RESPONSES_STATUS
            or usage is None
            or not isinstance(model, str)
            or not isinstance(output, list)
        ):
            return None
        items = [self._item(item) for item in output]
        kept = [item for item in items if item is not None]
        if len(kept) != len(items):
            return None
        return CachedCompletion(
            kind=self.kind,
            model=model,
            content="",
            finish_reason=status,
            prompt_tokens=usage["prompt_tokens"],
            completion_tokens=usage["completion_tokens"],
            output=tuple(kept),
        )

    def _item(self, item: Any) -> dict[str, Any] | None:
        """An output item as kept: an assistant message's one text part, or a function call."""
        if not isinstance(item, dict):
            return None
        kind = item.get("type")
        if kind == "function_call":
            kept = {
                "type": kind,
                "call_id": item.get("call_id"),
                "name": item.get("name"),
                "arguments": item.get("arguments"),
            }
        elif kind == "message" and item.get("role") == "assistant":
            parts = item.get("content")
            if not isinstance(parts, list) or len(parts) > 1:
                return None
            text: Any = ""
            if parts:
                part = parts[0]
                # A refusal, or annotations (citations), would be lost in replay: not kept.
                if not isinstance(part, dict) or part.get("type") != "output_text" or part.get("annotations"):
                    return None
                text = part.get("text")
            kept = {"type": kind, "text": text}
        else:
            return None
        return kept if self.item_ok(kept) else None

    def replay_object(
        self, entry: CachedCompletion, *, completion_id: str, created: int, request: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return _response(entry, completion_id, created, request or {}, entry.finish_reason)

    def replay_events(
        self,
        entry: CachedCompletion,
        *,
        completion_id: str,
        created: int,
        include_usage: bool,
        request: dict[str, Any] | None = None,
    ) -> list[bytes]:
        response_id, request = completion_id, request or {}
        events: list[bytes] = []

        def emit(kind: str, **fields: Any) -> None:
            # Fields in alphabetical order, as vLLM dumps the SDK's event models.
            payload = dict(sorted({**fields, "sequence_number": len(events), "type": kind}.items()))
            events.append(typed_event(kind, payload))

        started = _response(entry, response_id, created, request, "in_progress")
        emit("response.created", response=started)
        emit("response.in_progress", response=started)
        for index, item in enumerate(entry.output):
            item_id = _item_id("fc" if item["type"] == "function_call" else "msg", response_id, index)
            emit(
                "response.output_item.added",
                item=_output_item(entry, response_id, index, item, done=False),
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
                item=_output_item(entry, response_id, index, item, done=True),
                output_index=index,
            )
        emit("response.completed", response=_response(entry, response_id, created, request, entry.finish_reason))
        return events

    def wants_logprobs(self, body: dict[str, Any]) -> bool:
        """vLLM's fields, or ``include`` asking for the text's log-probabilities."""
        if super().wants_logprobs(body):
            return True
        include = body.get("include")
        return isinstance(include, list) and RESPONSES_LOGPROBS in include


class ResponsesCollector(StreamCollector):
    """A Responses stream: its last event (``response.completed``) carries the whole answer,
    which the scanner keeps as ``final``; nothing is assembled from the deltas."""

    __slots__ = ("_answers",)

    def __init__(self, answers: ResponsesAnswers, *, max_chars: int) -> None:
        super().__init__(max_chars=max_chars)
        self._answers = answers

    def feed(self, block: bytes) -> None:
        return

    def result(
        self, usage: dict[str, Any] | None = None, final: dict[str, Any] | None = None
    ) -> CachedCompletion | None:
        return None if self._failed else self._answers.from_response(final)


def responses_usage(usage: Any) -> dict[str, int] | None:
    """A Responses ``usage`` as ``prompt_tokens``/``completion_tokens``/``total_tokens``."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("input_tokens"), usage.get("output_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    total = usage.get("total_tokens")
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": total if isinstance(total, int) else prompt + completion,
    }


def _response(
    entry: CachedCompletion, response_id: str, created: int, request: dict[str, Any], status: str
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
        "model": entry.model,
        "object": "response",
        "output": _output(entry, response_id) if done else [],
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
        "usage": _response_usage(entry) if done else None,
        "user": request.get("user"),
    }


def _response_usage(entry: CachedCompletion) -> dict[str, Any]:
    return {
        "input_tokens": entry.prompt_tokens,
        # cache_write_tokens: newer SDKs require it (vLLM leaves it out).
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": entry.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": entry.total_tokens,
    }


def _output(entry: CachedCompletion, response_id: str) -> list[dict[str, Any]]:
    return [_output_item(entry, response_id, i, item, done=True) for i, item in enumerate(entry.output)]


def _output_item(
    entry: CachedCompletion, response_id: str, index: int, item: dict[str, Any], *, done: bool
) -> dict[str, Any]:
    """An output item as the response (``done``) or its ``output_item.added`` event shows it."""
    if item["type"] == "function_call":
        # vLLM marks a call the token limit cut short "incomplete".
        status = ("completed" if entry.finish_reason == "completed" else "incomplete") if done else "in_progress"
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


RESPONSES_ANSWERS = ResponsesAnswers(
    "responses",
    "resp_",
    items={
        "message": {"text": str},
        "function_call": {"call_id": str, "name": str, "arguments": str},
    },
)
