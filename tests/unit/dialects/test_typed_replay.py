"""Replay of Responses and Messages answers: JSON and typed SSE events, validated by the
``openai`` and ``anthropic`` SDKs' own types, inverse of collection, and read by the SDKs over
HTTP exactly like the simulator's live answers (a stand-in gateway on loopback answers from
an entry collected off the simulator's live stream, as the gateway collects it)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pydantic
import pytest
from aiohttp import web
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent

from dialects.answer import Answers, CachedCompletion
from dialects.anthropic import MessagesScanner
from dialects.anthropic_answers import MESSAGES_ANSWERS
from dialects.responses import ResponsesScanner
from dialects.responses_answers import RESPONSES_ANSWERS
from dialects.stream import TypedEventScanner
from replicas.launcher import free_port
from sim.engine import FixedRateConfig, FixedRateEngine
from sim.server import create_app as create_sim_app

ANSWERS: dict[str, Answers] = {"responses": RESPONSES_ANSWERS, "messages": MESSAGES_ANSWERS}

MODEL = "sim-model"
TEXT = "The quick brown fox jumps."
CALL = {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city":"Oslo"}'}
RESPONSE_ENTRY = CachedCompletion(
    "responses", MODEL, "", "completed", 12, 9, output=({"type": "message", "text": TEXT}, CALL)
)
TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo", "days": [1, 2]}}
MESSAGE_ENTRY = CachedCompletion(
    "messages", MODEL, "", "tool_use", 12, 9, output=({"type": "text", "text": TEXT}, TOOL_USE)
)
REQUEST = {"model": MODEL, "input": "weather?", "instructions": "Be brief.", "temperature": 0, "max_output_tokens": 30}

ResponseEvents: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
MessageEvents: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(RawMessageStreamEvent)


def typed_events(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    """Each event's ``event:`` name and data."""
    out = []
    for block in data.split(b"\n\n"):
        if block:
            head, _, payload = block.partition(b"\n")
            assert head.startswith(b"event: ") and payload.startswith(b"data: ")
            out.append((head[len(b"event: ") :].decode(), orjson.loads(payload[len(b"data: ") :])))
    return out


def collect(kind: str, data: bytes, chunk: int = 11) -> CachedCompletion | None:
    scanner: TypedEventScanner = ResponsesScanner() if kind == "responses" else MessagesScanner()
    collector = ANSWERS[kind].collector(100_000)
    for i in range(0, len(data), chunk):
        out, _ = scanner.feed(data[i : i + chunk])
        collector.feed(out)
    assert scanner.done
    return collector.result(scanner.usage, scanner.final)


# -- Responses ---------------------------------------------------------------------------------


def test_response_json_is_an_sdk_response() -> None:
    body = RESPONSES_ANSWERS.replay_json(RESPONSE_ENTRY, completion_id="resp_x", created=7, request=REQUEST)
    reply = Response.model_validate_json(body)  # strict: every required field, every type
    assert (reply.id, reply.created_at, reply.status, reply.model) == ("resp_x", 7, "completed", MODEL)
    assert reply.output_text == TEXT and reply.instructions == "Be brief." and reply.temperature == 0.0
    message, call = reply.output
    assert message.type == "message" and message.id.startswith("msg_") and message.status == "completed"
    assert call.type == "function_call" and (call.call_id, call.name, call.arguments) == (
        "call_1",
        "weather",
        CALL["arguments"],
    )
    assert call.id is not None and call.id.startswith("fc_") and call.id != message.id
    assert reply.usage is not None and (
        reply.usage.input_tokens,
        reply.usage.output_tokens,
        reply.usage.total_tokens,
    ) == (12, 9, 21)
    assert RESPONSES_ANSWERS.from_json(body) == RESPONSE_ENTRY  # replay and entry are inverses


