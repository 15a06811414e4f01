"""Replay: cached answers re-shaped as JSON or SSE, and parsed by the openai SDK like live ones.

The SDK tests serve two tiny in-process aiohttp apps on loopback (no external service): the
real simulator, and a stand-in gateway that answers every request from a cache entry. The
entry itself is collected from the simulator's live stream, as the gateway would collect it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from dialects.answer import MAX_CHUNKS, Answers, CachedCompletion, split_text
from dialects.openai_answers import CHAT_ANSWERS, COMPLETION_ANSWERS, DONE
from dialects.stream import SseScanner
from replicas.launcher import free_port
from sim.engine import FixedRateConfig, FixedRateEngine
from sim.server import create_app as create_sim_app

ANSWERS: dict[str, Answers] = {"chat": CHAT_ANSWERS, "completion": COMPLETION_ANSWERS}

MODEL = "sim-model"
CHAT_ENTRY = CachedCompletion("chat", MODEL, "The quick brown fox jumps.", "stop", 12, 6)
COMPLETION_ENTRY = CachedCompletion("completion", MODEL, " over the lazy dog", "length", 4, 5)


def parse_sse(data: bytes) -> list[dict[str, Any] | str]:
    """Each event's JSON payload, ``"[DONE]"`` as a string."""
    out: list[dict[str, Any] | str] = []
    for block in data.split(b"\n\n"):
        if block:
            assert block.startswith(b"data: ")
            payload = block[len(b"data: ") :]
            out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


# -- pure shape tests --------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "one", "  lead and trail  ", "a\nb\n\nc", "x " * 500])
def test_split_text_keeps_every_character(text: str) -> None:
    pieces = split_text(text)
    assert "".join(pieces) == text
    assert len(pieces) <= MAX_CHUNKS


def test_chat_json_shape() -> None:
    body = orjson.loads(CHAT_ANSWERS.replay_json(CHAT_ENTRY, completion_id="chatcmpl-x", created=7))
    assert body == {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "created": 7,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "The quick brown fox jumps.", "tool_calls": []},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 12, "total_tokens": 18, "completion_tokens": 6},
    }


def test_chat_stream_events() -> None:
    events = parse_sse(CHAT_ANSWERS.replay_sse(CHAT_ENTRY, completion_id="chatcmpl-x", created=7, include_usage=True))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert all(c["id"] == "chatcmpl-x" and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    choice_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in choice_chunks) == CHAT_ENTRY.content
    assert [c["choices"][0]["finish_reason"] for c in choice_chunks] == [None] * (len(choice_chunks) - 1) + ["stop"]
    assert len(choice_chunks) == 1 + 5  # role, then "The", " quick", " brown", " fox", " jumps."
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == CHAT_ENTRY.usage


def test_usage_only_when_asked() -> None:
    events = CHAT_ANSWERS.replay_events(CHAT_ENTRY, completion_id="c", created=1, include_usage=False)
    assert events[-1] == DONE and not any(b'"usage"' in e for e in events)


def test_completion_stream_and_json() -> None:
    events = parse_sse(
        COMPLETION_ANSWERS.replay_sse(COMPLETION_ENTRY, completion_id="cmpl-x", created=7, include_usage=False)
    )
    chunks = [e for e in events if isinstance(e, dict)]
    assert "".join(c["choices"][0]["text"] for c in chunks) == COMPLETION_ENTRY.content
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[0]["object"] == "text_completion"
    body = orjson.loads(COMPLETION_ANSWERS.replay_json(COMPLETION_ENTRY, completion_id="cmpl-x", created=7))
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == COMPLETION_ENTRY.content


def test_tool_calls_and_empty_answers() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"a": 1}'}}
    entry = CachedCompletion("chat", MODEL, "", "tool_calls", 3, 4, tool_calls=(call,))
    message = orjson.loads(CHAT_ANSWERS.replay_json(entry, completion_id="c", created=1))["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"] == [call]
    data = CHAT_ANSWERS.replay_sse(entry, completion_id="c", created=1, include_usage=False)
    collector = CHAT_ANSWERS.collector(1000)
    collector.feed(data)
    assert collector.result(entry.usage) == entry  # replay and collection are inverses
    empty = CachedCompletion("chat", MODEL, "", "stop", 3, 0)
    last = [
        e
        for e in parse_sse(CHAT_ANSWERS.replay_sse(empty, completion_id="c", created=1, include_usage=False))
        if e != "[DONE]"
    ]
    assert isinstance(last[-1], dict) and last[-1]["choices"][0]["finish_reason"] == "stop"


def test_completion_ids_look_like_vllm_ones() -> None:
    assert CHAT_ANSWERS.new_id(bytes(16)) == "chatcmpl-" + "00" * 16
    assert COMPLETION_ANSWERS.new_id().startswith("cmpl-") and len(COMPLETION_ANSWERS.new_id()) == 37


