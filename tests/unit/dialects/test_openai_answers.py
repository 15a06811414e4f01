"""Cache entries: from JSON responses, from streamed events, to bytes and back."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from dialects.answer import CachedCompletion, EntryCorrupt
from dialects.openai_answers import CHAT_ANSWERS, COMPLETION_ANSWERS
from dialects.stream import SseScanner

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
USAGE = {"prompt_tokens": 5, "total_tokens": 8, "completion_tokens": 3}


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def chat_chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return event({**HEAD, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})


def chat_stream(pieces: list[str], finish: str = "stop", usage: bool = True) -> bytes:
    """A stream shaped like vLLM's (and the simulator's)."""
    out = chat_chunk({"role": "assistant", "content": ""})
    for i, piece in enumerate(pieces):
        out += chat_chunk({"content": piece}, finish if i == len(pieces) - 1 else None)
    if usage:
        out += event({**HEAD, "choices": [], "usage": USAGE})
    return out + b"data: [DONE]\n\n"


def collect(
    data: bytes, *, chunk: int = 7, drop_usage: bool = False, max_chars: int = 10_000
) -> CachedCompletion | None:
    """Feed ``data`` in small chunks through the gateway's scanner, as the proxy does."""
    scanner = SseScanner(drop_usage=drop_usage)
    collector = CHAT_ANSWERS.collector(max_chars)
    for i in range(0, len(data), chunk):
        out, _ = scanner.feed(data[i : i + chunk])
        collector.feed(out)
    return collector.result(scanner.usage)


def test_chat_json_response() -> None:
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello there", "tool_calls": []},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "usage": USAGE,
    }
    entry = CHAT_ANSWERS.from_json(orjson.dumps(body))
    assert entry == CachedCompletion("chat", "m", "Hello there", "length", 5, 3)
    assert entry.usage == USAGE and entry.total_tokens == 8


def test_completion_json_response() -> None:
    body = {
        "model": "m",
        "choices": [{"index": 0, "text": " world", "finish_reason": "stop"}],
        "usage": USAGE,
    }
    assert COMPLETION_ANSWERS.from_json(orjson.dumps(body)) == CachedCompletion(
        "completion", "m", " world", "stop", 5, 3
    )


@pytest.mark.parametrize(
    "change",
    [
        {"choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "abort"}]},
        {"choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": None}]},
        {"choices": []},
        {"choices": [{"index": i, "message": {"content": "x"}, "finish_reason": "stop"} for i in (0, 1)]},
        {"usage": None},
        {"error": {"message": "boom"}, "choices": None},
    ],
)
def test_json_responses_not_worth_keeping(change: dict[str, Any]) -> None:
    body: dict[str, Any] = {
        "model": "m",
        "choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "stop"}],
        "usage": USAGE,
    }
    assert CHAT_ANSWERS.from_json(orjson.dumps({**body, **change})) is None
    assert CHAT_ANSWERS.from_json(b"not json") is None


def test_stream_collected_whatever_the_chunking() -> None:
    data = chat_stream(["Hel", "lo ", "world"])
    expected = CachedCompletion("chat", "m", "Hello world", "stop", 5, 3)
    for size in (1, 7, 64, len(data)):
        assert collect(data, chunk=size) == expected


def test_usage_dropped_for_the_client_is_taken_from_the_scanner() -> None:
    # The client did not ask for usage: the scanner removes that event from what it returns.
    assert collect(chat_stream(["a", "b"]), drop_usage=True) == CachedCompletion("chat", "m", "ab", "stop", 5, 3)


def test_streams_not_worth_keeping() -> None:
    full = chat_stream(["a", "b"])
    assert collect(full[: full.index(b"data: [DONE]") - 40]) is None  # cut before usage/finish
    assert collect(chat_stream(["a"], finish="abort")) is None
    assert collect(chat_stream(["a"], usage=False)) is None  # no usage anywhere
    error = b'data: {"error": {"message": "replica died", "code": "upstream_stream_error"}}\n\n'
    assert collect(chat_stream(["a"])[:-14] + error) is None
    assert collect(chat_stream(["x" * 50, "y" * 51]), max_chars=100) is None


def test_keepalive_comments_are_ignored() -> None:
    collector = CHAT_ANSWERS.collector(100)
    collector.feed(b": keep-alive\n\n")
    collector.feed(chat_stream(["ok"]))
    assert collector.result() == CachedCompletion("chat", "m", "ok", "stop", 5, 3)


def test_tool_call_deltas_are_assembled() -> None:
    call_start = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get", "arguments": ""}}
    data = (
        chat_chunk({"role": "assistant", "content": ""})
        + chat_chunk({"tool_calls": [call_start]})
        + chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]})
        + chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}, "tool_calls")
        + event({**HEAD, "choices": [], "usage": USAGE})
        + b"data: [DONE]\n\n"
    )
    entry = collect(data)
    assert entry is not None and entry.finish_reason == "tool_calls" and entry.content == ""
    assert entry.tool_calls == (
        {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Oslo"}'}},
    )


def test_completion_stream() -> None:
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    data = b"".join(
        event({**head, "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": f, "stop_reason": None}]})
        for t, f in (("one", None), (" two", "length"))
    )
    collector = COMPLETION_ANSWERS.collector(100)
    collector.feed(data + b"data: [DONE]\n\n")
    assert collector.result(USAGE) == CachedCompletion("completion", "m", "one two", "length", 5, 3)


def test_bytes_round_trip() -> None:
    entry = CachedCompletion(
        "chat",
        "m",
        "héllo ✓",
        "tool_calls",
        5,
        3,
        tool_calls=({"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}},),
        reasoning_content="because",
    )
    assert CachedCompletion.from_bytes(entry.to_bytes()) == entry


@pytest.mark.parametrize("raw", [b"", b"[]", b'{"v": 99}', b'{"v": 1, "kind": "chat"}', b'{"v": 1, "kind": "image"}'])
def test_corrupt_bytes(raw: bytes) -> None:
    with pytest.raises(EntryCorrupt):
        CachedCompletion.from_bytes(raw)


@pytest.mark.parametrize(
    "delta",
    [{"tool_calls": "x"}, {"tool_calls": [{"index": "0"}]}, {"tool_calls": [{"function": []}]}, {"tool_calls": [7]}],
)
def test_malformed_deltas_give_up_quietly(delta: dict[str, Any]) -> None:
    data = chat_chunk({"role": "assistant", "content": ""}) + chat_chunk(delta, "stop") + b"data: [DONE]\n\n"
    assert collect(data) is None
    collector = CHAT_ANSWERS.collector(100)
    collector.feed(event({**HEAD, "choices": [{"index": 0, "delta": "oops"}]}))
    assert collector.failed
