"""The Batch API through the real `fleetgate serve` (managed simulated replicas), driven by
the official openai SDK: upload, create, poll, download output and errors, cancel; hostile
input; tenant isolation; a completion window that runs out."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.integration.harness import API_KEY, OTHER_KEY, GatewayProcess, gateway_process

MODEL = "sim-model"
MAX_FILE_BYTES = 200_000


def config(files_dir: Path) -> dict[str, Any]:
    return {
        "models": [
            {
                "name": MODEL,
                "replicas": [{"engine": "sim", "count": 2, "sim": {"ttft_ms": 5, "tokens_per_s": 200}}],
            }
        ],
        "health": {"interval_s": 0.2},
        "batch": {
            "files_dir": str(files_dir),
            "max_file_bytes": MAX_FILE_BYTES,
            "poll_s": 0.2,
            "lease_s": 5,
            "concurrency": 8,
            "completion_windows": ["24h", "3s"],
        },
    }


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("gw")
    with gateway_process(config(tmp / "files"), tmp) as gw:
        yield gw


@pytest.fixture
def client(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


@pytest.fixture
def other(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=OTHER_KEY, max_retries=0, timeout=30)


def chat_line(custom_id: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"item {custom_id}"}], "max_tokens": max_tokens}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {**body, **extra}}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def upload(client: openai.OpenAI, data: bytes) -> str:
    return client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch").id


def wait_for(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [orjson.loads(line) for line in client.files.content(file_id).content.splitlines() if line]


def assert_usage_is_the_outputs(batch: Any, outputs: list[dict[str, Any]]) -> None:
    answered = [o["response"]["body"]["usage"] for o in outputs]
    assert batch.usage is not None
    assert batch.usage.input_tokens == sum(u["prompt_tokens"] for u in answered) > 0
    assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in answered) > 0
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    assert batch.usage.input_tokens_details.cached_tokens == 0
    assert batch.usage.output_tokens_details.reasoning_tokens == 0


def assert_other_traffic_works(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.choices[0].message.content


def test_upload_create_poll_download(client: openai.OpenAI) -> None:
    items = [chat_line(f"req-{i}") for i in range(20)]
    # One item the replica refuses (an unknown model): recorded as its answer, in the error file.
    items.append({**chat_line("bad-model"), "body": {"model": "nope", "messages": [{"role": "user", "content": "x"}]}})
    data = jsonl(items)
    uploaded = client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")
    assert uploaded.object == "file" and uploaded.purpose == "batch" and uploaded.bytes == len(data)
    assert client.files.retrieve(uploaded.id).filename == "input.jsonl"
    assert client.files.content(uploaded.id).content == data

    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.object == "batch" and batch.status == "in_progress"
    assert batch.metadata == {"job": "nightly"}
    assert batch.request_counts is not None and batch.request_counts.total == 21
    assert batch.expires_at == batch.created_at + 24 * 3600

    done = wait_for(client, batch.id, {"completed", "failed"})
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (21, 20, 1)
    assert done.in_progress_at is not None and done.finalizing_at is not None and done.completed_at is not None

    outputs = lines_of(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == sorted(f"req-{i}" for i in range(20))
    for line in outputs:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"]
        assert response["body"]["object"] == "chat.completion"
        assert response["body"]["usage"]["completion_tokens"] == 4
    errors = lines_of(client, done.error_file_id)
    assert [e["custom_id"] for e in errors] == ["bad-model"]
    assert errors[0]["response"]["status_code"] == 404
    assert errors[0]["response"]["body"]["error"]["code"] == "model_not_found"
    # The batch is named for its first item's model; its usage is its answered items'.
    assert done.model == MODEL
    assert_usage_is_the_outputs(done, outputs)

    listed = client.batches.list(limit=100)
    assert done.id in [b.id for b in listed.data]
    deleted = client.files.delete(uploaded.id)
    assert deleted.deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_items_pass_the_request_path_as_their_tenant(client: openai.OpenAI, gateway: GatewayProcess) -> None:
    """Items are counted in the gateway's own metrics, as the tenant's, in the batch band's header."""
    batch_id = client.batches.create(
        input_file_id=upload(client, jsonl([chat_line(f"m-{i}") for i in range(5)])),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    ).id
    assert wait_for(client, batch_id, {"completed", "failed"}).status == "completed"
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert 'fleetgate_batch_items_total{outcome="completed"}' in metrics
    logs = [orjson.loads(line) for line in gateway.stdout().splitlines() if line.startswith("{")]
    items = [line for line in logs if str(line.get("request_id", "")).startswith(batch_id)]
    assert len(items) == 5
    assert {line.get("tenant") for line in items} == {"t1"}


