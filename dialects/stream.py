"""Incremental reading of an upstream SSE stream, touching as few bytes as possible.

Upstream bytes are relayed as they are. A scanner only cuts them at event boundaries (so a
client never sees half an event followed by a gateway error event), counts the events that
carry tokens (for timing and load accounting), notices the stream's end, and reads the usage
the stream reports. How an API marks those is its dialect's: ``SseScanner`` reads OpenAI's
data-only events (``[DONE]`` at the end, usage in a usage-only chunk, dropped again when the
client did not ask for it: the gateway always asks upstream for usage, to settle limits on
real counts); ``TypedEventScanner`` reads streams of typed events (OpenAI's Responses,
Anthropic's Messages), by the event types each API's subclass names (``TOKENS``, ``ENDS``,
``READ``).

Events are separated by a blank line. vLLM and OpenAI end lines with ``\\n``; SSE allows
``\\r\\n`` and ``\\r`` too (https://html.spec.whatwg.org/multipage/server-sent-events.html,
"Parsing an event stream"), and servers built on sse-starlette, llama-cpp-python's among them,
send ``\\r\\n``. Such a stream is turned into ``\\n`` line ends as it passes, so that its
events are relayed as they come (not held until the stream ends) and usage, the cache and
the gateway's own error event see one form; a stream without ``\\r`` costs one scan for it.
An event still unfinished past ``MAX_EVENT_BYTES`` is not one a server means to finish: the
scanner raises ``SseError`` instead of holding the stream in memory.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

_SEP = b"\n\n"
_CR = b"\r"
_DONE = b"data: [DONE]\n\n"
# A choice that stopped: its finish_reason is a string, not null.
_FINISHED = re.compile(rb'"finish_reason"\s*:\s*"')
_USAGE = b'"usage"'
# A token event is a few hundred bytes, a few KiB with logprobs; a final event with every
# choice's usage or logprobs stays well under this.
MAX_EVENT_BYTES = 8 * 1024 * 1024


class SseError(Exception):
    """The replica's stream cannot be relayed as SSE: an event longer than ``MAX_EVENT_BYTES``."""


class SseScanner:
    """Feed it chunks; it returns the bytes to forward and keeps what it learned.

    This class reads OpenAI's chat and completions streams; subclasses override ``_scan``
    (what one block of whole events holds) and ``finish`` for other APIs' streams.
    """

    __slots__ = ("_after_cr", "_carry", "_drop_usage", "_last", "done", "events", "final", "started", "usage")

    def __init__(self, *, drop_usage: bool) -> None:
        self._drop_usage = drop_usage
        # An unfinished event: grown in place, so an event over many chunks costs linear time.
        self._carry = bytearray()
        # The last chunk ended in "\r": a "\n" opening the next one is the same line end.
        self._after_cr = False
        # The last whole events forwarded: read once, at the end (``finish``).
        self._last = b""
        self.events = 0
        self.done = False
        # The usage, as ``prompt_tokens``/``completion_tokens``/``total_tokens``.
        self.usage: dict[str, Any] | None = None
        # The whole answer a stream's last event carries, and the answer as its first event
        # announces it (its id), where its API sends them.
        self.final: dict[str, Any] | None = None
        self.started: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> tuple[bytes, int]:
        """Complete events from ``chunk`` (plus what was held back), and how many carry tokens.

        Raises ``SseError`` when the event being held back grows past ``MAX_EVENT_BYTES``.
        """
        if self._after_cr or _CR in chunk:
            chunk = self._to_lf(chunk)
        carry = self._carry
        if carry:
            # A separator may straddle the join: look from the carry's last byte on.
            start = len(carry) - 1
            carry += chunk
            end = carry.rfind(_SEP, start)
            if end == -1:
                return self._held()
            end += len(_SEP)
            complete = bytes(carry[:end])
            del carry[:end]
        else:
            end = chunk.rfind(_SEP)
            if end == -1:
                carry += chunk
                return self._held()
            end += len(_SEP)
            complete = chunk
            if end < len(chunk):
                complete = chunk[:end]
                carry += chunk[end:]
        complete, n = self._scan(complete)
        self.events += n
        self._last = complete
        return complete, n

    def _scan(self, complete: bytes) -> tuple[bytes, int]:
        """OpenAI's data-only events: every ``data:`` is a token but ``[DONE]`` and a
        usage-only chunk (dropped when the client did not ask for usage)."""
        n = complete.count(b"data:")
        if b"[DONE]" in complete:
            self.done = True
            n -= 1
        if _USAGE in complete:
            complete, n = self._take_usage(complete, n)
        return complete, n

    def finish(self) -> bytes:
        """The replica's answer ended cleanly (its whole body read): ``[DONE]`` to send on when
        the generation finished but no ``[DONE]`` came, as llama.cpp's server and some of its
        forks end streams, so the client sees the end OpenAI sends; else nothing.

        Finished means the usage came (servers send it after the last token) or the last
        events forwarded stopped a choice (a string ``finish_reason``). A body that ended
        without either was cut short, and stays ``done = False``.
        """
        if self.done or not (self.usage is not None or _FINISHED.search(self._last)):
            return b""
        self.done = True
        return _DONE

    def _take_usage(self, block: bytes, n: int) -> tuple[bytes, int]:
        pos = block.find(_USAGE)
        while pos != -1:
            value = block[pos + len(_USAGE) :].lstrip(b" :")
            if not value.startswith(b"null"):
                start = block.rfind(b"data:", 0, pos)
                stop = block.find(_SEP, pos)
                if start != -1 and stop != -1:
                    stop += len(_SEP)
                    try:
                        event = orjson.loads(block[start + 5 : stop].strip())
                    except orjson.JSONDecodeError:
                        event = None
                    if isinstance(event, dict) and isinstance(event.get("usage"), dict):
                        self.usage = event["usage"]
                        if not event.get("choices"):
                            # A usage-only event is not a token.
                            n -= 1
                            if self._drop_usage:
                                block = block[:start] + block[stop:]
                                pos = block.find(_USAGE, start)
                                continue
            pos = block.find(_USAGE, pos + 1)
        return block, n

    def _held(self) -> tuple[bytes, int]:
        if len(self._carry) > MAX_EVENT_BYTES:
            raise SseError(f"it sent an event longer than {MAX_EVENT_BYTES} bytes")
        return b"", 0

    def _to_lf(self, chunk: bytes) -> bytes:
        """``chunk`` with "\\r\\n" and lone "\\r" line ends made "\\n" (one split between two
        chunks included)."""
        if not chunk:
            return chunk
        if self._after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._after_cr = chunk.endswith(_CR)
        return chunk.replace(b"\r\n", b"\n").replace(_CR, b"\n")

    def drop_pending(self) -> None:
        """Forget the unfinished event held back: its stream broke, and what replaces it
        (a continuation from another replica) starts at an event boundary."""
        self._carry.clear()
        self._after_cr = False

    @property
    def pending(self) -> bytes:
        """Bytes of an unfinished event held back (non-empty only if the stream broke)."""
        return bytes(self._carry)


