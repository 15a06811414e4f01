"""Batch items meet the tenant's limits like any request: a 429 from admission hands the item
back (not a failure) and the batch still completes; ``limits.per_key.batch`` bounds batch
items alone, the tenant's own keys keep their room."""

from __future__ import annotations

import io
import time
from pathlib import Path

import httpx
import openai
import orjson

from gateway.settings import hash_key
from tests.integration.harness import API_KEY, gateway_process

MODEL = "sim-model"


def test_a_rate_limited_batch_waits_instead_of_failing(tmp_path: Path) -> None:
    tenant = {
        "id": "t1",
        "api_keys": ["sha256:" + hash_key(API_KEY)],
        # Batch items: 120 a minute, a burst of 1 (one every 0.5 s); the tenant's own keys: no bound.
        "limits": {"per_key": {"batch": {"requests_per_minute": 120, "request_burst": 1}}},
    }
    config = {
        "tenants": [tenant],
        "models": [{"name": MODEL, "replicas": [{"engine": "sim", "count": 1, "sim": {"ttft_ms": 5}}]}],
        "health": {"interval_s": 0.2},
        "batch": {"files_dir": str(tmp_path / "files"), "poll_s": 0.2, "backoff_s": 0.2, "concurrency": 4},
    }
    with gateway_process(config, tmp_path) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
        lines = [
            {
                "custom_id": f"r-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 2},
            }
            for i in range(6)
        ]
        data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
        file_id = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id
        started = time.monotonic()
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        # Meanwhile the tenant's own requests are not held to the batch key's bound.
        for _ in range(5):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired"):
            assert time.monotonic() - started < 60
            time.sleep(0.2)
        took = time.monotonic() - started
        assert batch.status == "completed"
        assert batch.request_counts is not None
        assert (batch.request_counts.completed, batch.request_counts.failed) == (6, 0)
        # Six items at one per 0.5 s after a burst of one: at least 2.5 s.
        assert took >= 2.5
        metrics = httpx.get(f"{gw.url}/metrics").text
        retried = [
            line for line in metrics.splitlines() if line.startswith('fleetgate_batch_items_total{outcome="retried"}')
        ]
        assert retried and float(retried[0].split()[-1]) > 0
