"""The request path through ``Gateway.handle`` and its stages, without a server or a replica.

Requests are aiohttp's mocked requests; the fleet's managed replicas are never started, so
a request that passes every stage before ``forward`` ends there with 503
``no_healthy_replica`` and no attempt.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any
from unittest import mock

import orjson
from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from dialects.answer import CachedCompletion
from dialects.openai import CHAT
from dialects.responses import RESPONSES_API
from gateway.app import Gateway
from gateway.settings import Settings, hash_key

KEY = "sk-test"
MODEL = "m"


def settings(**tenant: Any) -> Settings:
    return Settings.model_validate(
        {
            "models": [{"name": MODEL, "replicas": [{"engine": "sim", "count": 1}], "max_model_len": 100}],
            "tenants": [{"id": "t", "api_keys": [f"sha256:{hash_key(KEY)}"], **tenant}],
        }
    )


def gateway(tmp_path: Path, **tenant: Any) -> tuple[Gateway, io.BytesIO]:
    log = io.BytesIO()
    return Gateway(settings(**tenant), log_dir=tmp_path, access_stream=log), log


def request(body: dict[str, Any], key: str | None = KEY, **headers: str) -> web.Request:
    raw = orjson.dumps(body)
    payload = StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())
    payload.feed_data(raw)
    payload.feed_eof()
    sent = CIMultiDict(headers)
    if key is not None:
        sent["Authorization"] = f"Bearer {key}"
    sent["Content-Length"] = str(len(raw))
    return make_mocked_request("POST", CHAT.path, headers=sent, payload=payload)


def chat(content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def error(response: web.StreamResponse) -> dict[str, Any]:
    assert isinstance(response, web.Response) and isinstance(response.body, bytes)
    parsed: dict[str, Any] = orjson.loads(response.body)["error"]
    return parsed


def logged(log: io.BytesIO, gw: Gateway) -> list[dict[str, Any]]:
    gw.access_log.flush()
    return [orjson.loads(line) for line in log.getvalue().splitlines()]


def test_the_path_is_declared_in_order(tmp_path: Path) -> None:
    gw, _ = gateway(tmp_path)
    names = [stage.name for stage in gw.paths[CHAT]]
    assert names == ["authenticate", "parse", "classify", "admit", "look_up_cache", "queue", "forward"]
    # Responses recall their stored conversation before anything reads the prompt.
    names = [stage.name for stage in gw.paths[RESPONSES_API]]
    assert names == ["authenticate", "parse", "recall", "classify", "admit", "look_up_cache", "queue", "forward"]


def test_no_cache_stage_when_no_tenant_uses_the_cache(tmp_path: Path) -> None:
    gw, _ = gateway(tmp_path, cache={"enabled": False})
    assert "look_up_cache" not in [stage.name for stage in gw.paths[CHAT]]
    # A reload that turns it on for a tenant brings the stage back.
    gw.apply_tenants(
        [t.model_copy(update={"cache": t.cache.model_copy(update={"enabled": True})}) for t in gw.settings.tenants], []
    )
    assert "look_up_cache" in [stage.name for stage in gw.paths[CHAT]]


async def test_a_request_without_a_key_stops_at_authenticate(tmp_path: Path) -> None:
    gw, log = gateway(tmp_path)
    response = await gw.handle(request(chat(), key=None), CHAT)
    assert response.status == 401
    assert "x-request-id" in response.headers
    (entry,) = logged(log, gw)
    assert (entry["status"], entry["tenant"], entry["model"]) == (401, None, None)
    assert "attempts" not in entry  # never parsed
    assert gw.metrics.requests_in_flight == 0


async def test_an_unknown_model_stops_at_classify(tmp_path: Path) -> None:
    gw, log = gateway(tmp_path)
    response = await gw.handle(request(chat() | {"model": "nope"}), CHAT)
    assert response.status == 404
    assert error(response)["code"] == "model_not_found"
    assert "x-ratelimit-limit-requests" not in response.headers  # admission never ran
    (entry,) = logged(log, gw)
    assert (entry["tenant"], entry["attempts"]) == ("t", 0)


async def test_a_prompt_past_max_model_len_is_refused_before_any_replica(tmp_path: Path) -> None:
    gw, log = gateway(tmp_path, limits={"requests_per_minute": 1})
    # 320 characters: 80 tokens, + 4 for the message's framing, + 20 to generate = 104 > 100.
    response = await gw.handle(request(chat("x" * 320, max_tokens=20)), CHAT)
    assert response.status == 400
    body = error(response)
    assert (body["code"], body["param"], body["type"]) == (
        "context_length_exceeded",
        "messages",
        "invalid_request_error",
    )
    assert "maximum context length is 100 tokens" in body["message"]
    (entry,) = logged(log, gw)
    assert (entry["model"], entry["attempts"], entry["error"]) == (MODEL, 0, "context_length_exceeded")
    assert gw.pending.snapshot() == {MODEL: 0}
    # Nothing was admitted: the one request a minute is still there to take.
    fits = await gw.handle(request(chat("x" * 320, max_tokens=16)), CHAT)  # 84 + 16 = 100
    assert fits.status == 503 and error(fits)["code"] == "no_healthy_replica"


async def test_a_request_through_every_stage_reaches_the_proxy(tmp_path: Path) -> None:
    gw, log = gateway(tmp_path, limits={"requests_per_minute": 1})
    response = await gw.handle(request(chat()), CHAT)
    # No replica runs here: the last stage answers 503, after admission and a cache miss.
    assert response.status == 503
    assert error(response)["code"] == "no_healthy_replica"
    assert response.headers["x-fleetgate-cache"] == "miss"
    assert response.headers["x-fleetgate-tier"] == "default"
    refused = await gw.handle(request(chat()), CHAT)
    assert refused.status == 429  # the admit stage: one request a minute
    first, second = logged(log, gw)
    assert (first["status"], first["attempts"]) == (503, 0)
    assert second["status"] == 429


async def test_a_cached_answer_is_replayed_by_the_cache_stage(tmp_path: Path) -> None:
    gw, log = gateway(tmp_path)
    body = chat(temperature=0)
    tenant = gw.tenants["t"]
    plan = gw.cache.plan("t", MODEL, CHAT, body, tenant.cache, None)
    assert plan.key is not None
    assert await gw.cache.store(plan.key, CachedCompletion("chat", MODEL, "hello", "stop", 3, 2), tenant.cache)
    response = await gw.handle(request(body), CHAT)
    assert response.status == 200
    assert response.headers["x-fleetgate-cache"] == "exact"
    assert isinstance(response, web.Response) and isinstance(response.body, bytes)
    assert orjson.loads(response.body)["choices"][0]["message"]["content"] == "hello"
    (entry,) = logged(log, gw)
    assert (entry["status"], entry["attempts"]) == (200, 0)


async def test_a_bad_deadline_header_stops_at_queue(tmp_path: Path) -> None:
    gw, _ = gateway(tmp_path)
    response = await gw.handle(request(chat(), **{"x-fleetgate-timeout-ms": "soon"}), CHAT)
    assert response.status == 400
    assert "x-fleetgate-timeout-ms" in error(response)["message"]
    assert response.headers["x-fleetgate-cache"] == "miss"
