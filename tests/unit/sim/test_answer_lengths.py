"""Answers that end on their own: the drawn length, the ``ignore_eos`` field and ``--ignore-eos``."""

from __future__ import annotations

import statistics
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from sim.answer_lengths import CHAT_ANSWERS, AnswerLengths
from sim.batched_engine import BatchedSimEngine
from sim.engine import FixedRateConfig, FixedRateEngine, SimEngine, SimRequest
from sim.server import build_engine, create_app

MODEL = "sim-model"
# What the chat template makes of one user turn "hello there" (tests/unit/sim/test_sim_apis.py).
HELLO_PROMPT = "<|user|>hello there\n<|assistant|>"
HELLO_END = CHAT_ANSWERS.end_of(HELLO_PROMPT, None)


def test_a_length_is_a_function_of_the_prompt_and_the_seed() -> None:
    lengths = AnswerLengths(median=250, sigma=0.6)
    assert lengths.end_of("a prompt", None) == lengths.end_of("a prompt", None)
    draws = {lengths.end_of("a prompt", seed) for seed in range(20)}
    assert len(draws) > 10  # the seed changes the draw
    assert lengths.end_of("a prompt", 3) == AnswerLengths(median=250, sigma=0.6).end_of("a prompt", 3)


def test_lengths_follow_the_log_normal() -> None:
    draws = sorted(CHAT_ANSWERS.end_of(f"question {i}", None) for i in range(4000))
    # Median 250; p90 = 250 x e^(1.2816 x 0.6) = 539; every draw at least one token.
    assert 235 <= statistics.median(draws) <= 265
    assert 500 <= draws[int(0.9 * len(draws))] <= 580
    assert draws[0] >= 1
    assert AnswerLengths(median=1, sigma=0).end_of("x", None) == 1


def test_bad_lengths_are_refused() -> None:
    with pytest.raises(ValueError):
        AnswerLengths(median=0.5, sigma=0.6)
    with pytest.raises(ValueError):
        AnswerLengths(median=100, sigma=-1)


async def _drain(engine: SimEngine, request: SimRequest) -> tuple[int, str | None]:
    stream = engine.submit(request)
    async for _ in stream:
        pass
    return stream.completion_tokens, stream.finish_reason


async def test_fixed_rate_answers_stop_at_the_drawn_length_within_the_limit() -> None:
    engine = FixedRateEngine(FixedRateConfig(ttft_s=0.0, tokens_per_s=1e6))
    end = CHAT_ANSWERS.end_of("why?", 7)
    assert await _drain(engine, SimRequest("a", "why?", end + 10, seed=7)) == (end, "stop")
    # The limit cuts a longer answer short; ignore_eos runs it to the limit.
    assert await _drain(engine, SimRequest("b", "why?", end - 1, seed=7)) == (end - 1, "length")
    assert await _drain(engine, SimRequest("c", "why?", end + 10, seed=7, ignore_eos=True)) == (end + 10, "length")
    ignoring = FixedRateEngine(FixedRateConfig(ttft_s=0.0, tokens_per_s=1e6, ignore_eos=True))
    assert await _drain(ignoring, SimRequest("d", "why?", end + 10, seed=7)) == (end + 10, "length")


async def test_batched_answers_stop_at_the_drawn_length_within_the_limit() -> None:
    engine = BatchedSimEngine.from_profile("h100-llama-3.1-8b", seed=0, time_scale=1000)
    lengths = engine.profile.answer_lengths
    end = lengths.end_of("why?", 7)
    assert await _drain(engine, SimRequest("a", "why?", end + 10, seed=7)) == (end, "stop")
    assert await _drain(engine, SimRequest("b", "why?", end - 1, seed=7)) == (end - 1, "length")
    assert await _drain(engine, SimRequest("c", "why?", end + 10, seed=7, ignore_eos=True)) == (end + 10, "length")
    await engine.close()
    ignoring = BatchedSimEngine.from_profile("h100-llama-3.1-8b", time_scale=1000, ignore_eos=True)
    assert await _drain(ignoring, SimRequest("d", "why?", end + 10, seed=7)) == (end + 10, "length")
    await ignoring.close()


async def _serve(engine: SimEngine) -> AsyncIterator[str]:
    server = TestServer(create_app(engine, MODEL, max_model_len=4096), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.fixture
async def sim() -> AsyncIterator[str]:
    async for url in _serve(build_engine(ttft_ms=0, tokens_per_s=1e6, profile=None, seed=0, time_scale=1)):
        yield url


@pytest.fixture
async def ignoring_sim() -> AsyncIterator[str]:
    engine = build_engine(ttft_ms=0, tokens_per_s=1e6, profile=None, seed=0, time_scale=1, ignore_eos=True)
    async for url in _serve(engine):
        yield url


async def post(url: str, path: str, body: dict[str, Any]) -> bytes:
    async with ClientSession() as http, http.post(url + path, json=body) as response:
        assert response.status == 200
        return await response.read()


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4000}


async def test_every_api_reports_a_natural_end(sim: str) -> None:
    chat = orjson.loads(await post(sim, "/v1/chat/completions", CHAT))
    assert (chat["choices"][0]["finish_reason"], chat["usage"]["completion_tokens"]) == ("stop", HELLO_END)
    messages = orjson.loads(await post(sim, "/v1/messages", CHAT))
    assert (messages["stop_reason"], messages["usage"]["output_tokens"]) == ("end_turn", HELLO_END)
    body = {"model": MODEL, "input": "hello there", "max_output_tokens": 4000}
    response = orjson.loads(await post(sim, "/v1/responses", body))
    assert (response["status"], response["usage"]["output_tokens"]) == ("completed", HELLO_END)
    streamed = (await post(sim, "/v1/messages", {**CHAT, "stream": True})).decode()
    assert '"stop_reason":"end_turn"' in streamed and "event: message_stop" in streamed


async def test_ignore_eos_runs_to_the_limit(sim: str) -> None:
    body = {**CHAT, "max_tokens": HELLO_END + 5, "ignore_eos": True}
    chat = orjson.loads(await post(sim, "/v1/chat/completions", body))
    assert (chat["choices"][0]["finish_reason"], chat["usage"]["completion_tokens"]) == ("length", HELLO_END + 5)
    body = {"model": MODEL, "input": "hello there", "max_output_tokens": HELLO_END + 5, "ignore_eos": True}
    response = orjson.loads(await post(sim, "/v1/responses", body))
    assert (response["status"], response["usage"]["output_tokens"]) == ("incomplete", HELLO_END + 5)


async def test_the_server_flag_runs_every_answer_to_the_limit(ignoring_sim: str) -> None:
    chat = orjson.loads(await post(ignoring_sim, "/v1/chat/completions", {**CHAT, "max_tokens": HELLO_END + 5}))
    assert (chat["choices"][0]["finish_reason"], chat["usage"]["completion_tokens"]) == ("length", HELLO_END + 5)
    messages = orjson.loads(await post(ignoring_sim, "/v1/messages", {**CHAT, "max_tokens": HELLO_END + 5}))
    assert (messages["stop_reason"], messages["usage"]["output_tokens"]) == ("max_tokens", HELLO_END + 5)
