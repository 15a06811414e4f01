"""An answer as the cache keeps it, and ``Answers``: what one API does with its answers.

The cache stores and finds entries and knows no API; every API's answer shape lives with
its dialect. A dialect whose answers may be cached names an ``Answers`` (``Dialect.answers``)
that owns an answer's whole life:

    fold      ``collector(max_chars)`` assembles an entry from a stream's events (fed the
              blocks of whole events its scanner returns), ``from_json(body)`` from a whole
              answer; both yield None for an answer not worth keeping
    replay    ``replay_object`` / ``replay_events`` turn an entry back into the API's JSON
              or SSE events, under ``new_id()`` (a fresh id in the API's format)
    key       ``key_excluded``, ``takes_seed``, ``several_prompts``, ``wants_logprobs``:
              what the cache's key and cacheability rules ask of the API (``cache.keys``)

Only the answer is kept, not the upstream bytes: a streamed and a non-streamed request share
one entry, and the replay re-shapes it with a fresh id and timestamp. Only clean endings are
kept; an ending or an output the API's fold does not know yields None, so an unknown shape
costs a miss, never a replay that drops part of the answer.

An entry is stored as JSON (``CachedCompletion.to_bytes``). Its ``kind`` names the
``Answers`` that made it, whose ``layout`` says which fields are stored and whose ``items``
which output items an entry may hold; ``from_bytes`` checks both, so bytes of another
layout or an unknown kind read as corrupt (a miss). Each ``Answers`` registers its kind
when it is created (its dialect's module is imported), as a codec registers its name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

# Bumped when the stored layout changes; an entry of another layout reads as corrupt, i.e. a
# miss. Layout 1 (no ``output``, no ``stop_sequence``) is the one earlier gateways write and
# read; the kinds that stored it keep it, so an upgrade keeps their entries. Kinds with output
# items use layout 2, which earlier gateways read as a miss.
FORMAT_VERSION = 2
# Enough events to look like a stream, few enough that a long answer stays cheap to send.
MAX_CHUNKS = 64
_WORDS = re.compile(r"\s*\S+|\s+")
_SEP = b"\n\n"
_DATA = b"data:"
# Every kind of answer an ``Answers`` was created for, by its name (see the module docstring).
_KINDS: dict[str, Answers] = {}


class EntryCorrupt(ValueError):
    """Stored bytes that do not decode to a ``CachedCompletion`` (treated as a miss)."""


@dataclass(frozen=True, slots=True)
class CachedCompletion:
    """One complete answer, as kept in the cache.

    ``kind`` names the ``Answers`` that folded it (and replays it). ``finish_reason`` is the
    API's own ending (chat's finish reason, the Responses ``status``, the Messages
    ``stop_reason``).
    """

    kind: str
    model: str
    content: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    tool_calls: tuple[dict[str, Any], ...] = ()
    # Reasoning models served by vLLM return their thinking separately.
    reasoning_content: str | None = None
    # The answer's items in order, for kinds that keep them, each one of the kind's ``items``
    # (their text lives here, ``content`` stays empty).
    output: tuple[dict[str, Any], ...] = ()
    # The stop sequence that ended the answer, where the API reports it.
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
        layout = _KINDS[self.kind].layout
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
            answers = _KINDS.get(data["kind"])
            if answers is None or data["v"] != answers.layout:
                raise EntryCorrupt("unknown entry format")
            reasoning = data["reasoning_content"]
            if not isinstance(data["tool_calls"], list) or not (reasoning is None or isinstance(reasoning, str)):
                raise EntryCorrupt("malformed entry")
            output: list[Any] = []
            stop_sequence = None
            if answers.layout == FORMAT_VERSION:
                output, stop_sequence = data["output"], data["stop_sequence"]
                if not isinstance(output, list) or not all(answers.item_ok(item) for item in output):
                    raise EntryCorrupt("malformed output")
                if not (stop_sequence is None or isinstance(stop_sequence, str)):
                    raise EntryCorrupt("malformed entry")
            return cls(
                kind=answers.kind,
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


class StreamCollector:
    """Assembles a ``CachedCompletion`` from the complete SSE event blocks of a stream.

    Feed it each block the dialect's scanner returns (whole events only); ``result`` then
    takes what the scanner learned: its ``usage`` and its ``final`` answer (where the API's
    last event carries the whole answer). Content past ``max_chars`` stops collection: the
    answer would be too large to store anyway, and the collector should not hold it. Each
    API's subclass reads its events (``_take``) and names the data that ends a stream
    without being an event of the answer (``END``), if any.
    """

    __slots__ = ("_chars", "_failed", "_max_chars")

    # An event's data that is the stream's end mark, not JSON (skipped).
    END: ClassVar[bytes] = b""

    def __init__(self, *, max_chars: int) -> None:
        self._max_chars = max_chars
        self._chars = 0
        # Gave up: an error event, an overflow, a shape this collector does not know.
        self._failed = False

    @property
    def failed(self) -> bool:
        return self._failed

    def feed(self, block: bytes) -> None:
        """Take whole events (their ``data``; comments and the end mark ignored)."""
        if self._failed or _DATA not in block:
            return
        end = self.END
        for event in block.split(_SEP):
            payload = _payload(event)
            if payload is None or payload == end:
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


class Answers:
    """What one API does with its answers: fold, replay, and the cache-key rules it needs.

    ``kind`` names its entries (stored in their bytes: a kind keeps its name for good),
    ``layout`` their stored layout (``FORMAT_VERSION`` for a new kind), ``items`` the output
    items an entry may hold (by ``type``: the fields kept and their types), ``id_prefix``
    the API's answer ids. Creating one registers its kind (``CachedCompletion.from_bytes``
    reads entries of registered kinds only); a kind is registered once.
    """

    # Left out of the key besides the cache's own ``NOT_IN_KEY`` (fields the gateway has
    # already folded into others, say).
    key_excluded: frozenset[str] = frozenset()
    # Whether the API takes a ``seed`` that fixes sampling (a seeded request is deterministic).
    takes_seed: bool = True

    def __init__(
        self,
        kind: str,
        id_prefix: str,
        *,
        layout: int = FORMAT_VERSION,
        items: Mapping[str, Mapping[str, type]] | None = None,
    ) -> None:
        self.kind = kind
        self.id_prefix = id_prefix
        self.layout = layout
        self.items: Mapping[str, Mapping[str, type]] = items or {}
        if kind in _KINDS:
            raise ValueError(f"answers of kind {kind!r} are already registered")
        _KINDS[kind] = self

    # -- fold -------------------------------------------------------------------------------

    def collector(self, max_chars: int) -> StreamCollector:
        """A collector for one streamed answer, giving up past ``max_chars`` characters."""
        raise NotImplementedError

    def from_json(self, body: bytes) -> CachedCompletion | None:
        """The entry for a non-streamed 200 response ``body``; None if it is not worth keeping."""
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        return self.from_object(data) if isinstance(data, dict) else None

    def from_object(self, data: dict[str, Any]) -> CachedCompletion | None:
        """The entry for a whole answer, parsed."""
        raise NotImplementedError

    def item_ok(self, item: Any) -> bool:
        """Whether ``item`` is an output item of this kind as ``items`` describes it."""
        if not isinstance(item, dict):
            return False
        named = item.get("type")
        fields = self.items.get(named) if isinstance(named, str) else None
        return fields is not None and all(isinstance(item.get(name), t) for name, t in fields.items())

    # -- replay -----------------------------------------------------------------------------

    def new_id(self, entropy: bytes | None = None) -> str:
        """A fresh answer id in the API's format: its prefix and 32 hex digits."""
        return f"{self.id_prefix}{(entropy or os.urandom(16)).hex()}"

    def replay_object(
        self, entry: CachedCompletion, *, completion_id: str, created: int, request: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The non-streamed response as the API's JSON object; ``request``: the body it answers."""
        raise NotImplementedError

    def replay_events(
        self,
        entry: CachedCompletion,
        *,
        completion_id: str,
        created: int,
        include_usage: bool,
        request: dict[str, Any] | None = None,
    ) -> list[bytes]:
        """The SSE events of the streamed response (its end mark included), one bytes per event."""
        raise NotImplementedError

    def replay_json(
        self, entry: CachedCompletion, *, completion_id: str, created: int, request: dict[str, Any] | None = None
    ) -> bytes:
        """The non-streamed response body."""
        return orjson.dumps(self.replay_object(entry, completion_id=completion_id, created=created, request=request))

    def replay_sse(
        self,
        entry: CachedCompletion,
        *,
        completion_id: str,
        created: int,
        include_usage: bool,
        request: dict[str, Any] | None = None,
    ) -> bytes:
        """The whole streamed response body at once (a cached answer need not trickle)."""
        return b"".join(
            self.replay_events(
                entry, completion_id=completion_id, created=created, include_usage=include_usage, request=request
            )
        )

    # -- key rules --------------------------------------------------------------------------

    def several_prompts(self, body: dict[str, Any]) -> bool:
        """Whether the request holds several prompts (each its own answer: not cached)."""
        return False

    def wants_logprobs(self, body: dict[str, Any]) -> bool:
        """Whether the request asks for log-probabilities, which an entry does not keep.

        vLLM's fields, which every API it serves accepts: chat's ``logprobs: true``,
        completions' ``logprobs: <int>`` (even 0 asks for the sampled token's),
        ``top_logprobs``, ``prompt_logprobs``.
        """
        logprobs = body.get("logprobs")
        if logprobs is not None and logprobs is not False:
            return True
        return body.get("top_logprobs") is not None or body.get("prompt_logprobs") is not None

    def __repr__(self) -> str:
        return f"<answers {self.kind}>"


def split_text(text: str, max_chunks: int = MAX_CHUNKS) -> list[str]:
    """``text`` in word-sized pieces (leading whitespace kept), at most ``max_chunks``, so a
    replayed stream renders incrementally as a live one does."""
    if not text:
        return []
    words = _WORDS.findall(text)
    if len(words) <= max_chunks:
        return words
    per = -(-len(words) // max_chunks)  # ceiling division: never more than max_chunks pieces
    return ["".join(words[i : i + per]) for i in range(0, len(words), per)]


def data_event(payload: dict[str, Any]) -> bytes:
    """An SSE event of ``data`` only."""
    return b"data: " + orjson.dumps(payload) + _SEP


def typed_event(kind: str, payload: dict[str, Any]) -> bytes:
    """An SSE event with its ``event`` type line."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + _SEP


def _payload(event: bytes) -> bytes | None:
    """An event's data: its ``data:`` lines joined by newlines, as SSE says; None if it has none."""
    if _DATA not in event:
        return None
    lines = [line[len(_DATA) :] for line in event.split(b"\n") if line.startswith(_DATA)]
    return b"\n".join(lines).strip() if lines else None
