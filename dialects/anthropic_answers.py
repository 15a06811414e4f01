"""The answers of Anthropic's Messages API: folded, replayed, keyed.

What an entry keeps: the content blocks in order (text; tool_use with its id, name and
input), stop_reason and stop_sequence, usage and model. Kept: a ``stop_reason`` of
``end_turn``, ``max_tokens``, ``tool_use`` or ``stop_sequence`` (not ``refusal`` or
``pause_turn``). Citations or a thinking block would be lost in replay: such an answer
yields None.

A stream carries no whole answer, so its blocks are assembled from its events, and a replay
sends the same sequence: ``message_start`` (model, input tokens), per block
``content_block_start``, ``content_block_delta`` (``text_delta``, or a tool's
``input_json_delta`` pieces), ``content_block_stop``; ``message_delta`` (stop_reason,
output tokens), ``message_stop``. Anthropic's API takes no ``seed``.
"""

from __future__ import annotations

from typing import Any

import orjson

from dialects.answer import Answers, CachedCompletion, StreamCollector, split_text, typed_event

# Anthropic's stop_reason values of a finished answer.
MESSAGES_STOP = frozenset({"end_turn", "max_tokens", "tool_use", "stop_sequence"})


class MessagesAnswers(Answers):
    """Messages answers; ids ``msg_<32 hex>``."""

    takes_seed = False

    def collector(self, max_chars: int) -> StreamCollector:
        return MessagesCollector(self, max_chars=max_chars)

    def from_object(self, data: dict[str, Any]) -> CachedCompletion | None:
        stop, model, content = data.get("stop_reason"), data.get("model"), data.get("content")
        counts = _counts(data.get("usage"))
        if data.get("type") != "message" or stop not in MESSAGES_STOP or counts is None:
            return None
        if not isinstance(model, str) or not isinstance(content, list):
            return None
        blocks = [self.block(block) for block in content]
        kept = [block for block in blocks if block is not None]
        stop_sequence = data.get("stop_sequence")
        if len(kept) != len(blocks) or not (stop_sequence is None or isinstance(stop_sequence, str)):
            return None
        return CachedCompletion(
            kind=self.kind,
            model=model,
            content="",
            finish_reason=stop,
            prompt_tokens=counts[0],
            completion_tokens=counts[1],
            output=tuple(kept),
            stop_sequence=stop_sequence,
        )

    def block(self, block: Any) -> dict[str, Any] | None:
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
        return kept if self.item_ok(kept) else None

    def replay_object(
        self, entry: CachedCompletion, *, completion_id: str, created: int, request: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {
            "id": completion_id,
            "type": "message",
            "role": "assistant",
            "content": [dict(block) for block in entry.output],
            "model": entry.model,
            "stop_reason": entry.finish_reason,
            "stop_sequence": entry.stop_sequence,
            "usage": {"input_tokens": entry.prompt_tokens, "output_tokens": entry.completion_tokens},
        }

    def replay_events(
        self,
        entry: CachedCompletion,
        *,
        completion_id: str,
        created: int,
        include_usage: bool,
        request: dict[str, Any] | None = None,
    ) -> list[bytes]:
        def event(kind: str, **fields: Any) -> bytes:
            return typed_event(kind, {"type": kind, **fields})

        started = {
            **self.replay_object(entry, completion_id=completion_id, created=created),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": entry.prompt_tokens, "output_tokens": 0},
        }
        events = [event("message_start", message=started)]
        for index, block in enumerate(entry.output):
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
        usage = {"input_tokens": entry.prompt_tokens, "output_tokens": entry.completion_tokens}
        stop = {"stop_reason": entry.finish_reason, "stop_sequence": entry.stop_sequence}
        events.append(event("message_delta", delta=stop, usage=usage))
        events.append(event("message_stop"))
        return events


class MessagesCollector(StreamCollector):
    """Anthropic's Messages events, assembled into the answer's blocks (see the module docstring)."""

    __slots__ = ("_answers", "_blocks", "_model", "_pieces", "_stop", "_stop_sequence", "_stopped", "_usage")

    def __init__(self, answers: MessagesAnswers, *, max_chars: int) -> None:
        super().__init__(max_chars=max_chars)
        self._answers = answers
        self._blocks: list[dict[str, Any]] = []
        self._pieces: list[list[str]] = []
        self._model: str | None = None
        self._usage: dict[str, int] | None = None
        self._stop: Any = None
        self._stop_sequence: Any = None
        self._stopped = False

    def _take(self, data: dict[str, Any]) -> bool:
        kind = data.get("type")
        if kind == "message_start":
            return self._start(data.get("message"))
        if kind == "content_block_start":
            block = self._answers.block(data.get("content_block"))
            if block is None or data.get("index") != len(self._blocks):
                return False
            self._blocks.append(block)
            self._pieces.append([])
            return True
        if kind == "content_block_delta":
            return self._delta(data.get("index"), data.get("delta"))
        if kind == "message_delta":
            delta, usage = data.get("delta"), data.get("usage")
            if not isinstance(delta, dict) or not isinstance(usage, dict) or self._usage is None:
                return False
            if not isinstance(usage.get("output_tokens"), int):
                return False
            self._stop, self._stop_sequence = delta.get("stop_reason"), delta.get("stop_sequence")
            self._usage = anthropic_usage(usage, self._usage)
            return True
        if kind == "message_stop":
            self._stopped = True
        return kind in ("content_block_stop", "message_stop", "ping")

    def _start(self, message: Any) -> bool:
        if not isinstance(message, dict) or not isinstance(message.get("model"), str):
            return False
        usage = message.get("usage")
        if not isinstance(usage, dict) or not isinstance(usage.get("input_tokens"), int):
            return False
        self._model = message["model"]
        self._usage = anthropic_usage(usage, None)
        return True

    def _delta(self, index: Any, delta: Any) -> bool:
        if not isinstance(index, int) or not 0 <= index < len(self._blocks) or not isinstance(delta, dict):
            return False
        block, kind = self._blocks[index], delta.get("type")
        if block["type"] == "text" and kind == "text_delta":
            piece = delta.get("text")
        elif block["type"] == "tool_use" and kind == "input_json_delta":
            piece = delta.get("partial_json")
        else:
            return False  # thinking, citations or signatures: not kept
        if not isinstance(piece, str):
            return False
        self._pieces[index].append(piece)
        self._chars += len(piece)
        return True

    def result(
        self, usage: dict[str, Any] | None = None, final: dict[str, Any] | None = None
    ) -> CachedCompletion | None:
        if self._failed or not self._stopped or self._stop not in MESSAGES_STOP:
            return None
        if self._model is None or self._usage is None:
            return None
        blocks: list[dict[str, Any]] = []
        for block, pieces in zip(self._blocks, self._pieces, strict=True):
            if block["type"] == "text":
                blocks.append({**block, "text": block["text"] + "".join(pieces)})
                continue
            if pieces:
                # The tool's input arrives as pieces of one JSON object.
                try:
                    given = orjson.loads("".join(pieces))
                except orjson.JSONDecodeError:
                    return None
                if not isinstance(given, dict):
                    return None
                block = {**block, "input": given}
            blocks.append(block)
        stop_sequence = self._stop_sequence if isinstance(self._stop_sequence, str) else None
        return CachedCompletion(
            kind=self._answers.kind,
            model=self._model,
            content="",
            finish_reason=self._stop,
            prompt_tokens=self._usage["prompt_tokens"],
            completion_tokens=self._usage["completion_tokens"],
            output=tuple(blocks),
            stop_sequence=stop_sequence,
        )


def anthropic_usage(usage: Any, before: dict[str, int] | None) -> dict[str, int] | None:
    """Anthropic's ``usage`` (input tokens, cache reads and writes among them, and output
    tokens) as ``prompt_tokens``/``completion_tokens``/``total_tokens``; a ``message_delta``'s
    counts replace those ``before`` them, fields it leaves out keep their value."""
    if not isinstance(usage, dict):
        return before
    prompt = before["prompt_tokens"] if before else 0
    counted = [usage.get(f) for f in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")]
    if any(isinstance(c, int) for c in counted):
        prompt = sum(c for c in counted if isinstance(c, int))
    completion = usage.get("output_tokens")
    if not isinstance(completion, int):
        completion = before["completion_tokens"] if before else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _counts(usage: Any) -> tuple[int, int] | None:
    """Prompt (input, cache reads and writes) and output tokens of a whole answer's ``usage``."""
    if not isinstance(usage, dict) or not isinstance(usage.get("input_tokens"), int):
        return None
    if not isinstance(usage.get("output_tokens"), int):
        return None
    counted = anthropic_usage(usage, None)
    assert counted is not None
    return counted["prompt_tokens"], counted["completion_tokens"]


MESSAGES_ANSWERS = MessagesAnswers(
    "messages",
    "msg_",
    items={
        "text": {"text": str},
        "tool_use": {"id": str, "name": str, "input": dict},
    },
)
