"""The exact cache for the Responses API and Anthropic Messages, through an in-process
gateway in front of the simulator, driven by the official ``openai`` and ``anthropic`` SDKs:
hits in both shapes, an entry filled by a stream answering a JSON request, coalescing,
sampled requests left uncached, and a stored Responses hit that a ``previous_response_id``
continues."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from sim.engine import FixedRateEngine
from tests.integration.harness import API_KEY, in_process_gateway, sim_upstream_engine, tenants

MODEL = "m"
QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
# The store runs after the response has gone out.
STORED_S = 0.05


def config(url: str) -> dict[str, Any]:
    return {"models": [{"name": MODEL, "replicas": [{"url": url}]}], "tenants": [{**t, "cache": {}} for t in tenants()]}


@contextlib.asynccontextmanager
async def gateway(
    tmp_path: Path, ttft_ms: float = 5
) -> AsyncIterator[tuple[FixedRateEngine, openai.AsyncOpenAI, anthropic.AsyncAnthropic]]:
    """A gateway in front of the simulator; its engine counts the upstream calls."""
    async with (
        sim_upstream_engine(MODEL, ttft_ms) as (up, engine),
        in_process_gateway(config(up), tmp_path) as (url, _, _),
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=20) as oc,
        anthropic.AsyncAnthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=20) as ac,
    ):
        yield engine, oc, ac


def greedy(**fields: Any) -> dict[str, Any]:
    """A Messages request at temperature 0 (this anthropic SDK takes no temperature argument)."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "extra_body": {"temperature": 0},
    } | fields


# -- Responses ---------------------------------------------------------------------------------


