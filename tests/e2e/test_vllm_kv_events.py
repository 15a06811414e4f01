"""The exact prefix index on real vLLM: one CPU replica, launched by the gateway with KV events on
(the default for a managed vLLM replica whose tokenizer the gateway has), publishes its blocks;
the gateway's index says how many of a prompt's tokens the replica holds, and that equals the
prefix-cache hits vLLM itself counts for the request (``vllm:prefix_cache_hits_total``)."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import (
    ADMIN,
    MODEL,
    E2EGateway,
    gateway_config,
    record_timing,
    run_dir,
    start_gateway,
    stop_gateway,
    vllm_replica,
)
from tests.integration.harness import API_KEY

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 240.0
# vLLM's CPU backend caches in blocks of 128 tokens: a system prompt of several blocks.
SYSTEM = " ".join(["The quick brown fox jumps over the lazy dog while the cache keeps every block."] * 40)


@pytest.fixture(scope="module")
def events_gateway(tiny_model: Path) -> Iterator[E2EGateway]:
    e2e, elapsed = start_gateway(
        gateway_config([vllm_replica(tiny_model, core=0)]), run_dir("kv-events"), START_TIMEOUT_S, every=True
    )
    record_timing("kv events: one vLLM replica healthy", elapsed)
    try:
        yield e2e
    finally:
        stop_gateway(e2e, signal.SIGTERM)


def _fleet(e2e: E2EGateway) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{e2e.url}/admin/fleet", headers=ADMIN, timeout=30).json()
    return body


def _hits(base_url: str) -> float:
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vLLM reports no vllm:prefix_cache_hits_total")


def _ask(e2e: E2EGateway, question: str) -> dict[str, Any]:
    request_id = f"kv-{uuid.uuid4().hex[:12]}"
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }
    headers = {"Authorization": f"Bearer {API_KEY}", "x-request-id": request_id}
    resp = httpx.post(f"{e2e.url}/v1/chat/completions", json=body, headers=headers, timeout=180)
    assert resp.status_code == 200, resp.text[:2000]
    line: dict[str, Any] = asyncio.run(e2e.access_line(request_id, 10.0))
    return line


def test_the_gateways_index_matches_vllms_prefix_cache_hits(events_gateway: E2EGateway) -> None:
    fleet = _fleet(events_gateway)
    ((rid, stream),) = fleet["kv_events"].items()
    base_url = next(r["url"] for r in fleet["replicas"] if r["id"] == rid)
    deadline = time.monotonic() + 60
    while not _fleet(events_gateway)["kv_events"][rid]["exact"]:
        assert time.monotonic() < deadline, f"the replica's events never became exact: {stream}"
        time.sleep(0.5)

    first = _ask(events_gateway, "What does the fox do?")
    assert first["kv_cached_tokens"] == 0  # a cold cache, read from the events
    deadline = time.monotonic() + 30
    while _fleet(events_gateway)["kv_events"][rid]["blocks"] == 0:
        assert time.monotonic() < deadline, "no BlockStored reached the gateway"
        time.sleep(0.2)

    for question in ("What does the dog do?", "What does the cache keep?"):
        before = _hits(base_url)
        line = _ask(events_gateway, question)
        hit = _hits(base_url) - before
        assert line["kv_cached_tokens"] > 0 and line["kv_cached_tokens"] % 128 == 0, line
        assert line["kv_cached_tokens"] == hit, (line["kv_cached_tokens"], hit)
        time.sleep(1.0)  # this request's own blocks reach the index before the next one
    stream = _fleet(events_gateway)["kv_events"][rid]
    assert stream["exact"] and stream["gaps"] == 0 and stream["decode_errors"] == 0 and stream["block_size"] == 128
