"""Incremental reading of an upstream SSE stream, touching as few bytes as possible.

Upstream bytes are relayed as they are. The scanner only cuts them at event boundaries
(so a client never sees half an event followed by a gateway error event), counts data
events (≈ tokens, for timing and load accounting), notices ``[DONE]``, and parses the one
event that carries ``usage``, dropping it when the client did not ask for it (the gateway
always asks upstream for usage, to settle limits on real counts).

Events are separated by a blank line (``\\n\\n``), as vLLM and OpenAI send them.
"""

from __future__ import annotations

from typing import Any

import orjson

_SEP = b"\n\n"
_USAGE = b'"usage"'


class SseScanner:
    """Feed it chunks; it returns the bytes to forward and keeps what it learned."""

    __slots__ = ("_carry", "_drop_usage", "done", "events", "usage")

    def __init__(self, *, drop_usage: bool) -> None:
        self._drop_usage = drop_usage
        self._carry = b""
        self.events = 0
        self.done = False
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> tuple[bytes, int]:
        """Complete events from ``chunk`` (plus what was held back), and how many carry tokens."""
        data = self._carry + chunk if self._carry else chunk
        end = data.rfind(_SEP)
        if end == -1:
            self._carry = data
            return b"", 0
        end += len(_SEP)
        complete, self._carry = (data, b"") if end == len(data) else (data[:end], data[end:])
        n = complete.count(b"data:")
        if b"[DONE]" in complete:
            self.done = True
            n -= 1
        if _USAGE in complete:
            complete, n = self._take_usage(complete, n)
        self.events += n
        return complete, n

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

    @property
    def pending(self) -> bytes:
        """Bytes of an unfinished event held back (non-empty only if the stream broke)."""
        return self._carry


def error_event(message: str, code: str, type_: str = "server_error") -> bytes:
    """An SSE event the OpenAI SDKs raise as ``APIError`` mid-stream."""
    payload = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return b"data: " + orjson.dumps(payload) + _SEP
