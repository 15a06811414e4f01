"""Retries, mid-stream failures, keep-alives, timeouts and client disconnects.

The failing upstreams are ``FaultyUpstream`` (see the harness: a real vLLM cannot fail on
cue); healthy ones are the real simulator. The gateway runs in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp
import openai
import pytest

from common.breaker import BreakerConfig
from gateway.app import Gateway
from tests.integration.harness import (
    API_KEY,
    FaultyUpstream,
    access_lines,
    in_process_gateway,
    serve_app,
    sim_upstream,
)

MODEL = "m"
MESSAGES = [{"role": "user", "content": "hi"}]


def config(*urls: str, **upstream: object) -> dict[str, object]:
    return {
        "models": [{"name": MODEL, "replicas": [{"url": u} for u in urls]}],
        "upstream": {"max_attempts": 3, **upstream},
        # a breaker that never opens keeps the faulty replica in rotation for the test
        "health": {"interval_s": 0.1, "breaker_failures": 1000},
    }


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=20)


def pin_first(gateway: Gateway, replica_index: int) -> None:
    """Make the least-outstanding choice prefer one replica (the others look busier)."""
    for i, r in enumerate(gateway.fleet.by_model[MODEL]):
        r.outstanding_tokens = 0 if i == replica_index else 10**6


async def test_non_streaming_retried_on_5xx(tmp_path: Path) -> None:
    bad = FaultyUpstream(MODEL, "500")
    async with serve_app(bad.app()) as bad_url, sim_upstream(MODEL) as good_url:
        async with in_process_gateway(config(bad_url, good_url), tmp_path) as (url, gw, access):
            pin_first(gw, 0)
            reply = await client(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
            assert reply.usage is not None and reply.usage.completion_tokens == 3
            assert bad.hits == 1
            assert access_lines(access)[-1]["attempts"] == 2


async def test_stream_retried_when_failure_precedes_first_byte(tmp_path: Path) -> None:
    bad = FaultyUpstream(MODEL, "500")
    async with serve_app(bad.app()) as bad_url, sim_upstream(MODEL) as good_url:
        async with in_process_gateway(config(bad_url, good_url), tmp_path) as (url, gw, _):
            pin_first(gw, 0)
            stream = await client(url).chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=4, stream=True
            )
            chunks = [c async for c in stream]
            assert chunks[-1].choices[0].finish_reason == "length"
            assert bad.hits == 1


async def test_all_replicas_failing_is_502(tmp_path: Path) -> None:
    a, b = FaultyUpstream(MODEL, "500"), FaultyUpstream(MODEL, "500")
    async with serve_app(a.app()) as ua, serve_app(b.app()) as ub:
        async with in_process_gateway(config(ua, ub), tmp_path) as (url, _, _):
            with pytest.raises(openai.APIStatusError) as info:
                await client(url).chat.completions.create(model=MODEL, messages=MESSAGES)
            assert info.value.status_code == 502
            assert a.hits + b.hits == 2  # each replica tried once, no more


async def test_cut_stream_ends_with_error_event(tmp_path: Path) -> None:
    bad = FaultyUpstream(MODEL, "drop")
    async with serve_app(bad.app()) as bad_url:
        async with in_process_gateway(config(bad_url), tmp_path) as (url, _, access):
            stream = await client(url).chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
            got: list[str] = []
            with pytest.raises(openai.APIError, match=r"ended the stream early|broke"):
                async for chunk in stream:
                    got.append(chunk.choices[0].delta.content or "")
            assert got == ["one", " two"]  # what arrived was relayed, then the error
            assert access_lines(access)[-1]["error"] == "upstream_stream_error"


async def test_an_event_that_never_ends_is_cut_with_error(tmp_path: Path) -> None:
    """A replica that keeps sending one event without ever ending it (no blank line): the
    stream is cut past the scanner's bound, not held in the gateway's memory to the end."""
    bad = FaultyUpstream(MODEL, "endless_event")
    async with serve_app(bad.app()) as bad_url:
        async with in_process_gateway(config(bad_url), tmp_path) as (url, _, access):
            stream = await client(url).chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
            got: list[str] = []
            with pytest.raises(openai.APIError, match="event longer than"):
                async for chunk in stream:
                    got.append(chunk.choices[0].delta.content or "")
            assert got == ["one"]
            await asyncio.sleep(0.2)
            assert access_lines(access)[-1]["error"] == "upstream_stream_error"


async def test_stall_between_chunks_is_cut_with_error(tmp_path: Path) -> None:
    """Silent past the chunk gap on a replica nothing vouches for (not probed): cut there."""
    bad = FaultyUpstream(MODEL, "stall_mid", delay=5.0)
    async with serve_app(bad.app()) as bad_url:
        cfg = config(bad_url, chunk_gap_timeout_s=0.3)
        cfg["models"] = [{"name": MODEL, "replicas": [{"url": bad_url, "probe": "none"}]}]
        async with in_process_gateway(cfg, tmp_path) as (url, gw, access):
            loop = asyncio.get_running_loop()
            started = loop.time()
            stream = await client(url).chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
            with pytest.raises(openai.APIError, match="sent nothing"):
                async for _ in stream:
                    pass
            assert loop.time() - started < 3.0
            await asyncio.sleep(0.1)
            assert access_lines(access)[-1]["cut"] == "chunk_gap"
            assert gw.metrics.sample("fleetgate_stream_cuts_total", model=MODEL, reason="chunk_gap") == 1


async def test_silence_on_a_replica_its_probes_vouch_for_waits_up_to_the_stall_timeout(tmp_path: Path) -> None:
    """The same silence on a replica whose /health answers: not cut at the gap (merely
    slow), but at ``stall_timeout_s``, the bound on any silence."""
    bad = FaultyUpstream(MODEL, "stall_mid", delay=5.0)
    async with serve_app(bad.app()) as bad_url:
        cfg = config(bad_url, chunk_gap_timeout_s=0.3, stall_timeout_s=1.0)
        async with in_process_gateway(cfg, tmp_path) as (url, gw, access):
            loop = asyncio.get_running_loop()
            started = loop.time()
            stream = await client(url).chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
            with pytest.raises(openai.APIError, match="stall_timeout_s"):
                async for _ in stream:
                    pass
            assert 1.0 <= loop.time() - started < 3.0
            await asyncio.sleep(0.1)
            assert access_lines(access)[-1]["cut"] == "stall_timeout"
            assert gw.metrics.sample("fleetgate_stream_cuts_total", model=MODEL, reason="stall_timeout") == 1


async def test_a_silence_shorter_than_the_stall_timeout_is_waited_out(tmp_path: Path) -> None:
    """Silent for three chunk gaps on a replica its probes vouch for, then the rest: whole."""
    slow = FaultyUpstream(MODEL, "stall_mid", delay=1.0)
    async with serve_app(slow.app()) as slow_url:
        async with in_process_gateway(config(slow_url, chunk_gap_timeout_s=0.3), tmp_path) as (url, gw, access):
            stream = await client(url).chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
            assert [c.choices[0].delta.content async for c in stream] == ["one"]
            await asyncio.sleep(0.1)
            assert "cut" not in access_lines(access)[-1]
            assert gw.metrics.sample("fleetgate_stream_cuts_total", model=MODEL, reason="stall_timeout") == 0


async def test_keepalive_comments_while_waiting_for_first_token(tmp_path: Path) -> None:
    slow = FaultyUpstream(MODEL, "stall_first", delay=0.8)
    async with serve_app(slow.app()) as slow_url:
        async with in_process_gateway(config(slow_url, keepalive_interval_s=0.2), tmp_path) as (url, _, _):
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"{url}/v1/chat/completions",
                    json={"model": MODEL, "messages": MESSAGES, "stream": True},
                    headers={"Authorization": f"Bearer {API_KEY}"},
                ) as resp,
            ):
                raw = await resp.read()
            assert resp.status == 200
            assert raw.count(b": keep-alive\n\n") >= 2
            assert raw.index(b": keep-alive") < raw.index(b"data: ")
            assert raw.endswith(b"data: [DONE]\n\n")
            # and the SDK reads such a stream normally
            stream = await client(url).chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
            assert [c.choices[0].delta.content async for c in stream] == ["one"]


async def test_first_byte_timeout_retries_then_504(tmp_path: Path) -> None:
    slow = FaultyUpstream(MODEL, "stall_first", delay=5.0)
    async with serve_app(slow.app()) as slow_url:
        cfg = config(slow_url, first_byte_timeout_s=0.3, keepalive_interval_s=10)
        async with in_process_gateway(cfg, tmp_path) as (url, _, _):
            with pytest.raises(openai.APIStatusError) as info:
                stream = await client(url).chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
                async for _ in stream:
                    pass
            assert info.value.status_code == 504


async def test_client_disconnect_cancels_upstream(tmp_path: Path) -> None:
    slow = FaultyUpstream(MODEL, "slow_stream")
    async with serve_app(slow.app()) as slow_url:
        async with in_process_gateway(config(slow_url), tmp_path) as (url, gw, access):
            async with aiohttp.ClientSession() as session:
                resp = await session.post(
                    f"{url}/v1/chat/completions",
                    json={"model": MODEL, "messages": MESSAGES, "stream": True},
                    headers={"Authorization": f"Bearer {API_KEY}"},
                )
                await resp.content.readuntil(b"\n\n")
                resp.close()  # the client walks away mid-stream
            await asyncio.wait_for(slow.disconnected.wait(), timeout=2.0)
            replica = gw.fleet.by_model[MODEL][0]
            for _ in range(50):
                if replica.outstanding_requests == 0:
                    break
                await asyncio.sleep(0.02)
            assert (replica.outstanding_requests, replica.outstanding_tokens) == (0, 0)
            with contextlib.suppress(IndexError):
                assert access_lines(access)[-1]["status"] == 499


async def test_no_healthy_replica_is_503(tmp_path: Path) -> None:
    async with sim_upstream(MODEL) as good:
        async with in_process_gateway(config(good), tmp_path) as (url, gw, _):
            breaker = gw.fleet.by_model[MODEL][0].breaker
            breaker.config = BreakerConfig(failures=1, cooldown_s=60)
            breaker.record_failure(gw.clock())
            with pytest.raises(openai.APIStatusError) as info:
                await client(url).chat.completions.create(model=MODEL, messages=MESSAGES)
            assert info.value.status_code == 503
            assert info.value.code == "no_healthy_replica"


async def test_upstream_4xx_passed_through(tmp_path: Path) -> None:
    async with sim_upstream("other-name") as good:
        async with in_process_gateway(config(good), tmp_path) as (url, _, _):
            with pytest.raises(openai.NotFoundError):
                await client(url).chat.completions.create(model=MODEL, messages=MESSAGES)


async def test_breaker_ejects_a_failing_replica(tmp_path: Path) -> None:
    bad = FaultyUpstream(MODEL, "500")
    async with serve_app(bad.app()) as bad_url, sim_upstream(MODEL) as good_url:
        cfg = config(bad_url, good_url)
        cfg["health"] = {"interval_s": 0.1, "breaker_failures": 2, "breaker_cooldown_s": 60}
        async with in_process_gateway(cfg, tmp_path) as (url, gw, _):
            c = client(url)
            for _ in range(10):
                pin_first(gw, 0)
                await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
            assert bad.hits == 2  # after two failures the breaker keeps it out
