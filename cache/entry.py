"""A cached answer: what is needed to replay one answer, in JSON or as a stream.

Only the answer is kept, not the upstream bytes: a streamed and a non-streamed request share
one entry, and the replay re-shapes it with a fresh id and timestamp (``cache.replay``).
What is kept, per kind:

    chat, completion   text, tool calls, reasoning text, finish reason, usage, model
    responses          the output items in order (an assistant message's text; a function
                       call's call_id, name and arguments), status, usage, model
    messages           the content blocks in order (text; tool_use with its id, name and
                       input), stop_reason and stop_sequence, usage, model

Only clean endings are kept: chat's ``stop``, ``length`` or ``tool_calls``; a Responses
status ``completed``, or ``incomplete`` because of ``max_output_tokens`` (chat's
``length``); a Messages ``end_turn``, ``max_tokens``, ``tool_use`` or ``stop_sequence``. An
``abort`` (vLLM's reason when a request was cancelled), a stream cut short, an error event,
several choices, a missing ``usage``, or an output this module does not know (reasoning
items, refusals, annotations, thinking blocks...) all yield ``None``: nothing to store. An
unknown shape costs a miss, never a replay that drops part of the answer.

Streamed answers are assembled by ``cache.collect``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from dialects.anthropic import anthropic_usage
from dialects.base import CacheKind
from dialects.responses import responses_usage

Kind = CacheKind

# Endings that describe a complete answer worth replaying (chat, completions).
CACHEABLE_FINISH = frozenset({"stop", "length", "tool_calls"})
# A Responses answer that finished, or that the client's max_output_tokens cut (chat's "length").
RESPONSES_STATUS = frozenset({"completed", "incomplete"})
INCOMPLETE_REASON = "max_output_tokens"
# Messages endings: Anthropic's stop_reason values of a finished answer (not "refusal" or "pause_turn").
MESSAGES_STOP = frozenset({"end_turn", "max_tokens", "tool_use", "stop_sequence"})
# Bumped when the stored layout changes; an entry of another layout reads as corrupt, i.e. a
# miss. Chat and completions entries keep layout 1, the one earlier gateways write and read
# (an upgrade keeps their entries); Responses and Messages entries, which carry ``output``,
# are layout 2, which earlier gateways read as a miss.
FORMAT_VERSION = 2
_LAYOUT: dict[str, int] = {"chat": 1, "completion": 1, "responses": FORMAT_VERSION, "messages": FORMAT_VERSION}
# The output items of each kind that has them: by ``type``, the fields kept and their types.
ITEM_FIELDS: dict[str, dict[str, dict[str, type]]] = {
    "responses": {
        "message": {"text": str},
        "function_call": {"call_id": str, "name": str, "arguments": str},
    },
    "messages": {
        "text": {"text": str},
        "tool_use": {"id": str, "name": str, "input": dict},
    },
}


class EntryCorrupt(ValueError):
    """Stored bytes that do not decode to a ``CachedCompletion`` (treated as a miss)."""


@dataclass(frozen=True, slots=True)
class CachedCompletion:
    """One complete answer, as kept in the cache.

    ``finish_reason`` is the API's own ending: chat's finish reason, the Responses
    ``status``, the Messages ``stop_reason``.
    """

    kind: Kind
    model: str
    content: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    tool_calls: tuple[dict[str, Any], ...] = ()
    # Reasoning models served by vLLM return their thinking separately.
    reasoning_content: str | None = None
    # Responses and Messages: the answer's items in order, each one of ``ITEM_FIELDS``
    # (their text lives here, ``content`` stays empty).
    output: tuple[dict[str, Any], ...] = ()
    # Messages: the stop sequence that ended the answer (``finish_reason`` "stop_sequence").
    stop_sequence: str | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.total_tokens,
            "completion_tokens": self.completion_tokens,
        }

    def to_bytes(self) -> bytes:
        layout = _LAYOUT[self.kind]
        fields: dict[str, Any] = {
            "v": layout,
            "kind": self.kind,
            "model": self.model,
            "content": self.content,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "tool_calls": list(self.tool_calls),
            "reasoning_content": self.reasoning_content,
        }
        if layout == FORMAT_VERSION:
            fields["output"] = list(self.output)
            fields["stop_sequence"] = self.stop_sequence
        return orjson.dumps(fields)

    @classmethod
    def from_bytes(cls, raw: bytes) -> CachedCompletion:
        try:
            data = orjson.loads(raw)
            kind = data["kind"]
            if kind not in _LAYOUT or data["v"] != _LAYOUT[kind]:
                raise EntryCorrupt("unknown entry format")
            reasoning = data["reasoning_content"]
            if not isinstance(data["tool_calls"], list) or not (reasoning is None or isinstance(reasoning, str)):
                raise EntryCorrupt("malformed entry")
            output: list[Any] = []
            stop_sequence = None
            if _LAYOUT[kind] == FORMAT_VERSION:
                output, stop_sequence = data["output"], data["stop_sequence"]
                if not isinstance(output, list) or not all(_item_ok(kind, item) for item in output):
                    raise EntryCorrupt("malformed output")
                if not (stop_sequence is None or isinstance(stop_sequence, str)):
                    raise EntryCorrupt("malformed entry")
            return cls(
                kind=kind,
                model=str(data["model"]),
                content=str(data["content"]),
                finish_reason=str(data["finish_reason"]),
                prompt_tokens=int(data["prompt_tokens"]),
                completion_tokens=int(data["completion_tokens"]),
                tool_calls=tuple(data["tool_calls"]),
                reasoning_content=reasoning,
                output=tuple(output),
                stop_sequence=stop_sequence,
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, EntryCorrupt):
                raise
            raise EntryCorrupt(f"cannot decode cache entry: {exc}") from exc


def from_json_response(kind: Kind, body: bytes) -> CachedCompletion | None:
    """The entry for a non-streamed 200 response ``body``; None if it is not worth keeping."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    if kind == "responses":
        return from_response_object(data)
    if kind == "messages":
        return _message_entry(data)
    choices = data.get("choices")
    usage = data.get("usage")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    finish = choice.get("finish_reason")
    counts = usage_counts(usage)
    if finish not in CACHEABLE_FINISH or counts is None or not isinstance(data.get("model"), str):
        return None
    if kind == "chat":
        message = choice.get("message")
        if not isinstance(message, dict):
            return None
        content = message.get("content") or ""
        calls = message.get("tool_calls") or []
        reasoning = message.get("reasoning_content")
    else:
        content, calls, reasoning = choice.get("text") or "", [], None
    if not isinstance(content, str) or not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        return None
    return CachedCompletion(
        kind=kind,
        model=data["model"],
        content=content,
        finish_reason=finish,
        prompt_tokens=counts[0],
        completion_tokens=counts[1],
        tool_calls=tuple(calls),
        reasoning_content=reasoning if isinstance(reasoning, str) else None,
    )