async def test_a_responses_request_is_answered_from_the_cache_in_both_shapes(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (engine, c, _):
        args: dict[str, Any] = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 12}
        first = await c.responses.with_raw_response.create(**args)
        assert first.headers["x-fleetgate-cache"] == "miss"
        live = first.parse()
        await asyncio.sleep(STORED_S)

        again = await c.responses.with_raw_response.create(**args)
        assert again.headers["x-fleetgate-cache"] == "exact"
        hit = again.parse()
        assert hit.output_text == live.output_text and hit.output_text
        assert hit.status == live.status == "incomplete"  # cut by max_output_tokens: kept, like chat's "length"
        assert hit.usage is not None and live.usage is not None
        assert (hit.usage.input_tokens, hit.usage.output_tokens) == (live.usage.input_tokens, 12)
        assert hit.id != live.id and hit.id.startswith("resp_") and len(hit.id) == len("resp_") + 32
        assert engine.submitted == 1

        raw = await c.responses.with_raw_response.create(**args, stream=True)
        assert raw.headers["x-fleetgate-cache"] == "exact"
        events = [event async for event in raw.parse()]
        kinds = [event.type for event in events]
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert kinds[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert [event.sequence_number for event in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == live.output_text
        final = events[-1].response
        assert final.output_text == live.output_text and final.usage == hit.usage
        assert engine.submitted == 1


async def test_a_streamed_function_call_fills_the_entry_a_json_request_hits(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (engine, c, _):
        args: dict[str, Any] = {
            "model": MODEL,
            "input": "Weather in Paris?",
            "temperature": 0,
            "tools": [{"type": "function", "name": "weather", "parameters": WEATHER}],
            "tool_choice": "required",
        }
        async with c.responses.stream(**args) as stream:
            async for _ in stream:
                pass
            live = await stream.get_final_response()
        await asyncio.sleep(STORED_S)
        raw = await c.responses.with_raw_response.create(**args)
        assert raw.headers["x-fleetgate-cache"] == "exact"
        hit = raw.parse()
        call, live_call = hit.output[0], live.output[0]
        assert call.type == live_call.type == "function_call"
        assert (call.call_id, call.name, call.arguments) == (live_call.call_id, live_call.name, live_call.arguments)
        assert hit.status == "completed" and engine.submitted == 1


async def test_a_stored_cached_response_is_kept_under_its_new_id_and_continued(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (engine, c, _):
        args: dict[str, Any] = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 6}
        await c.responses.create(**args)  # store defaults to true
        await asyncio.sleep(STORED_S)

        raw = await c.responses.with_raw_response.create(**args)
        assert raw.headers["x-fleetgate-cache"] == "exact"
        hit = raw.parse()
        kept = await c.responses.retrieve(hit.id)  # kept before the client saw the answer
        assert kept.id == hit.id and kept.output_text == hit.output_text
        follow = await c.responses.create(
            model=MODEL, input="And of Spain?", previous_response_id=hit.id, temperature=0, max_output_tokens=4
        )
        assert follow.usage is not None and hit.usage is not None
        # The next turn's replica read the cached turn too: its input and its (replayed) output.
        assert follow.usage.input_tokens > hit.usage.input_tokens + hit.usage.output_tokens
        assert follow.previous_response_id == hit.id

        stream = await c.responses.create(**args, stream=True)
        events = [event async for event in stream]
        streamed = events[-1].response
        assert streamed.id != hit.id and (await c.responses.retrieve(streamed.id)).output_text == hit.output_text
        assert engine.submitted == 2  # the first answer and the follow-up

        unkept = await c.responses.create(**args, store=False)  # the same entry; store is not in the key
        assert unkept.output_text == hit.output_text and engine.submitted == 2
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(unkept.id)


async def test_identical_responses_requests_in_flight_go_upstream_once(tmp_path: Path) -> None:
    async with gateway(tmp_path, ttft_ms=300) as (engine, c, _):
        args: dict[str, Any] = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 5}

        async def plain() -> str:
            return str((await c.responses.create(**args)).output_text)

        async def streamed() -> str:
            stream = await c.responses.create(**args, stream=True)
            return "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])

        answers = await asyncio.gather(*(plain() for _ in range(4)), *(streamed() for _ in range(2)))
        assert engine.submitted == 1
        assert len(set(answers)) == 1 and answers[0]


async def test_sampled_responses_and_messages_requests_are_not_cached(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (engine, oc, ac):
        for _ in range(2):
            raw = await oc.responses.with_raw_response.create(model=MODEL, input=QUESTION, max_output_tokens=3)
            assert raw.headers["x-fleetgate-cache"] == "miss"
            # Anthropic's API has no seed: a seeded Messages request still samples.
            args = greedy(max_tokens=3, extra_body={"seed": 7})
            message = await ac.messages.with_raw_response.create(**args)
            assert message.headers["x-fleetgate-cache"] == "miss"
            await asyncio.sleep(STORED_S)
        assert engine.submitted == 4


# -- Messages ----------------------------------------------------------------------------------


async def test_a_messages_request_is_answered_from_the_cache_in_both_shapes(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (engine, _, c):
        first = await c.messages.with_raw_response.create(**greedy(max_tokens=12))
        assert first.headers["x-fleetgate-cache"] == "miss"
        live = await first.parse()
        await asyncio.sleep(STORED_S)

        again = await c.messages.with_raw_response.create(**greedy(max_tokens=12))
        assert again.headers["x-fleetgate-cache"] == "exact"
        hit = await again.parse()
        assert hit.content == live.content and hit.stop_reason == live.stop_reason == "max_tokens"
        assert (hit.usage.input_tokens, hit.usage.output_tokens) == (live.usage.input_tokens, 12)
        assert hit.id != live.id and hit.id.startswith("msg_")
        assert engine.submitted == 1

        raw = await c.messages.with_raw_response.create(**greedy(max_tokens=12), stream=True)
        assert raw.headers["x-fleetgate-cache"] == "exact"
        kinds = [event.type async for event in await raw.parse()]
        assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
        async with c.messages.stream(**greedy(max_tokens=12)) as stream:
            pieces = [text async for text in stream.text_stream]
            final = await stream.get_final_message()
        assert "".join(pieces) == live.content[0].text
        assert final.content[0].text == live.content[0].text  # type: ignore[union-attr]
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
        assert engine.submitted == 1


async def test_a_streamed_tool_use_fills_the_entry_a_json_messages_request_hits(tmp_path: Path) -> None:
    async with gateway(tmp_path) as (engine, _, c):
        args = greedy(
            max_tokens=60,
            tools=[{"name": "weather", "input_schema": WEATHER}],
            tool_choice={"type": "any"},
        )
        async with c.messages.stream(**args) as stream:
            live = await stream.get_final_message()
        assert live.stop_reason == "tool_use"
        await asyncio.sleep(STORED_S)
        raw = await c.messages.with_raw_response.create(**args)
        assert raw.headers["x-fleetgate-cache"] == "exact"
        hit = await raw.parse()
        call, live_call = hit.content[0], live.content[0]
        assert call.type == live_call.type == "tool_use" and hit.stop_reason == "tool_use"
        assert (call.id, call.name, call.input) == (live_call.id, live_call.name, live_call.input)
        assert set(call.input) == {"city"}
        assert engine.submitted == 1


async def test_identical_messages_requests_in_flight_go_upstream_once(tmp_path: Path) -> None:
    async with gateway(tmp_path, ttft_ms=300) as (engine, _, c):

        async def plain() -> str:
            message = await c.messages.create(**greedy(max_tokens=5))
            return str(message.content[0].text)

        async def streamed() -> str:
            async with c.messages.stream(**greedy(max_tokens=5)) as stream:
                return "".join([text async for text in stream.text_stream])

        answers = await asyncio.gather(*(plain() for _ in range(4)), *(streamed() for _ in range(2)))
        assert engine.submitted == 1
        assert len(set(answers)) == 1 and answers[0]
