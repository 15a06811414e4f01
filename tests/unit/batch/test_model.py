"""The pure parts of the Batch API: input validation, the state machine, counts, shapes."""

from __future__ import annotations

import dataclasses
from typing import Any

import openai.types
import orjson
import pytest

from batch.config import BatchSettings, window_seconds
from batch.model import (
    BatchRecord,
    Counts,
    LineError,
    Progress,
    TransitionError,
    error_line,
    item_body,
    next_step,
    output_line,
    validate,
)
from batch.usage import Usage

CHAT = "/v1/chat/completions"


def line(custom_id: str = "a", **changes: Any) -> dict[str, Any]:
    request = {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": {"model": "m", "messages": []}}
    return {**request, **changes}


def jsonl(*requests: dict[str, Any] | bytes) -> bytes:
    return b"".join((r if isinstance(r, bytes) else orjson.dumps(r)) + b"\n" for r in requests)


def test_valid_lines_become_items_at_their_offsets() -> None:
    data = jsonl(line("a"), b"   ", line("b"))
    checked = validate(data, CHAT, 10)
    assert checked.errors == ()
    assert [i.custom_id for i in checked.items] == ["a", "b"]
    for item in checked.items:
        assert orjson.loads(data[item.offset : item.offset + item.length])["custom_id"] == item.custom_id


def test_the_batch_is_named_for_its_first_items_model() -> None:
    first = line("a", body={"model": "first", "messages": []})
    assert validate(jsonl(first, line("b")), CHAT, 10).model == "first"
    assert validate(jsonl(line("a", body={"messages": []})), CHAT, 10).model is None
    assert validate(jsonl(line("a"), line("a")), CHAT, 10).model is None  # failed: no items


def test_a_last_line_without_newline_counts() -> None:
    assert len(validate(jsonl(line("a")) + orjson.dumps(line("b")), CHAT, 10).items) == 2


@pytest.mark.parametrize(
    ("bad", "code", "param"),
    [
        (b"{not json", "invalid_json_line", None),
        (b"[1, 2]", "invalid_json_line", None),
        (line(custom_id=7), "missing_custom_id", "custom_id"),
        (line("a"), "duplicate_custom_id", "custom_id"),
        (line("z", method="GET"), "invalid_method", "method"),
        (line("z", url="/v1/images/generations"), "invalid_url", "url"),
        (line("z", url="/v1/embeddings"), "mismatched_endpoint", "url"),
        (line("z", body="text"), "invalid_request", "body"),
        (line("z", body={"model": "m", "stream": True}), "invalid_request", "body.stream"),
    ],
)
def test_each_kind_of_bad_line_is_named_with_its_line(bad: dict[str, Any] | bytes, code: str, param: str) -> None:
    checked = validate(jsonl(line("a"), bad), CHAT, 10)
    assert checked.items == ()
    assert [(e.line, e.code, e.param) for e in checked.errors] == [(2, code, param)]


def test_too_many_requests_and_empty_files() -> None:
    checked = validate(jsonl(*(line(str(i)) for i in range(4))), CHAT, 3)
    assert [e.code for e in checked.errors] == ["too_many_requests"] and checked.items == ()
    assert [e.code for e in validate(b"\n \n", CHAT, 3).errors] == ["empty_file"]


def test_errors_reported_are_bounded() -> None:
    checked = validate(b"{\n" * 500, CHAT, 1000)
    assert len(checked.errors) == 100 and checked.errors[-1].line == 100


def test_a_responses_item_is_never_stored() -> None:
    raw = orjson.dumps(line("a", url="/v1/responses", body={"model": "m", "input": "x", "store": True}))
    assert orjson.loads(item_body(raw, "/v1/responses")) == {"model": "m", "input": "x", "store": False}
    assert orjson.loads(item_body(orjson.dumps(line("a")), CHAT)) == {"model": "m", "messages": []}


def record(**changes: Any) -> BatchRecord:
    base = BatchRecord("batch_1", "t1", CHAT, "file-1", "24h", created_at=100, expires_at=100 + 86400)
    return dataclasses.replace(base, **changes)


def test_the_state_machine_stamps_each_status() -> None:
    running = record().moved("in_progress", 101, counts=Counts(total=3))
    assert running.status == "in_progress" and running.times == {"in_progress_at": 101}
    finishing = running.moved("finalizing", 150).moved("completed", 151)
    assert finishing.times == {"in_progress_at": 101, "finalizing_at": 150, "completed_at": 151}
    cancelled = running.moved("cancelling", 120).moved("cancelled", 121)
    assert cancelled.status == "cancelled"
    with pytest.raises(TransitionError):
        finishing.moved("in_progress", 200)
    with pytest.raises(TransitionError):
        record().moved("completed", 200)
    with pytest.raises(TransitionError):
        running.moved("cancelling", 1).moved("completed", 2)


def test_next_step() -> None:
    running = record(status="in_progress")
    assert next_step(running, Counts(3, 1, 0), leased=2, now=200) is None
    assert next_step(running, Counts(3, 2, 1), leased=0, now=200) == "finalize"
    # Every result written but an item still leased (its duplicate run): wait for it.
    assert next_step(running, Counts(3, 2, 1), leased=1, now=200) is None
    late = 100 + 86400
    assert next_step(running, Counts(3, 1, 0), leased=1, now=late) == "close"
    assert next_step(running, Counts(3, 1, 0), leased=0, now=late) == "expire"
    assert next_step(record(status="cancelling"), Counts(3, 1, 0), leased=1, now=200) is None
    assert next_step(record(status="cancelling"), Counts(3, 1, 0), leased=0, now=200) == "cancel"
    assert next_step(record(status="finalizing"), Counts(3, 3, 0), leased=0, now=200) == "finalize"
    assert next_step(record(status="completed"), Counts(3, 3, 0), leased=0, now=late) is None


def test_the_batch_object_is_openais() -> None:
    failed = record().moved("failed", 100, errors=(LineError("invalid_url", "no", 4, "url"),))
    shown = failed.to_openai()
    parsed = openai.types.Batch.model_validate(shown)
    assert parsed.status == "failed" and parsed.failed_at == 100
    assert parsed.errors is not None and parsed.errors.data is not None
    assert (parsed.errors.data[0].line, parsed.errors.data[0].code) == (4, "invalid_url")
    assert parsed.model is None and parsed.usage is not None and parsed.usage.total_tokens == 0
    running = record(model="tiny").moved("in_progress", 101, counts=Counts(total=5))
    live = openai.types.Batch.model_validate(running.to_openai(Progress(Counts(5, 2, 1), 1, Usage(30, 8, 16, 2))))
    assert live.request_counts is not None
    assert (live.request_counts.total, live.request_counts.completed, live.request_counts.failed) == (5, 2, 1)
    assert live.errors is None and live.in_progress_at == 101 and live.completed_at is None
    assert live.model == "tiny" and live.usage is not None
    assert (live.usage.input_tokens, live.usage.output_tokens, live.usage.total_tokens) == (30, 8, 30 + 8)
    assert live.usage.input_tokens_details.cached_tokens == 16
    assert live.usage.output_tokens_details.reasoning_tokens == 2


def test_an_ended_batch_shows_its_own_usage_not_the_stores() -> None:
    done = record(status="completed", counts=Counts(2, 2, 0), usage=Usage(10, 4))
    shown = done.to_openai(Progress(Counts(2, 0, 0), 0, Usage(99, 99)))
    assert shown["usage"]["total_tokens"] == 14 and shown["request_counts"]["completed"] == 2


def test_a_record_survives_its_bytes() -> None:
    kept = record(metadata={"k": "v"}).moved("failed", 3, errors=(LineError("empty_file", "empty"),))
    assert BatchRecord.from_bytes(kept.to_bytes()) == kept
    counted = record(model="tiny", usage=Usage(7, 3, 2, 1))
    assert BatchRecord.from_bytes(counted.to_bytes()) == counted
    uncounted = record(usage=None)
    assert BatchRecord.from_bytes(uncounted.to_bytes()) == uncounted


def test_a_record_kept_before_model_and_usage_loads_without_them() -> None:
    kept = orjson.loads(record(status="in_progress", model="tiny").to_bytes())
    old = {k: v for k, v in kept.items() if k not in ("model", "usage")}
    loaded = BatchRecord.from_bytes(orjson.dumps(old))
    assert loaded.model is None and loaded.usage is None
    # Its items were not all counted: no usage is shown, live or final.
    shown = loaded.to_openai(Progress(Counts(3, 1, 0), 0, Usage(5, 5)))
    assert shown["usage"] is None and shown["model"] is None
    assert openai.types.Batch.model_validate(shown).usage is None


def test_a_record_from_a_later_version_loads() -> None:
    later = {**orjson.loads(record().to_bytes()), "priority": "low"}
    assert BatchRecord.from_bytes(orjson.dumps(later)) == record()


def test_output_and_error_lines() -> None:
    out = orjson.loads(output_line("c1", 200, "req-1", {"object": "chat.completion"}))
    assert out["id"].startswith("batch_req_") and out["custom_id"] == "c1" and out["error"] is None
    assert out["response"] == {"status_code": 200, "request_id": "req-1", "body": {"object": "chat.completion"}}
    err = orjson.loads(error_line("c2", "batch_expired", "too late"))
    assert err["response"] is None and err["error"] == {"code": "batch_expired", "message": "too late"}


def test_completion_windows() -> None:
    assert window_seconds("24h") == 86400 and window_seconds("90s") == 90 and window_seconds("2d") == 172800
    assert window_seconds("24 hours") is None and window_seconds("0h") is None
    with pytest.raises(ValueError, match="completion window"):
        BatchSettings(completion_windows=["soon"])


def test_an_older_batch_rewritten_by_this_version_stays_readable_by_the_older_one() -> None:
    """A pod of the version before ``model`` and ``usage`` built a record from every key it
    read; a batch it created must not gain keys it does not know when this version moves it."""
    old_keys = {"id", "tenant", "endpoint", "input_file_id", "completion_window", "created_at", "expires_at"}
    old_keys |= {"status", "metadata", "errors", "output_file_id", "error_file_id", "counts", "times"}
    older = record(status="in_progress", usage=None)
    assert set(orjson.loads(older.moved("cancelling", 120).to_bytes())) == old_keys
    assert set(orjson.loads(record(model="tiny").to_bytes())) == old_keys | {"model", "usage"}