def test_response_echoes_the_request_not_the_cache() -> None:
    # metadata, user and previous_response_id are not in the key: the request answered is the one echoed.
    sent = {**REQUEST, "metadata": {"a": "1"}, "previous_response_id": "resp_prev"}
    mine = RESPONSES_ANSWERS.replay_object(RESPONSE_ENTRY, completion_id="resp_x", created=7, request=sent)
    bare = RESPONSES_ANSWERS.replay_object(RESPONSE_ENTRY, completion_id="resp_x", created=7, request={"input": "x"})
    assert (mine["metadata"], mine["previous_response_id"]) == ({"a": "1"}, "resp_prev")
    assert (bare["metadata"], bare["previous_response_id"]) == (None, None)
    assert (bare["temperature"], bare["tool_choice"], bare["tools"], bare["max_output_tokens"]) == (
        1.0,
        "auto",
        [],
        None,
    )
    incomplete = CachedCompletion("responses", MODEL, "", "incomplete", 1, 1, output=({"type": "message", "text": ""},))
    body = Response.model_validate(RESPONSES_ANSWERS.replay_object(incomplete, completion_id="resp_y", created=7))
    assert body.incomplete_details is not None and body.incomplete_details.reason == "max_output_tokens"
    assert body.output[0].type == "message" and body.output[0].content == []


def test_response_events_are_sdk_events_in_vllms_order() -> None:
    data = RESPONSES_ANSWERS.replay_sse(
        RESPONSE_ENTRY, completion_id="resp_x", created=7, include_usage=False, request=REQUEST
    )
    events = typed_events(data)
    parsed = [ResponseEvents.validate_python(payload) for _, payload in events]
    assert [name for name, _ in events] == [e.type for e in parsed]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    kinds = [e.type for e in parsed]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 5,  # "The", " quick", " brown", " fox", " jumps."
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert parsed[0].response.status == "in_progress" and parsed[0].response.output == []
    final = parsed[-1].response
    assert final == Response.model_validate_json(
        RESPONSES_ANSWERS.replay_json(RESPONSE_ENTRY, completion_id="resp_x", created=7, request=REQUEST)
    )
    assert "".join(e.delta for e in parsed if e.type == "response.output_text.delta") == TEXT
    assert collect("responses", data) == RESPONSE_ENTRY
    assert RESPONSES_ANSWERS.replay_events(
        RESPONSE_ENTRY, completion_id="resp_x", created=7, include_usage=True, request=REQUEST
    ) == [b + b"\n\n" for b in data.split(b"\n\n")[:-1]]


# -- Messages ----------------------------------------------------------------------------------


def test_message_json_is_an_sdk_message() -> None:
    body = MESSAGES_ANSWERS.replay_json(MESSAGE_ENTRY, completion_id="msg_x", created=7)
    reply = Message.model_validate_json(body)
    assert (reply.id, reply.role, reply.stop_reason, reply.stop_sequence) == ("msg_x", "assistant", "tool_use", None)
    text, tool = reply.content
    assert text.type == "text" and text.text == TEXT
    assert tool.type == "tool_use" and (tool.id, tool.name, tool.input) == ("toolu_1", "weather", TOOL_USE["input"])
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (12, 9)
    assert MESSAGES_ANSWERS.from_json(body) == MESSAGE_ENTRY


def test_message_events_are_sdk_events() -> None:
    data = MESSAGES_ANSWERS.replay_sse(MESSAGE_ENTRY, completion_id="msg_x", created=7, include_usage=False)
    events = typed_events(data)
    parsed = [MessageEvents.validate_python(payload) for _, payload in events]
    assert [name for name, _ in events] == [e.type for e in parsed]
    assert [e.type for e in parsed] == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 5,
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert parsed[0].message.usage.input_tokens == 12 and parsed[0].message.content == []
    assert parsed[-2].delta.stop_reason == "tool_use" and parsed[-2].usage.output_tokens == 9
    assert collect("messages", data) == MESSAGE_ENTRY
    stopped = CachedCompletion(
        "messages", MODEL, "", "stop_sequence", 1, 1, output=({"type": "text", "text": "a"},), stop_sequence="END"
    )
    assert (
        collect("messages", MESSAGES_ANSWERS.replay_sse(stopped, completion_id="msg_y", created=7, include_usage=False))
        == stopped
    )


