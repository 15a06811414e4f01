"""What a batch is, without I/O: input lines validated, the state machine, request counts,
the objects OpenAI's API returns and the lines of the output and error files.

Shapes follow OpenAI's Batch API (https://platform.openai.com/docs/api-reference/batch) as
the official SDK reads them (``openai.types.Batch``, ``openai.types.FileObject``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from batch.usage import ZERO, Usage

# The endpoints a batch may name, and the gateway route each line's url must equal.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages")
# OpenAI reports a validation failure's first errors, not every line of a broken file.
MAX_REPORTED_ERRORS = 100

STATUSES = (
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
)
TERMINAL = frozenset({"failed", "completed", "expired", "cancelled"})
# Where each status may go. Files are written while ``finalizing`` (all items done),
# ``cancelling`` (the items under way have ended) or just before ``expired``.
TRANSITIONS: dict[str, frozenset[str]] = {
    "validating": frozenset({"in_progress", "failed"}),
    "in_progress": frozenset({"finalizing", "cancelling", "expired"}),
    "finalizing": frozenset({"completed"}),
    "cancelling": frozenset({"cancelled"}),
}


class TransitionError(ValueError):
    """A status change the state machine does not allow (a race lost, or a bug)."""


def new_id(prefix: str) -> str:
    """``file-…``, ``batch_…``, ``batch_req_…``: OpenAI's prefixes, 24 random hex digits."""
    return prefix + os.urandom(12).hex()


@dataclass(frozen=True, slots=True)
class LineError:
    """One reason a batch failed validation (``errors.data[]``); ``line`` is 1-based."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(frozen=True, slots=True)
class Item:
    """A valid request line: where it lies in the input file, and its custom_id."""

    offset: int
    length: int
    custom_id: str


@dataclass(frozen=True, slots=True)
class Validation:
    items: tuple[Item, ...]
    errors: tuple[LineError, ...]
    # The batch's ``model``: the first item's ``body.model`` (None when the input failed).
    model: str | None = None


def iter_lines(data: bytes) -> Iterator[tuple[int, int, int]]:
    """(line number, offset, length) of each non-blank line."""
    offset = 0
    number = 0
    size = len(data)
    while offset < size:
        end = data.find(b"\n", offset)
        if end < 0:
            end = size
        number += 1
        if data[offset:end].strip():
            yield number, offset, end - offset
        offset = end + 1


def validate(data: bytes, endpoint: str, max_requests: int) -> Validation:
    """Every line of an input file checked as OpenAI checks it: a JSON object with a unique
    string ``custom_id``, ``method`` POST, ``url`` the batch's endpoint, a ``body`` object that
    does not stream. Any error fails the whole batch (its first ``MAX_REPORTED_ERRORS`` listed)."""
    items: list[Item] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    count = 0
    for number, offset, length in iter_lines(data):
        count += 1
        error = _check_line(data[offset : offset + length], number, endpoint, seen)
        if error is not None:
            errors.append(error)
        elif not errors:
            items.append(Item(offset, length, _custom_id(data[offset : offset + length])))
        if len(errors) >= MAX_REPORTED_ERRORS:
            break
    if count == 0:
        errors.append(LineError("empty_file", "The input file has no requests."))
    elif count > max_requests:
        message = f"The batch has {count} requests; the limit is {max_requests} per batch."
        errors.insert(0, LineError("too_many_requests", message))
    if errors:
        return Validation((), tuple(errors))
    return Validation(tuple(items), (), _model(data[items[0].offset : items[0].offset + items[0].length]))


def _custom_id(line: bytes) -> str:
    value = orjson.loads(line)["custom_id"]
    assert isinstance(value, str)
    return value


def _model(line: bytes) -> str | None:
    """A line's ``body.model``. OpenAI's batch object names one model; items may name
    others (the gateway routes each as it comes), and the first one's stands for the batch."""
    value = orjson.loads(line)["body"].get("model")
    return value if isinstance(value, str) else None