def test_cancel(client: openai.OpenAI) -> None:
    # Long items (200 tokens at 200 tokens/s: a second each), 8 at a time: cancelled mid-way.
    items = [chat_line(f"c-{i}", max_tokens=200, ignore_eos=True) for i in range(40)]
    batch = client.batches.create(
        input_file_id=upload(client, jsonl(items)), endpoint="/v1/chat/completions", completion_window="24h"
    )
    time.sleep(1.5)
    running = client.batches.retrieve(batch.id)
    assert running.status == "in_progress" and running.usage is not None
    assert running.request_counts is not None
    # Live: 200 completion tokens per item answered so far (ignore_eos), counted as they end.
    assert running.usage.output_tokens == 200 * running.request_counts.completed
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_for(client, batch.id, {"cancelled"})
    assert done.cancelled_at is not None and done.cancelling_at is not None
    counts = done.request_counts
    assert counts is not None and counts.total == 40
    outputs = lines_of(client, done.output_file_id) if done.output_file_id else []
    errors = lines_of(client, done.error_file_id)
    assert counts.completed == len(outputs) and counts.failed == len(errors)
    assert len(outputs) + len(errors) == 40
    assert 0 < len(outputs) < 40
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert {o["custom_id"] for o in outputs}.isdisjoint(e["custom_id"] for e in errors)
    assert_usage_is_the_outputs(done, outputs)


def test_completion_window_expires(client: openai.OpenAI) -> None:
    items = [chat_line(f"e-{i}", max_tokens=200, ignore_eos=True) for i in range(40)]
    batch = client.batches.create(
        input_file_id=upload(client, jsonl(items)),
        endpoint="/v1/chat/completions",
        completion_window="3s",  # type: ignore[arg-type]  # allowed by this gateway's settings
    )
    done = wait_for(client, batch.id, {"expired", "completed"}, timeout=30)
    assert done.status == "expired" and done.expired_at is not None
    outputs = lines_of(client, done.output_file_id)
    errors = lines_of(client, done.error_file_id)
    assert 0 < len(outputs) < 40 and len(outputs) + len(errors) == 40
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert all(e["response"] is None for e in errors)


def test_validation_failures_name_their_lines(client: openai.OpenAI) -> None:
    lines = [
        chat_line("a"),
        chat_line("a"),  # duplicate custom_id
        {**chat_line("b"), "method": "GET"},
        {**chat_line("c"), "url": "/v1/images/generations"},  # not served
        {**chat_line("d"), "url": "/v1/embeddings"},  # served, but not this batch's endpoint
        chat_line("e", stream=True),
    ]
    batch = client.batches.create(
        input_file_id=upload(client, jsonl(lines)), endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.errors is not None and batch.errors.data is not None
    found = [(e.line, e.code) for e in batch.errors.data]
    assert found == [
        (2, "duplicate_custom_id"),
        (3, "invalid_method"),
        (4, "invalid_url"),
        (5, "mismatched_endpoint"),
        (6, "invalid_request"),
    ]
    assert client.batches.retrieve(batch.id).status == "failed"
    assert_other_traffic_works(client)


def test_hostile_uploads(client: openai.OpenAI) -> None:
    malformed = jsonl([chat_line("ok")]) + b'{"custom_id": "x", "method": \n'
    with pytest.raises(openai.BadRequestError) as bad:
        upload(client, malformed)
    assert bad.value.code == "invalid_jsonl" and "Line 2" in str(bad.value.message)
    with pytest.raises(openai.APIStatusError) as big:
        upload(client, b"x" * (MAX_FILE_BYTES + 1))
    assert big.value.status_code == 413 and "200000-byte" in str(big.value.message)
    file_id = upload(client, jsonl([chat_line("ok")]))
    with pytest.raises(openai.BadRequestError) as endpoint:
        client.batches.create(input_file_id=file_id, endpoint="/v1/images", completion_window="24h")  # type: ignore[arg-type]
    assert endpoint.value.param == "endpoint"
    with pytest.raises(openai.BadRequestError) as window:
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="1h")  # type: ignore[arg-type]
    assert window.value.param == "completion_window"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nothere", endpoint="/v1/chat/completions", completion_window="24h")
    too_many = jsonl([chat_line(f"n-{i}") for i in range(3)])
    assert len(too_many) < MAX_FILE_BYTES
    assert_other_traffic_works(client)


def test_tenant_isolation(client: openai.OpenAI, other: openai.OpenAI) -> None:
    file_id = upload(client, jsonl([chat_line("mine")]))
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (
        lambda: other.files.retrieve(file_id),
        lambda: other.files.content(file_id),
        lambda: other.files.delete(file_id),
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
        lambda: other.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in other.batches.list().data]
    assert file_id not in [f.id for f in other.files.list().data]
    assert file_id in [f.id for f in client.files.list().data]


def test_responses_items_are_not_stored(client: openai.OpenAI) -> None:
    line = {
        "custom_id": "r-1",
        "method": "POST",
        "url": "/v1/responses",
        "body": {"model": MODEL, "input": "hello", "max_output_tokens": 4},
    }
    batch = client.batches.create(
        input_file_id=upload(client, jsonl([line])), endpoint="/v1/responses", completion_window="24h"
    )
    done = wait_for(client, batch.id, {"completed", "failed"})
    [output] = lines_of(client, done.output_file_id)
    body = output["response"]["body"]
    assert output["response"]["status_code"] == 200 and body["object"] == "response"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(body["id"])
