"""What every API's continuation shares: the ``Continuation`` a plan returns, the ``Splicer``
that fits the new stream into the old one, and the reading of whole SSE events.

A stream whose replica failed after its first byte is finished on another replica: the
request is sent again with the text already relayed as the start of the answer, and the
new stream's events are rewritten so the client sees one stream. Deciding whether
that can be done exactly, building the new body and rewriting the events is pure work over
bytes and dicts, kept here; sending the request and relaying its bytes is the proxy's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import orjson

SEP = b"\n\n"
_EVENT = b"event:"
_DATA = b"data:"
DONE = b"[DONE]"


class Splicer(Protocol):
    """Rewrites the continuation's stream, block of whole events after block, so it
    continues the client's stream; ``usage`` is the client's final usage once known."""

    def splice(self, block: bytes) -> bytes: ...

    @property
    def usage(self) -> dict[str, int] | None: ...


@dataclass(frozen=True, slots=True)
class Continuation:
    """How to finish a stream on another replica.

    ``path``: the endpoint to send ``body`` to (a Messages stream is continued through
    chat completions: vLLM's ``/v1/messages`` closes a trailing assistant turn instead of
    continuing it). ``body``: the whole request, streamed, usage asked for. ``splice``: feed
    it each block of whole events of the new stream, relay what it returns. ``relayed_tokens``
    and ``partial_text``: what the client already has, for accounting and logs.
    """

    path: str
    body: dict[str, Any]
    relayed_tokens: int
    partial_text: str
    splicer: Splicer

    def splice(self, block: bytes) -> bytes:
        return self.splicer.splice(block)

    @property
    def usage(self) -> dict[str, int] | None:
        """The client's usage (``prompt_tokens``/``completion_tokens``/``total_tokens``) once
        the continuation's final usage went through ``splice``; None before."""
        return self.splicer.usage


@dataclass(frozen=True, slots=True)
class Event:
    """One SSE event: its ``event:`` type (empty if none), its parsed ``data`` (None for a
    comment, ``[DONE]`` or data that is not JSON), its bytes as they came, and whether it is
    OpenAI's ``[DONE]``."""

    kind: str
    data: Any
    raw: bytes
    done: bool = False


def events(block: bytes) -> list[Event]:
    """The whole events of ``block`` (``\\n`` line ends, as the scanners pass them on)."""
    out: list[Event] = []
    for raw in block.split(SEP):
        if not raw.strip():
            continue
        kind, lines = "", []
        for line in raw.split(b"\n"):
            if line.startswith(_EVENT):
                kind = line[len(_EVENT) :].strip().decode("utf-8", "replace")
            elif line.startswith(_DATA):
                lines.append(line[len(_DATA) :].lstrip(b" "))
        data: Any = None
        payload = b"\n".join(lines)
        done = payload.strip() == DONE
        if lines and not done:
            try:
                data = orjson.loads(payload)
            except orjson.JSONDecodeError:
                data = None
        if not kind and isinstance(data, dict) and isinstance(data.get("type"), str):
            kind = data["type"]
        out.append(Event(kind, data, raw + SEP, done))
    return out


def data_event(data: dict[str, Any]) -> bytes:
    """An OpenAI data-only event."""
    return _DATA + b" " + orjson.dumps(data) + SEP


def typed_event(kind: str, data: dict[str, Any]) -> bytes:
    """A typed event (Responses, Messages): its ``event:`` line, then its data."""
    return _EVENT + b" " + kind.encode() + b"\n" + _DATA + b" " + orjson.dumps(data) + SEP


def remaining(limit: Any, used: int) -> int | None:
    """What is left of a token limit once ``used`` were generated: None when there is no
    limit, at least 1 (a limit already reached means the stream ended, refused before)."""
    if not isinstance(limit, int) or isinstance(limit, bool):
        return None
    return max(1, limit - used)


def counts(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def stop_may_straddle(stop: Any, partial: str) -> bool:
    """A stop string could begin in the partial text and end in the continuation: the
    replica looks for it in the continuation's text only and would not stop."""
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    for s in stops:
        if not isinstance(s, str):
            continue
        if any(partial.endswith(s[:i]) for i in range(1, len(s))):
            return True
    return False