class TypedEventScanner(SseScanner):
    """A stream of typed events (``event: <type>`` lines, or a ``type`` in each event's data).

    Subclasses name the types: ``TOKENS`` (the events that carry generated text), ``ENDS``
    (the last event of a stream that finished), and ``READ`` (those whose data the scanner
    parses, in ``_read``: usage, the final answer). Every other event passes unparsed when
    it has an ``event:`` line. Usage is never dropped: these APIs always report it.
    """

    __slots__ = ()

    TOKENS: frozenset[bytes] = frozenset()
    ENDS: frozenset[bytes] = frozenset()
    READ: frozenset[bytes] = frozenset()

    def __init__(self) -> None:
        super().__init__(drop_usage=False)

    def _scan(self, complete: bytes) -> tuple[bytes, int]:
        n = 0
        for event in complete.split(_SEP):
            if not event:
                continue
            data: Any = None
            if event.startswith(_EVENT):
                kind = event[len(_EVENT) : event.find(b"\n") if b"\n" in event else len(event)].strip()
            else:
                data = _data_of(event)
                named = data.get("type") if isinstance(data, dict) else None
                kind = named.encode() if isinstance(named, str) else b""
            if kind in self.TOKENS:
                n += 1
            elif kind in self.READ:
                if data is None:
                    data = _data_of(event)
                if isinstance(data, dict):
                    self._read(kind, data)
            if kind in self.ENDS:
                self.done = True
        return complete, n

    def _read(self, kind: bytes, data: dict[str, Any]) -> None:
        """What a ``READ`` event's data says (usage, the final answer)."""

    def finish(self) -> bytes:
        """Nothing to add: a stream that sent no end event was cut short."""
        return b""


_EVENT = b"event:"
_DATA = b"data:"


def _data_of(event: bytes) -> Any:
    """The JSON of an event's ``data:`` lines (joined by newlines, as SSE says), or None."""
    lines = [line[len(_DATA) :].lstrip(b" ") for line in event.split(b"\n") if line.startswith(_DATA)]
    if not lines:
        return None
    try:
        return orjson.loads(b"\n".join(lines))
    except orjson.JSONDecodeError:
        return None
