"""Settings of the Batch API: the top-level ``batch:`` block.

::

    batch:
      enabled: true
      files_dir: data/batch        # file bodies (and their metadata); a shared volume across pods
      max_file_bytes: 209715200    # 200 MB, as OpenAI
      max_requests: 50000          # per batch, as OpenAI
      concurrency: 16              # items this pod runs at once
      band: batch                  # sent as x-fleetgate-band on every item
      lease_s: 60                  # an item's lease; renewed while it runs
      completion_windows: ["24h"]

Batch state and its work queue live in Redis when ``redis_url`` is set (every pod takes
items), otherwise in this process's memory.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

# OpenAI's bounds (https://platform.openai.com/docs/guides/batch): 200 MB per input file,
# 50,000 requests per batch.
DEFAULT_MAX_FILE_BYTES = 200 * 1024 * 1024
DEFAULT_MAX_REQUESTS = 50_000
# "24h" is the only window OpenAI accepts; an operator may allow others (a test, a shorter SLO).
_WINDOW = re.compile(r"^([1-9][0-9]*)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def window_seconds(window: str) -> int | None:
    """``"24h"`` -> 86400; None when the text is not ``<n><s|m|h|d>``."""
    match = _WINDOW.match(window)
    if match is None:
        return None
    return int(match.group(1)) * _UNIT_S[match.group(2)]


class BatchSettings(BaseModel):
    """The top-level ``batch:`` block."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    files_dir: str = "data/batch"
    max_file_bytes: int = Field(DEFAULT_MAX_FILE_BYTES, gt=0)
    max_requests: int = Field(DEFAULT_MAX_REQUESTS, gt=0)
    # Items one pod sends through its own request path at once: the batch's share of a pod
    # is bounded here, and admission (the band) decides how much of the fleet it gets.
    concurrency: int = Field(16, gt=0, le=4096)
    band: str = Field("batch", min_length=1)
    # A pod that dies holds its items for at most this long before another pod takes them.
    lease_s: float = Field(60.0, gt=0)
    # How often an idle pod looks for work, and reaps leases / finishes batches.
    poll_s: float = Field(1.0, gt=0)
    # After a 429/503 from admission, the item waits this long (or the answer's Retry-After,
    # up to max_backoff_s) before it is taken again.
    backoff_s: float = Field(1.0, gt=0)
    max_backoff_s: float = Field(30.0, gt=0)
    # Where items are sent: the gateway's own listener. Default: server.host/port (a wildcard
    # host means 127.0.0.1).
    loopback_url: str | None = None
    completion_windows: list[str] = ["24h"]
    # How long one item may take to answer (its generation included).
    item_timeout_s: float = Field(600.0, gt=0)
    redis_timeout_ms: float = Field(2000.0, gt=0)

    @field_validator("completion_windows")
    @classmethod
    def _windows(cls, windows: list[str]) -> list[str]:
        for window in windows:
            if window_seconds(window) is None:
                raise ValueError(f"completion window {window!r} is not <n><s|m|h|d>, e.g. '24h'")
        return windows