def from_response_object(response: Any) -> CachedCompletion | None:
    """The entry for a Responses answer (a JSON body, or a stream's final ``response``)."""
    if not isinstance(response, dict) or response.get("error") is not None:
        return None
    status, model, output = response.get("status"), response.get("model"), response.get("output")
    details = response.get("incomplete_details")
    if status == "incomplete" and not (isinstance(details, dict) and details.get("reason") == INCOMPLETE_REASON):
        return None
    usage = responses_usage(response.get("usage"))
    if status not in RESPONSES_STATUS or usage is None or not isinstance(model, str) or not isinstance(output, list):
        return None
    items = [_response_item(item) for item in output]
    kept = [item for item in items if item is not None]
    if len(kept) != len(items):
        return None
    return CachedCompletion(
        kind="responses",
        model=model,
        content="",
        finish_reason=status,
        prompt_tokens=usage["prompt_tokens"],
        completion_tokens=usage["completion_tokens"],
        output=tuple(kept),
    )


def _response_item(item: Any) -> dict[str, Any] | None:
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
    return kept if _item_ok("responses", kept) else None


def _message_entry(message: dict[str, Any]) -> CachedCompletion | None:
    """The entry for a whole Messages answer."""
    stop, model, content = message.get("stop_reason"), message.get("model"), message.get("content")
    counts = _messages_counts(message.get("usage"))
    if message.get("type") != "message" or stop not in MESSAGES_STOP or counts is None:
        return None
    if not isinstance(model, str) or not isinstance(content, list):
        return None
    blocks = [message_block(block) for block in content]
    kept = [block for block in blocks if block is not None]
    stop_sequence = message.get("stop_sequence")
    if len(kept) != len(blocks) or not (stop_sequence is None or isinstance(stop_sequence, str)):
        return None
    return CachedCompletion(
        kind="messages",
        model=model,
        content="",
        finish_reason=stop,
        prompt_tokens=counts[0],
        completion_tokens=counts[1],
        output=tuple(kept),
        stop_sequence=stop_sequence,
    )


def message_block(block: Any) -> dict[str, Any] | None:
    """A content block as kept: text (without citations), or a tool_use."""
    if not isinstance(block, dict):
        return None
    kind = block.get("type")
    if kind == "text" and not block.get("citations"):
        kept = {"type": kind, "text": block.get("text")}
    elif kind == "tool_use":
        kept = {"type": kind, "id": block.get("id"), "name": block.get("name"), "input": block.get("input")}
    else:
        return None
    return kept if _item_ok("messages", kept) else None


def _messages_counts(usage: Any) -> tuple[int, int] | None:
    """Prompt (input, cache reads and writes) and output tokens of a Messages ``usage``."""
    if not isinstance(usage, dict) or not isinstance(usage.get("input_tokens"), int):
        return None
    if not isinstance(usage.get("output_tokens"), int):
        return None
    counted = anthropic_usage(usage, None)
    assert counted is not None
    return counted["prompt_tokens"], counted["completion_tokens"]


def _item_ok(kind: str, item: Any) -> bool:
    """Whether ``item`` is an output item of ``kind`` as ``ITEM_FIELDS`` describes it."""
    if not isinstance(item, dict):
        return False
    named = item.get("type")
    fields = ITEM_FIELDS[kind].get(named) if isinstance(named, str) else None
    return fields is not None and all(isinstance(item.get(name), t) for name, t in fields.items())


def usage_counts(usage: Any) -> tuple[int, int] | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return prompt, completion