# -- the openai SDK reads a replay exactly like a live stream ---------------------------------


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def replay_app(entries: dict[str, CachedCompletion]) -> web.Application:
    """A stand-in gateway answering every request from ``entries`` by endpoint kind."""

    async def answer(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        kind = "chat" if request.path.endswith("/chat/completions") else "completion"
        entry = entries[kind]
        cid, created = ANSWERS[kind].new_id(), 1_700_000_000
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            sse = ANSWERS[kind].replay_sse(entry, completion_id=cid, created=created, include_usage=usage)
            return web.Response(body=sse, content_type="text/event-stream")
        return web.Response(
            body=ANSWERS[kind].replay_json(entry, completion_id=cid, created=created), content_type="application/json"
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    app.router.add_post("/v1/completions", answer)
    return app


async def collect_live(base: str, path: str, kind: str, body: dict[str, Any]) -> CachedCompletion:
    """What the gateway's proxy would collect from a live stream (usage dropped for the client)."""
    scanner = SseScanner(drop_usage=True)
    collector = (CHAT_ANSWERS if kind == "chat" else COMPLETION_ANSWERS).collector(100_000)
    upstream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as session, session.post(base + path, json=upstream) as resp:
        async for chunk in resp.content.iter_any():
            out, _ = scanner.feed(chunk)
            collector.feed(out)
    entry = collector.result(scanner.usage)
    assert entry is not None
    return entry


def shape(value: Any) -> Any:
    """Field names and value types, recursively, without the values."""
    if isinstance(value, dict):
        return tuple(sorted((k, shape(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(shape(v) for v in value)
    return type(value).__name__


@pytest.fixture
async def upstreams() -> AsyncIterator[tuple[str, str, dict[str, CachedCompletion]]]:
    engine = FixedRateEngine(FixedRateConfig(ttft_s=0.001, tokens_per_s=5000))
    entries: dict[str, CachedCompletion] = {}
    async with serve(create_sim_app(engine, MODEL)) as live, serve(replay_app(entries)) as replay:
        yield live, replay, entries


@pytest.mark.parametrize("include_usage", [True, False])
async def test_sdk_parses_chat_replay_like_live(
    upstreams: tuple[str, str, dict[str, CachedCompletion]], include_usage: bool
) -> None:
    live, replay, entries = upstreams
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me"}],
        "max_tokens": 12,
        "seed": 1,
    }
    entries["chat"] = await collect_live(live, "/v1/chat/completions", "chat", request)

    async def read(base: str) -> list[Any]:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        async with client:
            options: Any = {"include_usage": True} if include_usage else openai.omit
            stream = await client.chat.completions.create(**request, stream=True, stream_options=options)
            return [chunk async for chunk in stream]

    live_chunks, replay_chunks = await read(live), await read(replay)
    assert {type(c) for c in replay_chunks} == {type(c) for c in live_chunks}
    assert {shape(c.model_dump()) for c in replay_chunks} == {shape(c.model_dump()) for c in live_chunks}

    def text(chunks: list[Any]) -> str:
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    assert text(replay_chunks) == text(live_chunks) and text(live_chunks)
    assert replay_chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in replay_chunks if c.choices]
    assert finishes[-1] == [c.choices[0].finish_reason for c in live_chunks if c.choices][-1] == "length"
    if include_usage:
        assert replay_chunks[-1].usage == live_chunks[-1].usage
        assert replay_chunks[-1].usage is not None and replay_chunks[-1].usage.completion_tokens == 12
    else:
        assert all(c.usage is None for c in replay_chunks + live_chunks)


async def test_sdk_parses_completion_replay_like_live(upstreams: tuple[str, str, dict[str, CachedCompletion]]) -> None:
    live, replay, entries = upstreams
    request: dict[str, Any] = {"model": MODEL, "prompt": "Once upon", "max_tokens": 9, "temperature": 0}
    entries["completion"] = await collect_live(live, "/v1/completions", "completion", request)

    async def read(base: str) -> tuple[list[Any], Any]:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        async with client:
            stream = await client.completions.create(**request, stream=True, stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            whole = await client.completions.create(**request)
            return chunks, whole

    (live_chunks, live_whole), (replay_chunks, replay_whole) = await read(live), await read(replay)
    assert {shape(c.model_dump()) for c in replay_chunks} == {shape(c.model_dump()) for c in live_chunks}
    assert "".join(c.choices[0].text for c in replay_chunks if c.choices) == live_whole.choices[0].text
    assert shape(replay_whole.model_dump()) == shape(live_whole.model_dump())
    assert replay_whole.usage == live_whole.usage and replay_whole.choices[0].text == live_whole.choices[0].text


async def test_sdk_parses_chat_json_replay_like_live(upstreams: tuple[str, str, dict[str, CachedCompletion]]) -> None:
    live, replay, entries = upstreams
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 7,
        "temperature": 0,
    }
    entries["chat"] = await collect_live(live, "/v1/chat/completions", "chat", request)
    async with openai.AsyncOpenAI(base_url=live + "/v1", api_key="x", max_retries=0) as client:
        live_reply = await client.chat.completions.create(**request)
    async with openai.AsyncOpenAI(base_url=replay + "/v1", api_key="x", max_retries=0) as client:
        replay_reply = await client.chat.completions.create(**request)
    assert shape(replay_reply.model_dump()) == shape(live_reply.model_dump())
    assert replay_reply.choices[0].message == live_reply.choices[0].message
    assert replay_reply.usage == live_reply.usage
    assert replay_reply.id != live_reply.id and replay_reply.id.startswith("chatcmpl-")
