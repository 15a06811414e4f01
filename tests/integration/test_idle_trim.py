"""The gateway releases memory once per idle period (server.memory_trim_idle_s), never while
a stream is in flight: a real gateway on this loop and the simulator."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from aiohttp import ClientSession

from tests.integration.harness import API_KEY, in_process_gateway, sim_upstream

MODEL = "idle-model"


async def _releases_reach(caplog: pytest.LogCaptureFixture, count: int, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while len(_releases(caplog)) < count:
        assert time.monotonic() < deadline, f"only {len(_releases(caplog))} releases, expected {count}"
        await asyncio.sleep(0.1)


def _releases(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.message == "idle: memory released"]


async def test_memory_is_released_once_per_idle_period_and_never_mid_stream(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="common.idle_trim")
    async with sim_upstream(MODEL, tokens_per_s=2) as upstream:
        config = {
            "models": [{"name": MODEL, "replicas": [{"url": upstream}]}],
            "server": {"memory_trim_idle_s": 1.0},
        }
        async with in_process_gateway(config, tmp_path) as (url, _, _), ClientSession() as http:
            await _releases_reach(caplog, 1)  # the start-up's idle period
            await asyncio.sleep(3)
            assert len(_releases(caplog)) == 1  # still idle: no second release

            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
            auth = {"Authorization": f"Bearer {API_KEY}"}
            async with http.post(f"{url}/v1/chat/completions", json=body, headers=auth) as r:
                assert r.status == 200
                opened = time.time()
                await r.read()  # 8 tokens at 2 per second: about 4 s in flight
                closed = time.time()
            assert closed - opened > 2.5
            await _releases_reach(caplog, 2)  # the idle period after the stream
            await asyncio.sleep(3)
    releases = _releases(caplog)
    assert len(releases) == 2
    # Not while the stream was open; the second one at least 1 s after it closed.
    assert not any(opened <= r.created <= closed for r in releases)
    assert releases[1].created >= closed + 1.0
    assert all(r.__dict__["duration_ms"] >= 0 for r in releases)