def _check_line(line: bytes, number: int, endpoint: str, seen: set[str]) -> LineError | None:
    try:
        request = orjson.loads(line)
    except orjson.JSONDecodeError:
        return LineError("invalid_json_line", "This line is not valid JSON.", number)
    if not isinstance(request, dict):
        return LineError("invalid_json_line", "This line is not a JSON object.", number)
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError("missing_custom_id", "Each request needs a string custom_id.", number, "custom_id")
    if custom_id in seen:
        message = f"The custom_id {custom_id!r} is a duplicate of another request; custom_id must be unique."
        return LineError("duplicate_custom_id", message, number, "custom_id")
    seen.add(custom_id)
    if request.get("method") != "POST":
        return LineError("invalid_method", "The method must be POST.", number, "method")
    url = request.get("url")
    if url not in ENDPOINTS:
        message = f"The url {url!r} is not served in a batch; use one of {', '.join(ENDPOINTS)}."
        return LineError("invalid_url", message, number, "url")
    if url != endpoint:
        message = f"The url {url!r} does not match the batch's endpoint {endpoint!r}."
        return LineError("mismatched_endpoint", message, number, "url")
    body = request.get("body")
    if not isinstance(body, dict):
        return LineError("invalid_request", "The body must be a JSON object.", number, "body")
    if body.get("stream"):
        return LineError("invalid_request", "Streaming is not supported in a batch.", number, "body.stream")
    return None


def item_body(line: bytes, endpoint: str) -> bytes:
    """The request a validated line sends upstream. A Responses item is never stored
    (``store: false``): a batch's answers live in its output file."""
    body = orjson.loads(line)["body"]
    if endpoint == "/v1/responses":
        body = {**body, "store": False}
    return orjson.dumps(body)


# -- the batch ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Counts:
    """``request_counts``: items with an answer (2xx), items that failed, all items."""

    total: int = 0
    completed: int = 0
    failed: int = 0

    def to_json(self) -> dict[str, int]:
        return {"total": self.total, "completed": self.completed, "failed": self.failed}

    @property
    def done(self) -> int:
        return self.completed + self.failed


@dataclass(frozen=True, slots=True)
class Progress:
    """What a store counts of a running batch: its items' counts, the items under lease and
    the usage of the items answered (2xx) so far."""

    counts: Counts
    leased: int = 0
    usage: Usage = ZERO


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One batch as kept by a store: OpenAI's fields plus its tenant."""

    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str = "validating"
    metadata: dict[str, str] | None = None
    errors: tuple[LineError, ...] = ()
    output_file_id: str | None = None
    error_file_id: str | None = None
    # The final counts (a running batch's come from the store's counters).
    counts: Counts = Counts()
    times: dict[str, int] = field(default_factory=dict)
    model: str | None = None
    # The final usage, as ``counts``. None on a record kept before batches counted usage
    # (``from_bytes``): the pods that ran its items did not count them, so none is shown.
    usage: Usage | None = ZERO

    def moved(self, to: str, now: int, **changes: Any) -> BatchRecord:
        """This batch in status ``to`` (its ``<to>_at`` stamped), or ``TransitionError``."""
        if to not in TRANSITIONS.get(self.status, frozenset()):
            raise TransitionError(f"a batch cannot go from {self.status} to {to}")
        return dataclasses.replace(self, status=to, times={**self.times, f"{to}_at": now}, **changes)

    def to_openai(self, live: Progress | None = None) -> dict[str, Any]:
        """The ``batch`` object; ``live``: the store's counts of a running batch."""
        running = live is not None and self.status not in TERMINAL
        shown = live.counts if live is not None and running else self.counts
        usage = live.usage if live is not None and running and self.usage is not None else self.usage
        body: dict[str, Any] = {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": [e.to_json() for e in self.errors]} if self.errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "request_counts": shown.to_json(),
            "metadata": self.metadata,
            "model": self.model,
            "usage": usage.to_openai() if usage is not None else None,
        }
        for status in ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled"):
            body[f"{status}_at"] = self.times.get(f"{status}_at")
        return body

    def to_bytes(self) -> bytes:
        nested = ("errors", "counts", "usage")
        plain = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in nested}
        kept = {**plain, "errors": [e.to_json() for e in self.errors], "counts": self.counts.to_json()}
        if self.usage is not None:
            kept["usage"] = self.usage.to_json()
        # Left out when unset, so a batch from before these keys stays readable by the pods
        # of that version after a pod of this one moved it along (``from_bytes``).
        for key in _LATER_KEYS:
            if kept.get(key) is None:
                kept.pop(key, None)
        return orjson.dumps(kept)

    @classmethod
    def from_bytes(cls, raw: bytes | str) -> BatchRecord:
        """A kept record, whichever version of the gateway wrote it (pods of two versions
        share Redis during a rolling upgrade).

        A record from before ``model`` and ``usage`` loads with ``model`` None and ``usage``
        None (shown as null: its items were not counted). Keys this version does not know
        are ignored, so a record written by a later version loads here. The version before
        ``model`` and ``usage`` passed every key to the constructor, so a pod of that version
        fails on a record that has them (a TypeError), that is on a batch a pod of this
        version created (``to_bytes`` leaves them out of the older batches it rewrites): it
        answers 500 for such a batch, the items of it that it claims fail before they are
        sent and go back to the queue when their lease lapses, and its maintenance pass stops
        at such a batch; pods of this version run and finish those batches, and count every
        item of them.
        """
        data = orjson.loads(raw)
        known = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        data["errors"] = tuple(LineError(**e) for e in data.get("errors") or ())
        data["counts"] = Counts(**data["counts"])
        usage = data.get("usage")
        data["usage"] = Usage.from_json(usage) if isinstance(usage, dict) else None
        return cls(**data)


