"""The Responses, Messages and vLLM-endpoint dialects: bodies, prompt views, upstream
rewrites, stream rules and usage, on hand-written bodies and events."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from dialects.anthropic import COUNT_TOKENS, MESSAGES, anthropic_usage
from dialects.base import CHARS_PER_TOKEN, ROLE_END, TOKENS_PER_MESSAGE, TURN_END, InvalidBody
from dialects.engine import DETOKENIZE, RERANK, TRANSCRIPTIONS
from dialects.registry import BY_PATH, DIALECTS
from dialects.responses import RESPONSES_API, input_items


def ev(kind: str, payload: dict[str, Any], *, named: bool = True) -> bytes:
    head = f"event: {kind}\n".encode() if named else b""
    return head + b"data: " + orjson.dumps({"type": kind, **payload}) + b"\n\n"


# -- Responses --------------------------------------------------------------------------------


def test_responses_body_prompt_and_estimate() -> None:
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "What is 2+2?"},
            {"type": "function_call", "name": "add", "arguments": '{"a":2}', "call_id": "c"},
            {"type": "function_call_output", "call_id": "c", "output": "4"},
            {"role": "user", "content": [{"type": "input_text", "text": "Thanks"}]},
        ],
        "max_output_tokens": 9,
    }
    call = RESPONSES_API.parse(orjson.dumps(body))
    assert (call.model, call.max_tokens, call.stream) == ("m", 9, False)
    chars = len("Be brief.") + len("What is 2+2?") + len('add{"a":2}') + 1 + len("Thanks")
    assert call.prompt_tokens == (chars + 4 * TOKENS_PER_MESSAGE * CHARS_PER_TOKEN) // CHARS_PER_TOKEN
    prompt = call.prompt
    assert prompt.instruction == "Thanks"
    assert prompt.segments[0] == f"system{ROLE_END}Be brief.{TURN_END}"
    assert [s.split(ROLE_END)[0] for s in prompt.segments] == ["system", "user", "assistant", "tool", "user"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "input"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": ["x"]}, "input[0]"),
        ({"model": "m", "input": "x", "instructions": 3}, "instructions"),
        ({"model": "m", "input": "x", "store": "yes"}, "store"),
        ({"model": "m", "input": "x", "previous_response_id": ""}, "previous_response_id"),
        ({"model": "m", "input": "x", "background": True}, "background"),
        ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_responses_bad_bodies_name_their_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidBody) as caught:
        RESPONSES_API.parse(orjson.dumps(body))
    assert caught.value.param == param


def test_responses_upstream_body_drops_state_the_gateway_keeps() -> None:
    call = RESPONSES_API.parse(b'{"model":"auto","input":"hi","previous_response_id":"resp_1","store":true}')
    sent = orjson.loads(call.upstream_body("served"))
    assert sent == {"model": "served", "input": "hi", "store": False}
    assert input_items(call.body) == [{"role": "user", "content": "hi"}]


def test_responses_stream_counts_deltas_and_reads_the_final_answer() -> None:
    final = {"id": "resp_1", "output": [], "usage": {"input_tokens": 7, "output_tokens": 2, "total_tokens": 9}}
    stream = (
        ev("response.created", {"response": {"id": "resp_1"}})
        + ev("response.output_text.delta", {"delta": "a"})
        + ev("response.output_text.delta", {"delta": "b"}, named=False)  # data-only framing too
        + ev("response.completed", {"response": final})
    )
    scanner = RESPONSES_API.scanner(RESPONSES_API.parse(b'{"model":"m","input":"x","stream":true}'))
    cut = len(stream) // 2
    out = scanner.feed(stream[:cut])[0] + scanner.feed(stream[cut:])[0]
    assert out == stream  # relayed untouched
    assert scanner.events == 2 and scanner.done
    assert scanner.usage == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    assert scanner.final == final
    assert scanner.finish() == b""


def test_a_responses_stream_without_its_end_is_not_done() -> None:
    scanner = RESPONSES_API.scanner(RESPONSES_API.parse(b'{"model":"m","input":"x","stream":true}'))
    scanner.feed(ev("response.output_text.delta", {"delta": "a"}))
    assert not scanner.done and scanner.finish() == b"" and scanner.usage is None


# -- Messages ---------------------------------------------------------------------------------


def test_messages_body_prompt_and_headers() -> None:
    body = {
        "model": "claude",
        "max_tokens": 12,
        "system": [{"type": "text", "text": "Be kind."}],
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "done"}]},
        ],
    }
    call = MESSAGES.parse(orjson.dumps(body))
    assert (call.max_tokens, call.dialect.forward_headers) == (12, ("anthropic-version", "anthropic-beta"))
    assert call.prompt.segments[0] == f"system{ROLE_END}Be kind.{TURN_END}"
    assert call.prompt.instruction == "done"
    with pytest.raises(InvalidBody) as missing:
        MESSAGES.parse(b'{"model":"m","messages":[{"role":"user","content":"x"}]}')
    assert missing.value.param == "max_tokens"
    with pytest.raises(InvalidBody) as role:
        MESSAGES.parse(b'{"model":"m","max_tokens":1,"messages":[{"role":"tool","content":"x"}]}')
    assert role.value.param == "messages[0].role"
    # A mid-conversation system message and adaptive thinking, as Claude Code 2.1 sends them
    # (vLLM's /v1/messages takes both): parsed, not refused.
    claude_code = {
        "model": "m",
        "max_tokens": 32000,
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "messages": [
            {"role": "user", "content": "Fix the bug."},
            {"role": "system", "content": [{"type": "text", "text": "The user is in plan mode."}]},
        ],
    }
    parsed = MESSAGES.parse(orjson.dumps(claude_code))
    assert parsed.prompt.segments[-1] == f"system{ROLE_END}The user is in plan mode.{TURN_END}"
    # count_tokens takes the same body without max_tokens, and charges nothing.
    counted = COUNT_TOKENS.parse(b'{"model":"m","messages":[{"role":"user","content":"x"}]}')
    assert counted.max_tokens is None and COUNT_TOKENS.usage({"input_tokens": 5}) is None


def test_messages_stream_usage_from_start_and_delta() -> None:
    start = {"message": {"id": "m", "usage": {"input_tokens": 11, "output_tokens": 1}}}
    stream = (
        ev("message_start", start)
        + ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        + ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "a"}})
        + ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "b"}})
        + ev("content_block_stop", {"index": 0})
        + ev("message_delta", {"delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 2}})
        + ev("message_stop", {})
    )
    scanner = MESSAGES.scanner(
        MESSAGES.parse(b'{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"x"}]}')
    )
    assert scanner.feed(stream) == (stream, 2)
    assert scanner.done
    assert scanner.usage == {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}


def test_anthropic_usage_counts_cache_reads_and_writes_as_prompt() -> None:
    usage = {"input_tokens": 3, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 20, "output_tokens": 4}
    assert anthropic_usage(usage, None) == {"prompt_tokens": 123, "completion_tokens": 4, "total_tokens": 127}
    assert MESSAGES.usage({"usage": {"input_tokens": 2, "output_tokens": 1}}) == {
        "prompt_tokens": 2,
        "completion_tokens": 1,
        "total_tokens": 3,
    }


# -- vLLM's own endpoints -----------------------------------------------------------------------


def test_rerank_settles_on_its_total_tokens() -> None:
    rerank = RERANK[0]
    call = rerank.parse(b'{"model":"m","query":"abcd","documents":["efgh","ijkl"]}')
    assert call.prompt_tokens == 3  # 12 characters
    assert rerank.usage({"usage": {"total_tokens": 17}}) == {
        "prompt_tokens": 17,
        "completion_tokens": 0,
        "total_tokens": 17,
    }
    assert orjson.loads(call.upstream_body("served"))["model"] == "served"
    assert call.upstream_body("m") is call.raw


def test_detokenize_wants_token_ids() -> None:
    assert DETOKENIZE.parse(b'{"model":"m","tokens":[1,2,3]}').prompt_tokens == 3
    with pytest.raises(InvalidBody):
        DETOKENIZE.parse(b'{"model":"m","tokens":[1,"x"]}')


def form(fields: dict[str, str], boundary: str = "b0undary") -> bytes:
    parts = []
    for name, value in fields.items():
        disposition = f'form-data; name="{name}"' + ('; filename="a.wav"' if name == "file" else "")
        parts.append(f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n{value}\r\n")
    return ("".join(parts) + f"--{boundary}--\r\n").encode()


def test_audio_is_read_by_its_model_field_and_rewritten_there_only() -> None:
    raw = form({"file": "RIFF....", "model": "whisper", "language": "en"})
    content_type = "multipart/form-data; boundary=b0undary"
    call = TRANSCRIPTIONS.parse(raw, content_type)
    assert (call.model, call.content_type) == ("whisper", content_type)
    assert call.upstream_body("whisper") is raw
    assert call.upstream_body("served") == form({"file": "RIFF....", "model": "served", "language": "en"})
    with pytest.raises(InvalidBody):
        TRANSCRIPTIONS.parse(raw, "application/json")
    with pytest.raises(InvalidBody) as no_model:
        TRANSCRIPTIONS.parse(form({"file": "x"}), content_type)
    assert no_model.value.param == "model"


def test_every_dialect_has_its_own_path_a_name_and_an_operation() -> None:
    assert len(BY_PATH) == len(DIALECTS)
    assert all(d.name and d.path.startswith("/") and d.operation for d in DIALECTS)
    assert {d.name for d in DIALECTS if d.streams} == {"chat", "completions", "responses", "messages"}