def test_new_ids_look_like_the_apis() -> None:
    assert RESPONSES_ANSWERS.new_id(bytes(16)) == "resp_" + "00" * 16
    assert MESSAGES_ANSWERS.new_id().startswith("msg_") and len(MESSAGES_ANSWERS.new_id()) == 4 + 32


# -- the SDKs read a replay exactly like a live answer -----------------------------------------


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
    """A stand-in gateway answering every request from ``entries`` by kind."""

    async def answer(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        kind = "responses" if request.path == "/v1/responses" else "messages"
        entry, rid = entries[kind], ANSWERS[kind].new_id()
        if body.get("stream"):
            sse = ANSWERS[kind].replay_sse(
                entry, completion_id=rid, created=1_700_000_000, include_usage=True, request=body
            )
            return web.Response(body=sse, content_type="text/event-stream")
        whole = ANSWERS[kind].replay_json(entry, completion_id=rid, created=1_700_000_000, request=body)
        return web.Response(body=whole, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/responses", answer)
    app.router.add_post("/v1/messages", answer)
    return app


async def collect_live(base: str, path: str, kind: str, body: dict[str, Any]) -> CachedCompletion:
    """What the gateway's proxy would collect from the simulator's live stream."""
    scanner: TypedEventScanner = ResponsesScanner() if kind == "responses" else MessagesScanner()
    collector = ANSWERS[kind].collector(100_000)
    async with aiohttp.ClientSession() as session, session.post(base + path, json={**body, "stream": True}) as resp:
        async for chunk in resp.content.iter_any():
            out, _ = scanner.feed(chunk)
            collector.feed(out)
    entry = collector.result(scanner.usage, scanner.final)
    assert entry is not None
    return entry


def declared(value: Any) -> Any:
    """An SDK object as the fields its type declares that are set (vLLM adds extensions of
    its own, and leaves out some fields newer SDKs declare)."""
    if isinstance(value, pydantic.BaseModel):
        fields = {name: getattr(value, name, None) for name in type(value).model_fields}
        return {name: declared(v) for name, v in fields.items() if v is not None}
    if isinstance(value, list):
        return [declared(v) for v in value]
    return value


def covers(replayed: Any, live: Any) -> bool:
    """Whether the replay has every field of the live answer, with a value of the same type."""
    if isinstance(live, dict):
        return isinstance(replayed, dict) and all(k in replayed and covers(replayed[k], v) for k, v in live.items())
    if isinstance(live, list):
        return isinstance(replayed, list) and len(replayed) == len(live) and all(map(covers, replayed, live))
    return type(replayed) is type(live)


@pytest.fixture
async def upstreams() -> AsyncIterator[tuple[str, str, dict[str, CachedCompletion]]]:
    engine = FixedRateEngine(FixedRateConfig(ttft_s=0.001, tokens_per_s=5000))
    entries: dict[str, CachedCompletion] = {}
    async with serve(create_sim_app(engine, MODEL)) as live, serve(replay_app(entries)) as replay:
        yield live, replay, entries


def squeeze(kinds: list[str]) -> list[str]:
    """Event types with runs of deltas as one (a live stream sends one per token, a replay one per word)."""
    return [k for i, k in enumerate(kinds) if not (k.endswith("delta") and i and kinds[i - 1] == k)]


@pytest.mark.parametrize("forced_call", [False, True])
async def test_openai_sdk_reads_a_responses_replay_like_live(
    upstreams: tuple[str, str, dict[str, CachedCompletion]], forced_call: bool
) -> None:
    live, replay, entries = upstreams
    request: dict[str, Any] = {"model": MODEL, "input": "tell me", "temperature": 0, "max_output_tokens": 12}
    if forced_call:
        tool = {
            "type": "function",
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }
        request |= {"tools": [tool], "tool_choice": "required", "max_output_tokens": 50}
    entries["responses"] = await collect_live(live, "/v1/responses", "responses", request)

    async def read(base: str) -> tuple[list[Any], Any, Any]:
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as client:
            events = [e async for e in await client.responses.create(**request, stream=True)]
            async with client.responses.stream(**request) as stream:  # the SDK's accumulating reader
                async for _ in stream:
                    pass
                accumulated = await stream.get_final_response()
            whole = await client.responses.create(**request)
            return events, accumulated, whole

    (live_events, live_acc, live_whole), (events, acc, whole) = await read(live), await read(replay)
    assert squeeze([e.type for e in events]) == squeeze([e.type for e in live_events])
    assert {type(e) for e in events} == {type(e) for e in live_events}
    for reply, live_reply in ((events[-1].response, live_events[-1].response), (acc, live_acc), (whole, live_whole)):
        assert covers(declared(reply), declared(live_reply))
        assert reply.output_text == live_reply.output_text
        assert reply.usage is not None and live_reply.usage is not None
        counts = (reply.usage.input_tokens, reply.usage.output_tokens, reply.usage.total_tokens)
        assert counts == (live_reply.usage.input_tokens, live_reply.usage.output_tokens, live_reply.usage.total_tokens)
        assert reply.status == live_reply.status == ("completed" if forced_call else "incomplete")
        assert reply.id != live_reply.id and reply.id.startswith("resp_")
    if forced_call:
        call, live_call = whole.output[0], live_whole.output[0]
        assert call.type == live_call.type == "function_call"
        assert (call.name, call.arguments) == (live_call.name, live_call.arguments)
        assert acc.output[0].arguments == call.arguments
    else:
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == live_whole.output_text


@pytest.mark.parametrize("forced_call", [False, True])
async def test_anthropic_sdk_reads_a_messages_replay_like_live(
    upstreams: tuple[str, str, dict[str, CachedCompletion]], forced_call: bool
) -> None:
    live, replay, entries = upstreams
    request: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 12,
        "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}],
    }
    if forced_call:
        tool = {
            "name": "weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }
        request |= {"tools": [tool], "tool_choice": {"type": "any"}, "max_tokens": 50}
    entries["messages"] = await collect_live(live, "/v1/messages", "messages", request)

    # This anthropic SDK takes no temperature argument: it goes in the body as an extra.
    args = {k: v for k, v in request.items() if k != "temperature"} | {"extra_body": {"temperature": 0}}

    async def read(base: str) -> tuple[list[Any], Any, Any]:
        async with anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0) as client:
            events = [e async for e in await client.messages.create(**args, stream=True)]
            async with client.messages.stream(**args) as stream:
                accumulated = await stream.get_final_message()
            whole = await client.messages.create(**args)
            return events, accumulated, whole

    (live_events, live_acc, live_whole), (events, acc, whole) = await read(live), await read(replay)
    assert squeeze([e.type for e in events]) == squeeze([e.type for e in live_events])
    assert covers(declared(whole), declared(live_whole))
    for reply, live_reply in ((acc, live_acc), (whole, live_whole)):
        # Block for block the same, but a tool_use's id: the replay's is the cached answer's.
        ids = [getattr(b, "id", None) for b in reply.content]
        live_blocks = [declared(b) | ({"id": i} if i else {}) for b, i in zip(live_reply.content, ids, strict=True)]
        assert [declared(b) for b in reply.content] == live_blocks
        assert reply.stop_reason == live_reply.stop_reason == ("tool_use" if forced_call else "max_tokens")
        assert (reply.usage.input_tokens, reply.usage.output_tokens) == (
            live_reply.usage.input_tokens,
            live_reply.usage.output_tokens,
        )
        assert reply.id.startswith("msg_")
    if forced_call:
        assert acc.content[0].type == whole.content[0].type == "tool_use"
        assert acc.content[0].input == whole.content[0].input == live_whole.content[0].input
    else:
        assert acc.content[0].text == whole.content[0].text == live_whole.content[0].text
