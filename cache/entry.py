"""A cached answer: what is needed to replay one completion, in JSON or as a stream.

Only the answer is kept (text, tool calls, finish reason, usage, the model that produced
it), not the upstream bytes: a streamed and a non-streamed request share one entry, and the
replay re-shapes it with a fresh id and timestamp (``cache.replay``).

Only clean endings are kept: ``finish_reason`` of ``stop``, ``length`` or ``tool_calls``.
An ``abort`` (vLLM's reason when a request was cancelled), a stream cut short, an error
event, several choices or a missing ``usage`` all yield ``None``: nothing to store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from dialects.base import CacheKind

Kind = CacheKind

# Endings that describe a complete answer worth replaying.
CACHEABLE_FINISH = frozenset({"stop", "length", "tool_calls"})
# Bumped when the stored layout changes; older entries read as corrupt, i.e. a miss.
FORMAT_VERSION = 1

_SEP = b"\n\n"
_DATA = b"data:"
_DONE = b"[DONE]"


class EntryCorrupt(ValueError):
    """Stored bytes that do not decode to a ``CachedCompletion`` (treated as a miss)."""


@dataclass(frozen=True, slots=True)
class CachedCompletion:
    """One complete answer, as kept in the cache."""

    kind: Kind
    model: str
    content: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    tool_calls: tuple[dict[str, Any], ...] = ()
    # Reasoning models served by vLLM return their thinking separately.
    reasoning_content: str | None = None

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
        return orjson.dumps(
            {
                "v": FORMAT_VERSION,
                "kind": self.kind,
                "model": self.model,
                "content": self.content,
                "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "tool_calls": list(self.tool_calls),
                "reasoning_content": self.reasoning_content,
            }
        )

    @classmethod
    def from_bytes(cls, raw: bytes) -> CachedCompletion:
        try:
            data = orjson.loads(raw)
            if data["v"] != FORMAT_VERSION or data["kind"] not in ("chat", "completion"):
                raise EntryCorrupt("unknown entry format")
            reasoning = data["reasoning_content"]
            if not isinstance(data["tool_calls"], list) or not (reasoning is None or isinstance(reasoning, str)):
                raise EntryCorrupt("malformed entry")
            return cls(
                kind=data["kind"],
                model=str(data["model"]),
                content=str(data["content"]),
                finish_reason=str(data["finish_reason"]),
                prompt_tokens=int(data["prompt_tokens"]),
                completion_tokens=int(data["completion_tokens"]),
                tool_calls=tuple(data["tool_calls"]),
                reasoning_content=reasoning,
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
    choices = data.get("choices")
    usage = data.get("usage")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    finish = choice.get("finish_reason")
    counts = _usage_counts(usage)
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


class StreamCollector:
    """Assembles a ``CachedCompletion`` from the complete SSE event blocks of a stream.

    Feed it each block ``SseScanner.feed`` returns (whole events only). That block has had
    the usage event removed when the client did not ask for usage, so ``result`` takes the
    scanner's ``usage`` as a fallback. Content past ``max_chars`` stops collection: the
    answer would be too large to store anyway, and the collector should not hold it.
    """

    __slots__ = ("_calls", "_chars", "_content", "_finish", "_kind", "_max_chars", "_model", "_reasoning", "_usage")

    def __init__(self, kind: Kind, *, max_chars: int) -> None:
        self._kind = kind
        self._max_chars = max_chars
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._chars = 0
        self._model: str | None = None
        self._finish: str | None = None
        # None: still collecting; False: gave up (error, overflow, odd shape).
        self._usage: dict[str, Any] | Literal[False] | None = None

    @property
    def failed(self) -> bool:
        return self._usage is False

    def feed(self, block: bytes) -> None:
        """Take whole events (``data: {...}\\n\\n``, comments and ``[DONE]`` ignored)."""
        if self._usage is False or _DATA not in block:
            return
        for event in block.split(_SEP):
            start = event.find(_DATA)
            if start == -1:
                continue
            payload = event[start + len(_DATA) :].strip()
            if payload == _DONE:
                continue
            try:
                data = orjson.loads(payload)
            except orjson.JSONDecodeError:
                self._usage = False
                return
            if not isinstance(data, dict) or not self._take(data):
                self._usage = False
                return

    def _take(self, data: dict[str, Any]) -> bool:
        if "error" in data:
            return False
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
        return self._chars <= self._max_chars

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

    def result(self, usage: dict[str, Any] | None = None) -> CachedCompletion | None:
        """The whole answer once the stream ended cleanly; None if it is not worth keeping."""
        if self._usage is False:
            return None
        counts = _usage_counts(self._usage or usage)
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


def _usage_counts(usage: Any) -> tuple[int, int] | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return prompt, completion
