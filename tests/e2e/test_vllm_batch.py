"""End to end: the Batch API in front of real vLLM replicas on CPU, through the official SDK.

A JSONL file of chat items and one item naming a model the fleet does not serve is uploaded,
run as a batch on the shared two-replica fleet (``vllm_fleet``), and its output and error
files are read back: every item answered exactly once, the unknown model's refusal recorded
in OpenAI's shape, the counts right, and the batch's ``usage`` the sum of what vLLM reported
for each answered item.
"""

from __future__ import annotations

import collections
import io
import time
from typing import Any

import orjson
import pytest
from openai import OpenAI
from openai.types import Batch

from tests.e2e.conftest import FLEET_START_TIMEOUT_S, MODEL, E2EGateway, bounded, record_timing

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(FLEET_START_TIMEOUT_S + 120)]

ITEMS = 20
# ignore_eos: every answer is exactly TOKENS long, so the output's usage is known in advance.
TOKENS = 8
# 20 short items on two CPU replicas take a few seconds; the runner finalizes within a poll.
BATCH_TIMEOUT_S = 60.0
ENDED = {"completed", "failed", "expired", "cancelled"}


def chat_item(custom_id: str, model: str = MODEL) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"{custom_id}: say something about gateways."}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def wait_ended(client: OpenAI, batch_id: str, timeout_s: float) -> Batch:
    deadline = time.monotonic() + bounded(timeout_s)
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ENDED:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout_s:g} s: {batch}")
        time.sleep(0.25)


def lines_of(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [orjson.loads(line) for line in client.files.content(file_id).content.splitlines() if line.strip()]


def test_a_batch_runs_on_vllm_and_counts_its_usage(vllm_fleet: E2EGateway) -> None:
    client = vllm_fleet.sync_client(timeout_s=60)
    items = [chat_item(f"chat-{i}") for i in range(ITEMS)]
    items.insert(ITEMS // 2, chat_item("unknown-model", model="no-such-model"))
    data = b"".join(orjson.dumps(item) + b"\n" for item in items)

    start = time.monotonic()
    uploaded = client.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"test": "e2e"},
    )
    assert batch.status == "in_progress", batch
    done = wait_ended(client, batch.id, BATCH_TIMEOUT_S)
    record_timing(f"batch of {len(items)} items: created -> {done.status}", time.monotonic() - start)
    assert done.status == "completed", done

    outputs = lines_of(client, done.output_file_id)
    errors = lines_of(client, done.error_file_id)
    # Every custom_id exactly once across the two files.
    seen = collections.Counter(line["custom_id"] for line in outputs + errors)
    assert seen == collections.Counter(item["custom_id"] for item in items)

    assert [e["custom_id"] for e in errors] == ["unknown-model"]
    refused = errors[0]
    assert refused["error"] is None and refused["response"]["status_code"] == 404
    assert refused["response"]["request_id"] == f"{batch.id}-{ITEMS // 2}"
    error = refused["response"]["body"]["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert isinstance(error["message"], str) and "no-such-model" in error["message"]
    assert isinstance(error["type"], str)

    assert sorted(o["custom_id"] for o in outputs) == sorted(f"chat-{i}" for i in range(ITEMS))
    for line in outputs:
        response = line["response"]
        assert line["error"] is None and response["status_code"] == 200
        assert response["body"]["object"] == "chat.completion" and response["body"]["model"] == MODEL
        assert response["body"]["usage"]["completion_tokens"] == TOKENS

    counts = done.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (ITEMS + 1, ITEMS, 1)

    # The batch's model is its first item's; its usage is the sum of the answered items'.
    assert done.model == MODEL
    usage = done.usage
    assert usage is not None
    prompt = sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in outputs)
    assert usage.input_tokens == prompt > 0
    assert usage.output_tokens == ITEMS * TOKENS
    assert usage.total_tokens == prompt + ITEMS * TOKENS
    assert usage.input_tokens_details.cached_tokens == 0  # vLLM runs without prompt token details
    assert usage.output_tokens_details.reasoning_tokens == 0
    # The batch reads the same through the list.
    listed = {b.id: b for b in client.batches.list(limit=100).data}
    assert listed[batch.id].usage == usage
