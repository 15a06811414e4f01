"""The exact cache through the gateway: hits, replay shapes, Cache-Control, isolation,
coalescing, and entries shared through a real Redis by separate gateway processes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.integration.harness import (
    API_KEY,
    OTHER_KEY,
    access_lines,
    gateway_process,
    in_process_gateway,
    sim_upstream,
    sim_upstream_engine,
    tenants,
)
from tests.integration.redis_server import RedisServer

MODEL = "m"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def config(url: str, **cache: Any) -> dict[str, Any]:
    return {
        "models": [{"name": MODEL, "replicas": [{"url": url}]}],
        "tenants": [{**t, "cache": cache} for t in tenants()],
    }


def client(url: str, key: str = API_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=20)


async def test_deterministic_request_hits_and_replays_in_both_shapes(tmp_path: Path) -> None:
    async with sim_upstream_engine(MODEL) as (up, engine), in_process_gateway(config(up), tmp_path) as (url, _, _):
        c = client(url)
        first = await c.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12
        )
        assert first.headers["x-fleetgate-cache"] == "miss"
        live = first.parse()
        await asyncio.sleep(0.05)  # the store runs after the response

        again = await c.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12
        )
        assert again.headers["x-fleetgate-cache"] == "exact"
        hit = again.parse()
        assert hit.choices[0].message.content == live.choices[0].message.content
        assert hit.usage == live.usage
        assert hit.id != live.id
        assert engine.submitted == 1

        # the same answer, streamed: parsed by the SDK exactly like a live stream
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [ch async for ch in stream]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == (
            live.choices[0].message.content
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].usage == live.usage
        assert engine.submitted == 1


async def test_live_stream_is_stored_and_replayed_as_json(tmp_path: Path) -> None:
    async with sim_upstream_engine(MODEL) as (up, engine), in_process_gateway(config(up), tmp_path) as (url, _, _):
        c = client(url)
        stream = await c.completions.create(model=MODEL, prompt="Once", temperature=0, max_tokens=6, stream=True)
        text = "".join([ch.choices[0].text async for ch in stream])
        await asyncio.sleep(0.05)
        raw = await c.completions.with_raw_response.create(model=MODEL, prompt="Once", temperature=0, max_tokens=6)
        assert raw.headers["x-fleetgate-cache"] == "exact"
        reply = raw.parse()
        assert reply.choices[0].text == text
        assert reply.usage is not None and reply.usage.completion_tokens == 6
        assert engine.submitted == 1


async def test_sampled_requests_are_not_cached(tmp_path: Path) -> None:
    async with sim_upstream_engine(MODEL) as (up, engine), in_process_gateway(config(up), tmp_path) as (url, _, _):
        c = client(url)
        for _ in range(2):
            raw = await c.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=3)
            assert raw.headers["x-fleetgate-cache"] == "miss"
            await asyncio.sleep(0.05)
        assert engine.submitted == 2


async def test_cache_control_no_cache_and_no_store(tmp_path: Path) -> None:
    async with sim_upstream_engine(MODEL) as (up, engine), in_process_gateway(config(up), tmp_path) as (url, _, _):
        c = client(url)
        args: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 3}
        await c.chat.completions.create(**args, extra_headers={"Cache-Control": "no-store"})
        await asyncio.sleep(0.05)
        raw = await c.chat.completions.with_raw_response.create(**args)
        assert raw.headers["x-fleetgate-cache"] == "miss"  # the no-store answer was not kept
        await asyncio.sleep(0.05)
        raw = await c.chat.completions.with_raw_response.create(**args, extra_headers={"Cache-Control": "no-cache"})
        assert raw.headers["x-fleetgate-cache"] == "miss"  # stored now, but no-cache skips the lookup
        raw = await c.chat.completions.with_raw_response.create(**args)
        assert raw.headers["x-fleetgate-cache"] == "exact"
        assert engine.submitted == 3


async def test_tenants_never_share_entries(tmp_path: Path) -> None:
    async with sim_upstream(MODEL) as up, in_process_gateway(config(up), tmp_path) as (url, _, _):
        args: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 3}
        await client(url, API_KEY).chat.completions.create(**args)
        await asyncio.sleep(0.05)
        other = await client(url, OTHER_KEY).chat.completions.with_raw_response.create(**args)
        assert other.headers["x-fleetgate-cache"] == "miss"
        mine = await client(url, API_KEY).chat.completions.with_raw_response.create(**args)
        assert mine.headers["x-fleetgate-cache"] == "exact"


async def test_identical_concurrent_requests_go_upstream_once(tmp_path: Path) -> None:
    async with sim_upstream_engine(MODEL, ttft_ms=300) as (up, engine):
        async with in_process_gateway(config(up), tmp_path) as (url, _, access):
            c = client(url)
            args: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 5}

            async def plain() -> str:
                r = await c.chat.completions.create(**args)
                return r.choices[0].message.content or ""

            async def streamed() -> str:
                s = await c.chat.completions.create(**args, stream=True)
                return "".join([ch.choices[0].delta.content or "" async for ch in s])

            answers = await asyncio.gather(*(plain() for _ in range(6)), *(streamed() for _ in range(2)))
            assert engine.submitted == 1
            assert len(set(answers)) == 1 and answers[0]
            caches = sorted(line.get("replica", "-") for line in access_lines(access))
            assert caches.count("m-0") == 1  # one request reached the replica


async def test_a_follower_that_leaves_does_not_disturb_the_leader(tmp_path: Path) -> None:
    async with sim_upstream_engine(MODEL, ttft_ms=400) as (up, engine):
        async with in_process_gateway(config(up), tmp_path) as (url, _, _):
            c = client(url)
            args: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 5}
            leader = asyncio.create_task(c.chat.completions.create(**args))
            await asyncio.sleep(0.1)
            follower = asyncio.create_task(c.chat.completions.create(**args))
            await asyncio.sleep(0.1)
            follower.cancel()
            reply = await leader
            assert reply.choices[0].message.content
            assert engine.submitted == 1


@pytest.mark.redis
def test_two_gateway_processes_share_entries_through_redis(tmp_path: Path, redis_server: RedisServer) -> None:
    """Two real `fleetgate serve` processes, one real redis-server, managed simulated replicas."""
    cfg = {
        "redis_url": redis_server.url,
        "models": [{"name": MODEL, "replicas": [{"engine": "sim", "sim": {"ttft_ms": 1, "tokens_per_s": 1000}}]}],
        "tenants": [{**t, "cache": {"ttl_s": 60}} for t in tenants()],
    }
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 4}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with gateway_process(cfg, tmp_path / "a") as a:
        first = httpx.post(f"{a.url}/v1/chat/completions", json=body, headers=auth)
        assert first.headers["x-fleetgate-cache"] == "miss"
        time.sleep(0.2)
        with gateway_process(cfg, tmp_path / "b") as b:
            second = httpx.post(f"{b.url}/v1/chat/completions", json=body, headers=auth)
            assert second.headers["x-fleetgate-cache"] == "exact"
            assert second.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    # a gateway restart keeps the entries (they live in Redis)
    (tmp_path / "c").mkdir()
    with gateway_process(cfg, tmp_path / "c") as c:
        third = httpx.post(f"{c.url}/v1/chat/completions", json=body, headers=auth)
        assert third.headers["x-fleetgate-cache"] == "exact"


@pytest.mark.redis
async def test_entries_expire_after_the_tenant_ttl(tmp_path: Path, redis_server: RedisServer) -> None:
    async with sim_upstream(MODEL) as up:
        cfg = {**config(up, ttl_s=1), "redis_url": redis_server.url, "cache": {"coalesce_linger_s": 0}}
        async with in_process_gateway(cfg, tmp_path) as (url, _, _):
            c = client(url)
            args: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 3}
            await c.chat.completions.create(**args)
            await asyncio.sleep(0.1)
            raw = await c.chat.completions.with_raw_response.create(**args)
            assert raw.headers["x-fleetgate-cache"] == "exact"
            await asyncio.sleep(1.2)
            raw = await c.chat.completions.with_raw_response.create(**args)
            assert raw.headers["x-fleetgate-cache"] == "miss"


@pytest.mark.redis
async def test_redis_down_means_uncached_not_failed(tmp_path: Path, redis_server: RedisServer) -> None:
    async with sim_upstream_engine(MODEL) as (up, engine):
        cfg = {**config(up), "redis_url": redis_server.url, "cache": {"coalesce_linger_s": 0}}
        async with in_process_gateway(cfg, tmp_path) as (url, _, _):
            c = client(url)
            args: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 3}
            redis_server.kill()
            started = time.monotonic()
            for _ in range(5):
                raw = await c.chat.completions.with_raw_response.create(**args)
                assert raw.headers["x-fleetgate-cache"] == "miss"
            assert time.monotonic() - started < 3.0
            assert engine.submitted == 5
            redis_server.start()
            # The breaker half-opens after its cool-down (2 s) and the cache works again.
            deadline = time.monotonic() + 15
            result = "miss"
            while result != "exact" and time.monotonic() < deadline:
                await c.chat.completions.create(**args)
                await asyncio.sleep(0.3)
                raw = await c.chat.completions.with_raw_response.create(**args)
                result = raw.headers["x-fleetgate-cache"]
            assert result == "exact"


async def test_a_coalesced_plain_request_waiting_past_the_keepalive_interval_gets_plain_json(tmp_path: Path) -> None:
    # The follower waits ~1 s behind the leader, five keep-alive intervals: keep-alives are
    # for streaming clients only; a JSON client must get one clean JSON response.
    async with sim_upstream_engine(MODEL, ttft_ms=1000) as (up, engine):
        cfg = {**config(up), "upstream": {"keepalive_interval_s": 0.2}}
        async with in_process_gateway(cfg, tmp_path) as (url, _, _):
            body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 5}
            auth = {"Authorization": f"Bearer {API_KEY}"}
            async with httpx.AsyncClient(base_url=url, headers=auth, timeout=20) as http:
                leader = asyncio.create_task(http.post("/v1/chat/completions", json=body))
                await asyncio.sleep(0.1)
                follower = await http.post("/v1/chat/completions", json=body)
                first = await leader
            assert engine.submitted == 1
            for reply in (first, follower):
                assert reply.status_code == 200
                assert reply.headers["content-type"].startswith("application/json")
                assert reply.json()["object"] == "chat.completion"
            assert follower.headers["x-fleetgate-cache"] == "exact"
            assert follower.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]


async def test_a_leader_refused_before_going_upstream_leaves_no_flight_behind(tmp_path: Path) -> None:
    # Each of these registers as its flight's leader, then is refused before reaching a
    # replica: a bad deadline header (400), a full tenant queue (429).
    async with sim_upstream_engine(MODEL, ttft_ms=500) as (up, engine):
        cfg = {
            **config(up),
            "cache": {"coalesce_linger_s": 0},
            "upstream": {"first_byte_timeout_s": 60},
            "models": [{"name": MODEL, "replicas": [{"url": up}], "capacity": {"max_requests": 1}}],
            "routing": {"queue": {"max_queue_length": 1}},
        }
        async with in_process_gateway(cfg, tmp_path) as (url, gw, _):
            coalescer = gw.cache.coalescer
            auth = {"Authorization": f"Bearer {API_KEY}"}
            body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 3}
            async with httpx.AsyncClient(base_url=url, headers=auth, timeout=30) as http:
                bad = await http.post("/v1/chat/completions", json=body, headers={"x-fleetgate-timeout-ms": "soon"})
                assert bad.status_code == 400
                assert len(coalescer) == 0
                started = time.monotonic()
                good = await http.post("/v1/chat/completions", json=body)
                assert good.status_code == 200 and good.headers["x-fleetgate-cache"] == "miss"
                assert time.monotonic() - started < 30  # not the 60 s wait for a leader that never comes

                # The pool's one slot taken and one request queued: a third request (cacheable,
                # a prompt of its own) leads its flight, then is refused 429 queue_full.
                def other(i: int) -> dict[str, Any]:
                    return {**body, "messages": [{"role": "user", "content": f"question {i}"}]}

                held = [asyncio.create_task(http.post("/v1/chat/completions", json=other(i))) for i in range(2)]
                while sum(gw.router.depths()[MODEL].values()) < 1:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
                full = await http.post("/v1/chat/completions", json=other(2))
                assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
                assert all(r.status_code == 200 for r in await asyncio.gather(*held))
                assert len(coalescer) == 0
            assert engine.submitted == 3
