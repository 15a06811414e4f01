"""Replica errors reach clients in OpenAI's shape."""

from __future__ import annotations

import orjson

from gateway.proxy import openai_error_body


def test_upstream_errors_are_put_in_openai_shape() -> None:
    vllm = b'{"error":{"message":"bad max_tokens","type":"BadRequestError","param":"max_tokens","code":400}}'
    assert openai_error_body(400, vllm) is vllm
    wrapped = orjson.loads(openai_error_body(404, b'{"detail":"Not Found"}'))
    assert wrapped["error"]["code"] == "upstream_404"
    assert set(wrapped["error"]) == {"message", "type", "param", "code"}
    plain = orjson.loads(openai_error_body(422, b"nope"))
    assert "nope" in plain["error"]["message"]