# Keys a record has had since the batch object carried ``model`` and ``usage``.
_LATER_KEYS = ("model", "usage")


def next_step(record: BatchRecord, counts: Counts, leased: int, now: int) -> str | None:
    """What a running batch needs now, decided from its counts and leases:

    - ``"finalize"``: every item has its result: write the files, then ``completed``;
    - ``"close"``: the completion window has passed: take no more items;
    - ``"expire"``: closed and no item under way: write the files, then ``expired``;
    - ``"cancel"``: cancelling and no item under way: write the files, then ``cancelled``;
    - None: nothing yet.
    """
    if record.status == "finalizing":  # the pod that began it died before the end
        return "finalize"
    if record.status == "cancelling":
        return "cancel" if leased == 0 else None
    if record.status != "in_progress":
        return None
    if counts.done >= counts.total and leased == 0:
        return "finalize"
    if now >= record.expires_at:
        return "expire" if leased == 0 else "close"
    return None


# -- output and error files -----------------------------------------------------------------


def output_line(custom_id: str, status: int, request_id: str, body: Any) -> bytes:
    """A line of the output file (or of the error file, for a non-2xx answer)."""
    response = {"status_code": status, "request_id": request_id, "body": body}
    return orjson.dumps({"id": new_id("batch_req_"), "custom_id": custom_id, "response": response, "error": None})


def error_line(custom_id: str, code: str, message: str) -> bytes:
    """A line of the error file for an item that got no answer (expired, cancelled...)."""
    error = {"code": code, "message": message}
    return orjson.dumps({"id": new_id("batch_req_"), "custom_id": custom_id, "response": None, "error": error})


# How an unfinished item is reported when its batch ends without it.
UNFINISHED = {
    "expire": ("batch_expired", "This request could not be executed before the completion window expired."),
    "cancel": ("batch_cancelled", "This request was not executed because the batch was cancelled."),
}


def file_object(
    file_id: str, size: int, created_at: int, filename: str, purpose: str, expires_at: int | None = None
) -> dict[str, Any]:
    """OpenAI's ``file`` object."""
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": created_at,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "expires_at": expires_at,
        "status_details": None,
    }


def page(objects: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page (``after``/``limit``)."""
    return {
        "object": "list",
        "data": objects,
        "first_id": objects[0]["id"] if objects else None,
        "last_id": objects[-1]["id"] if objects else None,
        "has_more": has_more,
    }
