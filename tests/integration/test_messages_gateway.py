"""Anthropic's ``/v1/messages`` through the gateway, driven by the official ``anthropic`` SDK
against the simulator: whole and streamed answers, ``count_tokens``, keys sent as Anthropic's
SDK and Claude Code send them, errors in Anthropic's shape with the status codes its SDK maps
to its exception classes, model aliases, and limits settled on the stream's real usage."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from aiohttp import web

from tests.integration.harness import (
    API_KEY,
    access_lines,
    in_process_gateway,
    serve_app,
    sim_upstream,
    tenants,
)

MODEL = "sim-model"
ALIAS = "claude-sonnet-4-5"


def config(url: str, **extra: Any) -> dict[str, Any]:
    people = [{**t, "model_aliases": {ALIAS: MODEL}} if t["id"] == "t1" else t for t in tenants()]
    return {"models": [{"name": MODEL, "replicas": [{"url": url}]}], "tenants": people, **extra}


@contextlib.asynccontextmanager
async def gateway(tmp_path: Path, **extra: Any) -> AsyncIterator[tuple[str, Any, Any]]:
    async with sim_upstream(MODEL) as sim, in_process_gateway(config(sim, **extra), tmp_path) as (url, gw, access):
        yield url, gw, access


def client(url: str, **kwargs: Any) -> anthropic.AsyncAnthropic:
    kwargs.setdefault("api_key", API_KEY)
    return anthropic.AsyncAnthropic(base_url=url, max_retries=0, timeout=20, **kwargs)


async def test_messages_create_and_stream_with_the_sdk(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (url, gw, access):
        c = client(url)
        reply = await c.messages.create(
            model=MODEL,
            max_tokens=7,
            system="Be brief.",
            messages=[{"role": "user", "content": "Say hello"}],
        )
        assert reply.content[0].type == "text" and reply.content[0].text
        assert reply.stop_reason == "max_tokens"
        assert reply.usage.output_tokens == 7 and reply.usage.input_tokens > 0
        async with c.messages.stream(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Count"}]
        ) as stream:
            pieces = [text async for text in stream.text_stream]
            final = await stream.get_final_message()
        assert len(pieces) == final.usage.output_tokens == 5
        assert "".join(pieces) == final.content[0].text  # type: ignore[union-attr]
        gw.access_log.flush()
        whole, streamed = access_lines(access)[-2:]
        assert whole["endpoint"] == streamed["endpoint"] == "messages"
        assert (whole["prompt_tokens"], whole["completion_tokens"]) == (reply.usage.input_tokens, 7)
        assert (streamed["prompt_tokens"], streamed["completion_tokens"]) == (final.usage.input_tokens, 5)
        assert gw.metrics.tokens.labels("t1", MODEL, "completion")._value.get() == 12  # each counted once


async def test_count_tokens_and_the_keys_claude_code_sends(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (url, _, _):
        counted = await client(url).messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "How many tokens is this?"}]
        )
        assert counted.input_tokens > 0
        # Claude Code with ANTHROPIC_AUTH_TOKEN sends a bearer token, not x-api-key.
        bearer = client(url, api_key=None, auth_token=API_KEY)
        reply = await bearer.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert reply.usage.output_tokens == 2


async def test_anthropic_headers_pass_through_to_the_replica(tmp_path: Path) -> None:
    seen: list[dict[str, str]] = []

    async def messages(request: web.Request) -> web.Response:
        seen.append({k.lower(): v for k, v in request.headers.items()})
        body = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": MODEL,
            "content": [{"type": "text", "text": "ok"}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 3, "output_tokens": 1},
        }
        return web.json_response(body)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    app.router.add_get("/health", health)
    async with serve_app(app) as upstream, in_process_gateway(config(upstream), tmp_path) as (url, _, _):
        sent = {"anthropic-version": "2023-06-01", "anthropic-beta": "tools-2024-04-04"}
        await client(url, default_headers=sent).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert seen and seen[0]["anthropic-version"] == "2023-06-01"
    assert seen[0]["anthropic-beta"] == "tools-2024-04-04"
    assert "x-api-key" not in seen[0] and "authorization" not in seen[0]  # the client's key stays here


async def test_errors_come_in_anthropics_shape_and_classes(tmp_path: Path) -> None:
    limits = {"requests_per_minute": 1}
    people = [{**t, "limits": limits} for t in tenants()]
    async with gateway(tmp_path) as (url, _, _):
        with pytest.raises(anthropic.AuthenticationError) as bad_key:
            await client(url, api_key="sk-wrong").messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
        assert bad_key.value.body == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "Incorrect API key provided."},
        }
        with pytest.raises(anthropic.NotFoundError):
            await client(url).messages.create(model="nope", max_tokens=2, messages=[{"role": "user", "content": "x"}])
        with pytest.raises(anthropic.BadRequestError) as bad:
            await client(url).messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "x"}])
        assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    async with (
        sim_upstream(MODEL) as sim,
        in_process_gateway(config(sim, tenants=people), tmp_path / "l") as (
            url,
            _,
            _,
        ),
    ):
        c = client(url)
        await c.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
        with pytest.raises(anthropic.RateLimitError) as limited:
            await c.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
        assert int(limited.value.response.headers["retry-after"]) >= 1
        assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]


async def test_model_aliases_map_to_a_fleet_model_per_tenant(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (url, _, _):
        reply = await client(url).messages.create(
            model=ALIAS, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.model == MODEL
        async with httpx.AsyncClient(base_url=url) as http:
            mine = (await http.get("/v1/models", headers={"x-api-key": API_KEY})).json()
            theirs = (await http.get("/v1/models", headers={"Authorization": "Bearer sk-test-other"})).json()
        assert ALIAS in [m["id"] for m in mine["data"]]
        assert ALIAS not in [m["id"] for m in theirs["data"]]
        listed = await client(url).models.list()  # Anthropic's SDK reads the same list
        assert ALIAS in [m.id for m in listed.data]
        with pytest.raises(anthropic.NotFoundError):  # another tenant's alias means nothing
            await client(url, api_key="sk-test-other").messages.create(
                model=ALIAS, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )


async def test_a_broken_stream_ends_with_anthropics_error_event(tmp_path: Path) -> None:
    """The replica dies mid-stream: the client's SDK raises on the ``error`` event."""

    async def messages(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        start = {
            "type": "message_start",
            "message": {"id": "m", "content": [], "model": MODEL, "usage": {"input_tokens": 3, "output_tokens": 0}},
        }
        await response.write(b"event: message_start\ndata: " + orjson.dumps(start) + b"\n\n")
        block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        await response.write(b"event: content_block_start\ndata: " + orjson.dumps(block) + b"\n\n")
        delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}}
        await response.write(b"event: content_block_delta\ndata: " + orjson.dumps(delta) + b"\n\n")
        assert request.transport is not None
        request.transport.close()  # cut, no message_stop
        return response

    async def health(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    app.router.add_get("/health", health)
    async with serve_app(app) as upstream, in_process_gateway(config(upstream), tmp_path) as (url, _, _):
        c = client(url)
        with pytest.raises(anthropic.APIStatusError) as broken:
            async with c.messages.stream(
                model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}]
            ) as stream:
                async for _ in stream.text_stream:
                    pass
        assert broken.value.body["error"]["type"] == "api_error"  # type: ignore[index]
