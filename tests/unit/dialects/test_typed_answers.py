"""Cache entries of Responses and Messages answers: from JSON, from streams, to bytes and back.

The answers here are shaped like vLLM's (and the simulator's, ``sim/responses_api.py``,
``sim/messages_api.py``); a stream goes through the gateway's own scanner first, in small
chunks, as the proxy feeds it.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from dialects.answer import FORMAT_VERSION, Answers, CachedCompletion, EntryCorrupt
from dialects.anthropic import MessagesScanner
from dialects.anthropic_answers import MESSAGES_ANSWERS
from dialects.responses import ResponsesScanner
from dialects.responses_answers import RESPONSES_ANSWERS
from dialects.stream import TypedEventScanner

ANSWERS: dict[str, Answers] = {"responses": RESPONSES_ANSWERS, "messages": MESSAGES_ANSWERS}

RESPONSES_USAGE = {
    "input_tokens": 8,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": 5,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 13,
}
CALL = {
    "arguments": '{"city": "Oslo"}',
    "call_id": "call_1",
    "name": "weather",
    "type": "function_call",
    "id": "fc_1",
    "status": "completed",
}


def typed(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def message_item(text: str) -> dict[str, Any]:
    part: dict[str, Any] = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
    return {
        "id": "msg_1",
        "content": [part] if text else [],
        "role": "assistant",
        "status": "completed",
        "type": "message",
    }


def response(output: list[dict[str, Any]], status: str = "completed", **change: Any) -> dict[str, Any]:
    return {
        "id": "resp_1",
        "created_at": 1,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": "m",
        "object": "response",
        "output": output,
        "status": status,
        "usage": RESPONSES_USAGE,
        **change,
    }


def collect(kind: str, data: bytes, *, chunk: int = 7, max_chars: int = 10_000) -> CachedCompletion | None:
    """``data`` through the dialect's scanner and the kind's collector, as the proxy does."""
    scanner: TypedEventScanner = ResponsesScanner() if kind == "responses" else MessagesScanner()
    collector = ANSWERS[kind].collector(max_chars)
    for i in range(0, len(data), chunk):
        out, _ = scanner.feed(data[i : i + chunk])
        collector.feed(out)
    if not scanner.done:
        return None  # the proxy collects only a stream that ended
    return collector.result(scanner.usage, scanner.final)


# -- Responses ---------------------------------------------------------------------------------


def test_responses_json_keeps_items_status_usage_and_model() -> None:
    body = response([message_item("Hello there"), CALL])
    entry = RESPONSES_ANSWERS.from_json(orjson.dumps(body))
    assert entry == CachedCompletion(
        "responses",
        "m",
        "",
        "completed",
        8,
        5,
        output=(
            {"type": "message", "text": "Hello there"},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Oslo"}'},
        ),
    )
    assert entry.usage == {"prompt_tokens": 8, "total_tokens": 13, "completion_tokens": 5}


def test_responses_cut_by_max_output_tokens_is_kept_like_chats_length() -> None:
    entry = RESPONSES_ANSWERS.from_json(orjson.dumps(response([message_item("Hel")], "incomplete")))
    assert entry is not None and entry.finish_reason == "incomplete"
    assert RESPONSES_ANSWERS.from_json(orjson.dumps(response([message_item("")]))) is not None  # empty text


@pytest.mark.parametrize(
    "body",
    [
        response([message_item("x")], "failed"),
        response([message_item("x")], "in_progress"),
        response([message_item("x")], "incomplete", incomplete_details={"reason": "content_filter"}),
        response([message_item("x")], error={"code": "server_error", "message": "boom"}),
        response([message_item("x")], usage=None),
        response([message_item("x")], model=None),
        response([{"type": "reasoning", "id": "rs_1", "summary": [], "content": []}, message_item("x")]),
        response([{**message_item("x"), "content": [{"type": "refusal", "refusal": "no"}]}]),
        response([{**message_item("x"), "content": [{**message_item("x")["content"][0], "annotations": [{}]}]}]),
        response([{**message_item("x"), "content": message_item("x")["content"] * 2}]),
        response([{**CALL, "arguments": None}]),
    ],
)
def test_responses_not_worth_keeping(body: dict[str, Any]) -> None:
    assert RESPONSES_ANSWERS.from_json(orjson.dumps(body)) is None


def responses_stream(final: dict[str, Any], deltas: list[str]) -> bytes:
    """A Responses stream as vLLM sends it (``sequence_number`` from 0, ``response.completed`` last)."""
    events: list[bytes] = []
    started = {**final, "status": "in_progress", "output": [], "usage": None}
    steps: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": started}),
        ("response.in_progress", {"response": started}),
        *[("response.output_text.delta", {"delta": d, "item_id": "msg_1", "output_index": 0}) for d in deltas],
        ("response.completed", {"response": final}),
    ]
    for kind, fields in steps:
        events.append(typed(kind, {**fields, "sequence_number": len(events), "type": kind}))
    return b"".join(events)


def test_responses_stream_is_read_from_its_final_response() -> None:
    final = response([message_item("Hello world"), CALL])
    data = responses_stream(final, ["Hel", "lo ", "world"])
    expected = RESPONSES_ANSWERS.from_json(orjson.dumps(final))
    assert expected is not None
    for size in (1, 7, 64, len(data)):
        assert collect("responses", data, chunk=size) == expected


def test_responses_streams_not_worth_keeping() -> None:
    data = responses_stream(response([message_item("ab")]), ["a", "b"])
    assert collect("responses", data[: data.index(b"event: response.completed")]) is None  # cut short
    failed = response([message_item("ab")], "failed")
    assert (
        collect("responses", responses_stream(failed, ["a"]).replace(b"response.completed", b"response.failed")) is None
    )
    error = typed("error", {"type": "error", "code": "upstream_stream_error", "message": "gone", "sequence_number": 3})
    assert collect("responses", data[: data.index(b"event: response.completed")] + error) is None


# -- Messages ----------------------------------------------------------------------------------


def message(content: list[dict[str, Any]], stop: str | None = "end_turn", **change: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": "m",
        "stop_reason": stop,
        "usage": {"input_tokens": 6, "output_tokens": 4},
        **change,
    }


TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}


def messages_stream(
    blocks: list[tuple[dict[str, Any], list[dict[str, Any]]]], stop: str = "end_turn", stop_sequence: str | None = None
) -> bytes:
    """A Messages stream as vLLM sends it (no ping; ``message_start``'s message without type/role)."""
    head: dict[str, Any] = {"id": "chatcmpl-1", "content": [], "model": "m", "stop_reason": None, "stop_sequence": None}
    out = typed(
        "message_start",
        {"type": "message_start", "message": {**head, "usage": {"input_tokens": 6, "output_tokens": 0}}},
    )
    for index, (opened, deltas) in enumerate(blocks):
        out += typed("content_block_start", {"type": "content_block_start", "content_block": opened, "index": index})
        for delta in deltas:
            out += typed("content_block_delta", {"type": "content_block_delta", "delta": delta, "index": index})
        out += typed("content_block_stop", {"type": "content_block_stop", "index": index})
    delta = {"stop_reason": stop, "stop_sequence": stop_sequence}
    out += typed(
        "message_delta", {"type": "message_delta", "delta": delta, "usage": {"input_tokens": 6, "output_tokens": 4}}
    )
    return out + typed("message_stop", {"type": "message_stop"})


def text_block(*pieces: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    return {"type": "text", "text": ""}, [{"type": "text_delta", "text": p} for p in pieces]


def tool_block(*pieces: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    opened = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}
    return opened, [{"type": "input_json_delta", "partial_json": p} for p in pieces]


def test_messages_json_keeps_blocks_stop_reason_and_usage() -> None:
    body = message([{"type": "text", "text": "Let me look."}, TOOL_USE], "tool_use")
    entry = MESSAGES_ANSWERS.from_json(orjson.dumps(body))
    assert entry == CachedCompletion(
        "messages", "m", "", "tool_use", 6, 4, output=({"type": "text", "text": "Let me look."}, TOOL_USE)
    )
    cached_prompt = message([], usage={"input_tokens": 2, "cache_read_input_tokens": 4, "output_tokens": 4})
    entry = MESSAGES_ANSWERS.from_json(orjson.dumps(cached_prompt))
    assert entry is not None and (entry.prompt_tokens, entry.completion_tokens) == (2 + 4, 4)
    stopped = MESSAGES_ANSWERS.from_json(orjson.dumps(message([], "stop_sequence", stop_sequence="END")))
    assert stopped is not None and stopped.stop_sequence == "END"


def test_messages_stream_assembled_equals_the_json_answers_entry() -> None:
    data = messages_stream([text_block("Let ", "me ", "look."), tool_block('{"ci', 'ty": "Os', 'lo"}')], "tool_use")
    expected = MESSAGES_ANSWERS.from_json(
        orjson.dumps(message([{"type": "text", "text": "Let me look."}, TOOL_USE], "tool_use"))
    )
    assert expected is not None
    for size in (1, 7, 64, len(data)):
        assert collect("messages", data, chunk=size) == expected
    stopped = collect("messages", messages_stream([text_block("a")], "stop_sequence", "END"))
    assert stopped is not None and stopped.stop_sequence == "END" and stopped.finish_reason == "stop_sequence"
    empty_input = collect("messages", messages_stream([tool_block()], "tool_use"))
    assert empty_input is not None and empty_input.output[0]["input"] == {}


@pytest.mark.parametrize(
    "body",
    [
        message([{"type": "text", "text": "x"}], "refusal"),
        message([{"type": "text", "text": "x"}], None),
        message([{"type": "thinking", "thinking": "hm", "signature": "s"}, {"type": "text", "text": "x"}]),
        message([{"type": "text", "text": "x", "citations": [{"type": "char_location"}]}]),
        message([{**TOOL_USE, "input": "not an object"}], "tool_use"),
        message([{"type": "text", "text": "x"}], usage={"output_tokens": 4}),
        message([{"type": "text", "text": "x"}], type="error"),
    ],
)
def test_messages_not_worth_keeping(body: dict[str, Any]) -> None:
    assert MESSAGES_ANSWERS.from_json(orjson.dumps(body)) is None


def test_messages_streams_not_worth_keeping() -> None:
    full = messages_stream([text_block("a", "b")])
    assert collect("messages", full[: full.index(b"event: message_stop")]) is None  # no message_stop
    error = typed("error", {"type": "error", "error": {"type": "api_error", "message": "gone"}})
    assert collect("messages", full[: full.index(b"event: message_delta")] + error) is None
    assert collect("messages", messages_stream([text_block("a")], "refusal")) is None
    assert collect("messages", messages_stream([tool_block('{"city": ')], "max_tokens")) is None  # unfinished JSON
    thinking = ({"type": "thinking", "thinking": "", "signature": ""}, [{"type": "thinking_delta", "thinking": "hm"}])
    assert collect("messages", messages_stream([thinking, text_block("a")])) is None
    assert collect("messages", messages_stream([text_block("x" * 50, "y" * 51)]), max_chars=100) is None


# -- stored bytes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry",
    [
        CachedCompletion(
            "responses",
            "m",
            "",
            "incomplete",
            8,
            5,
            output=(
                {"type": "message", "text": "héllo ✓"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            ),
        ),
        CachedCompletion(
            "messages",
            "m",
            "",
            "stop_sequence",
            6,
            4,
            output=({"type": "text", "text": "a"}, TOOL_USE),
            stop_sequence="END",
        ),
    ],
)
def test_new_kinds_round_trip_in_the_new_layout(entry: CachedCompletion) -> None:
    raw = entry.to_bytes()
    assert orjson.loads(raw)["v"] == FORMAT_VERSION == 2
    assert CachedCompletion.from_bytes(raw) == entry


def test_chat_entries_keep_the_layout_earlier_gateways_read() -> None:
    # Byte for byte what the gateway wrote before Responses and Messages were cached, so an
    # upgrade keeps every chat and completions entry, and older gateways still read new ones.
    raw = (
        b'{"v":1,"kind":"chat","model":"m","content":"hi","finish_reason":"stop","prompt_tokens":5,'
        b'"completion_tokens":3,"tool_calls":[],"reasoning_content":null}'
    )
    entry = CachedCompletion("chat", "m", "hi", "stop", 5, 3)
    assert entry.to_bytes() == raw and CachedCompletion.from_bytes(raw) == entry


@pytest.mark.parametrize(
    "change",
    [
        {"v": 1},  # a Responses entry in the chat layout: an older or foreign writer
        {"output": [{"type": "reasoning"}]},
        {"output": [{"type": "message", "text": 7}]},
        {"output": {"type": "message"}},
        {"stop_sequence": 3},
        {"kind": "chat"},  # the new layout is not chat's
    ],
)
def test_malformed_new_layout_entries_read_as_corrupt(change: dict[str, Any]) -> None:
    good = orjson.loads(
        CachedCompletion("responses", "m", "", "completed", 1, 1, output=({"type": "message", "text": "x"},)).to_bytes()
    )
    with pytest.raises(EntryCorrupt):
        CachedCompletion.from_bytes(orjson.dumps({**good, **change}))
