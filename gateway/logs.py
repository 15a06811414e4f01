"""Logging: JSON lines on stderr, one access line per request.

Application logs go through :mod:`logging` with a JSON formatter (``extra={...}`` fields
become keys). The access log bypasses :mod:`logging`: it is written once per request on
the hot path, so it is one ``orjson.dumps`` and one buffered write, flushed at most
``ACCESS_FLUSH_S`` later (one system call per burst of requests, not per request; a
crash loses at most that much of the log). Neither ever contains
an API key; prompt text only when ``server.log_prompts`` is on.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import IO, Any

import orjson

# LogRecord attributes that are not user-supplied `extra` fields.
# How long an access line may sit in the buffer before it is written out.
ACCESS_FLUSH_S = 0.1
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's own access log would duplicate ours, without tenants or tokens.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


class AccessLog:
    """One JSON line per request."""

    def __init__(self, stream: IO[bytes] | None = None, *, enabled: bool = True) -> None:
        self._stream = stream if stream is not None else sys.stdout.buffer
        self.enabled = enabled
        self._flush_due: asyncio.TimerHandle | None = None

    def write(self, entry: dict[str, Any]) -> None:
        if not self.enabled:
            return
        entry["ts"] = round(time.time(), 3)
        self._stream.write(orjson.dumps(entry) + b"\n")
        if self._flush_due is None:
            try:
                self._flush_due = asyncio.get_running_loop().call_later(ACCESS_FLUSH_S, self.flush)
            except RuntimeError:  # no loop (a synchronous caller): write through
                self.flush()

    def flush(self) -> None:
        if self._flush_due is not None:
            self._flush_due.cancel()
            self._flush_due = None
        self._stream.flush()
