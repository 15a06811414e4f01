"""Assemble a ``CachedCompletion`` from a stream, one collector per kind of answer.

A chat or completions stream is read choice delta by choice delta. A Responses stream ends
with ``response.completed``, whose ``response`` is the whole answer: its entry is read from
that object (the scanner's ``final``), exactly as from a JSON answer. A Messages stream
carries no whole answer, so its blocks are assembled from the ``content_block_*`` events.
"""

from __future__ import annotations

from typing import Any

import orjson

from cache.entry import (
    CACHEABLE_FINISH,
    MESSAGES_STOP,
    CachedCompletion,
    Kind,
    from_response_object,
    message_block,
    usage_counts,
)
from dialects.anthropic import anthropic_usage

_SEP = b"\n\n"
_DATA = b"data:"
_DONE = b"[DONE]"


def stream_collector(kind: Kind, *, max_chars: int) -> StreamCollector:
    """The collector for a stream of ``kind``'s answers (``StreamCollector``)."""
    if kind == "responses":
        return ResponsesCollector(max_chars=max_chars)
    if kind == "messages":
        return MessagesCollector(max_chars=max_chars)
    return ChoicesCollector(kind, max_chars=max_chars)


class StreamCollector:
    """Assembles a ``CachedCompletion`` from the complete SSE event blocks of a stream.

    Feed it each block the dialect's scanner returns (whole events only); ``result`` then
    takes what the scanner learned: its ``usage`` (a chat stream's usage event is removed
    from the blocks when the client did not ask for it) and its ``final`` answer (a
    Responses stream's). Content past ``max_chars`` stops collection: the answer would be
    too large to store anyway, and the collector should not hold it. Each subclass reads one
    API's events (``_take``).
    """

    __slots__ = ("_chars", "_failed", "_max_chars")

    def __init__(self, *, max_chars: int) -> None:
        self._max_chars = max_chars
        self._chars = 0
        # Gave up: an error event, an overflow, a shape this collector does not know.
        self._failed = False

    @property
    def failed(self) -> bool:
        return self._failed

    def feed(self, block: bytes) -> None:
        """Take whole events (their ``data``; comments and ``[DONE]`` ignored)."""
        if self._failed or _DATA not in block:
            return
        for event in block.split(_SEP):
            payload = _payload(event)
            if payload is None or payload == _DONE:
                continue
            try:
                data = orjson.loads(payload)
            except orjson.JSONDecodeError:
                self._failed = True
                return
            if not isinstance(data, dict) or "error" in data or not self._take(data) or self._chars > self._max_chars:
                self._failed = True
                return

    def _take(self, data: dict[str, Any]) -> bool:
        """Read one event's data; False on a shape that cannot be kept."""
        raise NotImplementedError

    def result(
        self, usage: dict[str, Any] | None = None, final: dict[str, Any] | None = None
    ) -> CachedCompletion | None:
        """The whole answer once the stream ended cleanly; None if it is not worth keeping."""
        raise NotImplementedError


class ChoicesCollector(StreamCollector):
    """OpenAI's chat and completions chunks: choice deltas, tool-call deltas by index, a usage chunk."""

    __slots__ = ("_calls", "_content", "_finish", "_kind", "_model", "_reasoning", "_usage")

    def __init__(self, kind: Kind, *, max_chars: int) -> None:
        super().__init__(max_chars=max_chars)
        self._kind = kind
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._model: str | None = None
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None

    def _take(self, data: dict[str, Any]) -> bool:
        if isinstance(data.get("model"), str):
            self._model = data["model"]
        usage = data.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        choices = data.get("choices") or []
        if not isinstance(choices, list):
            return False
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                return False
            if self._kind == "chat":
                delta = choice.get("delta") or {}
                if not isinstance(delta, dict) or not self._add_calls(delta.get("tool_calls")):
                    return False
                text = delta.get("content")
                reasoning = delta.get("reasoning_content")
                if isinstance(reasoning, str):
                    self._reasoning.append(reasoning)
                    self._chars += len(reasoning)
            else:
                text = choice.get("text")
            if isinstance(text, str) and text:
                self._content.append(text)
                self._chars += len(text)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
        return True

    def _add_calls(self, deltas: Any) -> bool:
        """Merge tool-call deltas; False on a shape that cannot be a tool call."""
        # They arrive by index: id, type and name once, the arguments in pieces.
        if deltas is None:
            return True
        if not isinstance(deltas, list):
            return False
        for delta in deltas:
            if not isinstance(delta, dict):
                return False
            index, function = delta.get("index", 0), delta.get("function") or {}
            if not isinstance(index, int) or not isinstance(function, dict):
                return False
            call = self._calls.setdefault(index, {"function": {"arguments": ""}})
            for name in ("id", "type"):
                if delta.get(name) is not None:
                    call[name] = delta[name]
            if function.get("name") is not None:
                call["function"]["name"] = function["name"]
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                call["function"]["arguments"] += arguments
                self._chars += len(arguments)
        return True

    def result(
        self, usage: dict[str, Any] | None = None, final: dict[str, Any] | None = None
    ) -> CachedCompletion | None:
        if self._failed:
            return None
        counts = usage_counts(self._usage or usage)
        if counts is None or self._finish not in CACHEABLE_FINISH or self._model is None:
            return None
        calls = tuple(self._calls[i] for i in sorted(self._calls))
        return CachedCompletion(
            kind=self._kind,
            model=self._model,
            content="".join(self._content),
            finish_reason=self._finish,
            prompt_tokens=counts[0],
            completion_tokens=counts[1],
            tool_calls=calls,
            reasoning_content="".join(self._reasoning) if self._reasoning else None,
        )


class ResponsesCollector(StreamCollector):
    """A Responses stream: its last event (``response.completed``) carries the whole answer,
    which the scanner keeps as ``final``; nothing is assembled from the deltas."""

    __slots__ = ()

    def feed(self, block: bytes) -> None:
        return

    def result(
        self, usage: dict[str, Any] | None = None, final: dict[str, Any] | None = None
    ) -> CachedCompletion | None:
        return None if self._failed else from_response_object(final)


class MessagesCollector(StreamCollector):
    """Anthropic's Messages events: ``message_start`` (model, input tokens), per block
    ``content_block_start`` then ``content_block_delta`` (``text_delta``, or a tool's
    ``input_json_delta`` pieces) and ``content_block_stop``, ``message_delta`` (stop_reason,
    output tokens), ``message_stop``."""

    __slots__ = ("_blocks", "_model", "_pieces", "_stop", "_stop_sequence", "_stopped", "_usage")

    def __init__(self, *, max_chars: int) -> None:
        super().__init__(max_chars=max_chars)
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
            block = message_block(data.get("content_block"))
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
            kind="messages",
            model=self._model,
            content="",
            finish_reason=self._stop,
            prompt_tokens=self._usage["prompt_tokens"],
            completion_tokens=self._usage["completion_tokens"],
            output=tuple(blocks),
            stop_sequence=stop_sequence,
        )


def _payload(event: bytes) -> bytes | None:
    """An event's data: its ``data:`` lines joined by newlines, as SSE says; None if it has none."""
    if _DATA not in event:
        return None
    lines = [line[len(_DATA) :] for line in event.split(b"\n") if line.startswith(_DATA)]
    return b"\n".join(lines).strip() if lines else None
