"""Errors reach each API's clients in its own envelope, a replica's errors included."""

from __future__ import annotations

import orjson

from dialects.envelopes import ANTHROPIC, OPENAI, RESPONSES, anthropic_type

openai_error_body = OPENAI.from_upstream


def test_upstream_errors_are_put_in_openai_shape() -> None:
    vllm = b'{"error":{"message":"bad max_tokens","type":"BadRequestError","param":"max_tokens","code":400}}'
    assert openai_error_body(400, vllm) is vllm
    wrapped = orjson.loads(openai_error_body(404, b'{"detail":"Not Found"}'))
    assert wrapped["error"]["code"] == "upstream_404"
    assert set(wrapped["error"]) == {"message", "type", "param", "code"}
    plain = orjson.loads(openai_error_body(422, b"nope"))
    assert "nope" in plain["error"]["message"]


def test_anthropic_errors_name_the_type_of_their_status() -> None:
    body = orjson.loads(ANTHROPIC.body(429, "slow down", "rate_limit_error", "rate_limit_exceeded"))
    assert body == {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}
    types = {status: anthropic_type(status) for status in (400, 401, 403, 404, 413, 500, 503, 529, 418, 599)}
    assert types == {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        500: "api_error",
        503: "overloaded_error",
        529: "overloaded_error",
        418: "invalid_request_error",
        599: "api_error",
    }


def test_a_replicas_errors_reach_anthropic_clients_in_anthropics_shape() -> None:
    own = b'{"type":"error","error":{"type":"NotFoundError","message":"no such model"}}'
    assert ANTHROPIC.from_upstream(404, own) is own
    vllm = b'{"error":{"message":"bad max_tokens","type":"BadRequestError","param":null,"code":400}}'
    assert orjson.loads(ANTHROPIC.from_upstream(400, vllm)) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "bad max_tokens"},
    }
    assert ANTHROPIC.message_of(own) == "no such model"


def test_stream_error_events_are_the_ones_each_sdk_raises_on() -> None:
    anthropic_event = ANTHROPIC.event("cut", "upstream_stream_error")
    assert anthropic_event.startswith(b"event: error\ndata: ") and anthropic_event.endswith(b"\n\n")
    assert orjson.loads(anthropic_event.split(b"data: ", 1)[1]) == {
        "type": "error",
        "error": {"type": "api_error", "message": "cut"},
    }
    responses_event = RESPONSES.event("cut", "upstream_stream_error")
    assert responses_event.startswith(b"event: error\ndata: ")
    data = orjson.loads(responses_event.split(b"data: ", 1)[1])
    assert (data["type"], data["code"], data["message"], data["error"]["message"]) == (
        "error",
        "upstream_stream_error",
        "cut",
        "cut",
    )
