"""Two gateway pods share a real redis-server and a files directory; one is killed with
SIGKILL in the middle of a 1,000-item batch and the other finishes it: no item lost, none
written twice. The upstream counts what it answered per custom_id."""

from __future__ import annotations

import asyncio
import collections
import io
import signal
import time
from pathlib import Path
from typing import Any

import openai
import orjson
from aiohttp import web

from tests.integration.harness import API_KEY, GatewayProcess, _ScriptedUpstream
from tests.integration.redis_server import RedisServer
from tests.integration.test_faults import threaded

MODEL = "recorded"
ITEMS = 1000
CONCURRENCY = 8


class RecordingUpstream(_ScriptedUpstream):
    """A chat upstream that answers after ``delay`` and counts, per prompt (the item's
    custom_id), the requests it received and the answers it handed back."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.received: collections.Counter[str] = collections.Counter()
        self.answered: collections.Counter[str] = collections.Counter()
        self.headers: set[str] = set()
        self.credentials: set[str | None] = set()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        key = body["messages"][0]["content"]
        self.received[key] += 1
        self.headers.update(name.lower() for name in request.headers)
        self.credentials.add(request.headers.get("Authorization"))
        await asyncio.sleep(self.delay)  # a pod killed now cancels this handler: not answered
        self.answered[key] += 1
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        choice = {"index": 0, "message": {"role": "assistant", "content": key}, "finish_reason": "stop"}
        reply = {"id": "x", "object": "chat.completion", "created": 0, "model": MODEL, "choices": [choice]}
        return web.json_response({**reply, "usage": usage})


def pod(name: str, upstream: str, redis: RedisServer, files: Path, tmp_path: Path) -> GatewayProcess:
    config: dict[str, Any] = {
        "models": [{"name": MODEL, "replicas": [{"url": upstream}]}],
        "redis_url": redis.url,
        "health": {"interval_s": 0.2},
        "batch": {"files_dir": str(files), "lease_s": 2, "poll_s": 0.2, "concurrency": CONCURRENCY},
    }
    home = tmp_path / name
    home.mkdir()
    return GatewayProcess(config, home)


def test_a_pod_killed_mid_batch_loses_and_duplicates_nothing(redis_server: RedisServer, tmp_path: Path) -> None:
    recorder = RecordingUpstream(delay=0.03)
    files = tmp_path / "files"
    with threaded(recorder.app()) as upstream:
        a = pod("a", upstream, redis_server, files, tmp_path)
        b = pod("b", upstream, redis_server, files, tmp_path)
        a.start()
        try:
            b.start()
            try:
                client_a = openai.OpenAI(base_url=f"{a.url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
                client_b = openai.OpenAI(base_url=f"{b.url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
                lines = [
                    {
                        "custom_id": f"item-{i}",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {"model": MODEL, "messages": [{"role": "user", "content": f"item-{i}"}]},
                    }
                    for i in range(ITEMS)
                ]
                data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
                file_id = client_a.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id
                batch = client_a.batches.create(
                    input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
                )
                # Both pods take items; kill A once a fifth of the batch is done.
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    counts = client_b.batches.retrieve(batch.id).request_counts
                    assert counts is not None
                    if counts.completed >= ITEMS // 5:
                        break
                    time.sleep(0.05)
                in_flight_at_kill = sum(recorder.received.values()) - sum(recorder.answered.values())
                a.stop(signal.SIGKILL)
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    done = client_b.batches.retrieve(batch.id)
                    if done.status in ("completed", "failed", "expired"):
                        break
                    time.sleep(0.2)
                assert done.status == "completed", done
                assert done.request_counts is not None
                assert (done.request_counts.total, done.request_counts.completed) == (ITEMS, ITEMS)
                assert done.request_counts.failed == 0 and done.error_file_id is None
                assert done.output_file_id is not None
                outputs = [orjson.loads(x) for x in client_b.files.content(done.output_file_id).content.splitlines()]
            finally:
                b.stop()
        finally:
            if a.proc is not None and a.proc.poll() is None:
                a.stop()
    ids = collections.Counter(o["custom_id"] for o in outputs)
    # Exactly once in the output: every item, none twice.
    assert len(outputs) == ITEMS and set(ids) == {f"item-{i}" for i in range(ITEMS)}
    assert max(ids.values()) == 1
    for output in outputs:
        assert output["response"]["body"]["choices"][0]["message"]["content"] == output["custom_id"]
    # Both pods ran items through their request path (one access line each, the item's
    # request id "<batch>-<item>").
    ran = {name: _item_lines(gw, batch.id) for name, gw in (("a", a), ("b", b))}
    assert ran["a"] > 0 and ran["b"] > 0
    assert ran["a"] + ran["b"] >= ITEMS
    # The internal key and the band stay in the gateway.
    assert recorder.credentials == {None}
    assert "x-fleetgate-band" not in recorder.headers
    # Upstream: every item was answered. An item A had sent when it died is asked again once
    # its lease lapses (A never recorded an answer): if the replica had finished it, it ran
    # there twice, but its result is written once. So at most A's items in flight.
    assert set(recorder.answered) == set(ids)
    twice = [key for key, n in recorder.answered.items() if n > 1]
    print(
        f"items run by a: {ran['a']}, b: {ran['b']}; in flight upstream at the kill: {in_flight_at_kill}; "
        f"answered twice upstream: {len(twice)}"
    )
    assert len(twice) <= CONCURRENCY
    assert max(recorder.answered.values()) <= 2
    # Usage is counted with each result, once: an item answered twice upstream adds its
    # tokens once (3 prompt and 1 completion token per answer).
    assert done.model == MODEL and done.usage is not None
    assert (done.usage.input_tokens, done.usage.output_tokens) == (3 * ITEMS, 1 * ITEMS)
    assert done.usage.total_tokens == 4 * ITEMS


def _item_lines(gw: GatewayProcess, batch_id: str) -> int:
    lines = (orjson.loads(x) for x in gw.stdout().splitlines() if x.startswith("{"))
    return sum(1 for line in lines if str(line.get("request_id", "")).startswith(batch_id))
