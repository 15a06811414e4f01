"""Parsing and validating OpenAI bodies."""

from __future__ import annotations

import orjson
import pytest

from dialects.base import CHARS_PER_TOKEN, MAX_JSON_DEPTH, TOKENS_PER_MESSAGE, Dialect
from dialects.openai import CHAT, COMPLETIONS, EMBEDDINGS
from gateway.errors import BadRequest
from gateway.request import context_overflow, parse_call


def chat(**fields: object) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello world!"}], **fields}
    return orjson.dumps(body)


def test_chat_call_fields() -> None:
    call = parse_call(CHAT, chat(max_tokens=7, stream=True, stream_options={"include_usage": True}))
    assert call.model == "m"
    assert call.stream is True
    assert call.client_wants_usage is True
    assert call.max_tokens == 7
    # 12 characters of content + 4 tokens of framing = (12 + 16) // 4 = 7
    assert call.prompt_tokens == (12 + TOKENS_PER_MESSAGE * CHARS_PER_TOKEN) // CHARS_PER_TOKEN == 7


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert parse_call(CHAT, chat(max_tokens=5, max_completion_tokens=9)).max_tokens == 9


def test_raw_bytes_forwarded_when_nothing_changes() -> None:
    raw = chat()
    call = parse_call(CHAT, raw)
    assert call.upstream_body("m") is raw


def test_stream_without_usage_asks_upstream_for_usage() -> None:
    call = parse_call(CHAT, chat(stream=True))
    assert call.client_wants_usage is False
    body = orjson.loads(call.upstream_body("m"))
    assert body["stream_options"] == {"include_usage": True}


def test_served_model_rewritten() -> None:
    call = parse_call(CHAT, chat(model="auto"))
    assert orjson.loads(call.upstream_body("real"))["model"] == "real"


def test_completions_prompt_forms() -> None:
    assert parse_call(COMPLETIONS, b'{"model":"m","prompt":"abcdefgh"}').prompt_tokens == 2
    assert parse_call(COMPLETIONS, b'{"model":"m","prompt":["abcd","efgh"]}').prompt_tokens == 2
    assert parse_call(COMPLETIONS, b'{"model":"m","prompt":[1,2,3]}').prompt_tokens == 3


@pytest.mark.parametrize(
    ("endpoint", "raw", "param", "fragment"),
    [
        (CHAT, b"", None, "empty"),
        (CHAT, b"{not json", None, "not valid JSON"),
        (CHAT, b"[1,2]", None, "JSON object"),
        (CHAT, b'{"messages":[{"role":"user","content":"x"}]}', "model", "'model'"),
        (CHAT, b'{"model":"m"}', "messages", "'messages'"),
        (CHAT, b'{"model":"m","messages":[]}', "messages", "non-empty"),
        (CHAT, b'{"model":"m","messages":["hi"]}', "messages[0]", "object"),
        (CHAT, b'{"model":"m","messages":[{"content":"x"}]}', "messages[0].role", "role"),
        (CHAT, b'{"model":"m","messages":[{"role":"user","content":5}]}', "messages[0].content", "string"),
        (CHAT, b'{"model":"m","messages":[{"role":"user"}]}', "messages[0].content", "required"),
        (COMPLETIONS, b'{"model":"m"}', "prompt", "'prompt'"),
        (COMPLETIONS, b'{"model":"m","prompt":[1,"a"]}', "prompt", "'prompt'"),
        (EMBEDDINGS, b'{"model":"m"}', "input", "'input'"),
    ],
)
def test_bad_bodies_name_the_problem(endpoint: Dialect, raw: bytes, param: str | None, fragment: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_call(endpoint, raw)
    assert info.value.param == param
    assert fragment in info.value.message
    assert info.value.status == 400


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", "yes"),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.5),
        ("max_tokens", True),
        ("n", 0),
        ("temperature", 3),
        ("temperature", "hot"),
        ("top_p", 1.5),
        ("stop", 7),
        ("stop", ["a", 1]),
        ("stream_options", {"include_usage": True}),  # without stream
    ],
)
def test_wrong_types_rejected_with_param(field: str, value: object) -> None:
    with pytest.raises(BadRequest) as info:
        parse_call(CHAT, chat(**{field: value}))
    assert info.value.param == field


def test_assistant_tool_call_without_content_is_valid() -> None:
    raw = orjson.dumps(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
            ],
        }
    )
    assert parse_call(CHAT, raw).model == "m"


def test_embeddings_cannot_stream() -> None:
    with pytest.raises(BadRequest):
        parse_call(EMBEDDINGS, b'{"model":"m","input":"x","stream":true}')


def test_tool_schemas_count_in_the_prompt_estimate() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    plain = parse_call(CHAT, chat()).prompt_tokens
    with_tools = parse_call(CHAT, chat(tools=tools)).prompt_tokens
    # 28 characters of messages (7 tokens) + the tools' 86 characters of JSON: 114 // 4 = 28
    assert len(orjson.dumps(tools)) == 86
    assert (plain, with_tools) == (7, 28)
    functions = [{"name": "f", "parameters": {}}]  # 30 characters of JSON
    assert parse_call(CHAT, chat(functions=functions)).prompt_tokens == (28 + 30) // 4
    with pytest.raises(BadRequest) as info:
        parse_call(CHAT, chat(tools={"type": "function"}))
    assert info.value.param == "tools"


def test_n_is_kept_for_the_reservation() -> None:
    assert parse_call(CHAT, chat(n=8)).n == 8
    assert parse_call(CHAT, chat()).n == 1


def test_nesting_deeper_than_the_limit_is_a_400() -> None:
    def nested(depth: int) -> bytes:
        # the body object is the first level
        return b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "x": ' + (
            b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
        )

    call = parse_call(CHAT, nested(MAX_JSON_DEPTH))
    assert orjson.loads(call.upstream_body("other"))["x"] == call.body["x"]  # serialisable, for a rewrite
    for depth in (MAX_JSON_DEPTH + 1, 256, 300, 1024):
        with pytest.raises(BadRequest, match="deeper"):
            parse_call(CHAT, nested(depth))


def test_context_overflow_counts_the_prompt_estimate_and_max_tokens() -> None:
    # 400 characters: 100 tokens, + 4 for the message's framing.
    messages = [{"role": "user", "content": "x" * 400}]
    fits = parse_call(CHAT, orjson.dumps({"model": "m", "messages": messages, "max_tokens": 96}))
    assert fits.prompt_tokens == 104
    assert context_overflow(fits, 200) is None  # 104 + 96 = 200
    too_long = parse_call(CHAT, orjson.dumps({"model": "m", "messages": messages, "max_tokens": 97}))
    err = context_overflow(too_long, 200)
    assert err is not None
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "messages")
    # Without max_tokens only the prompt must fit.
    bare = parse_call(COMPLETIONS, orjson.dumps({"model": "m", "prompt": "x" * 400}))
    assert context_overflow(bare, 100) is None
    over = context_overflow(bare, 99)
    assert over is not None and over.param == "prompt"
