"""The error envelopes of the APIs the gateway speaks, as bytes on the wire.

An error is four plain values (status, message, type, code, and the offending ``param``);
an envelope writes them as its API's clients expect, for a whole response and for the
event that ends a broken stream, and re-shapes a replica's own error body:

    OpenAI     {"error": {"message", "type", "param", "code"}}
               stream:   data: {"error": {...}}                  (chat, completions)
    Responses  the same body; stream: event: error  (the SDK raises on it)
    Anthropic  {"type": "error", "error": {"type", "message"}}, the type named by the status
               (https://docs.anthropic.com/en/api/errors); stream: event: error
"""

from __future__ import annotations

import contextlib
from typing import Any

import orjson

_SEP = b"\n\n"


class OpenAIErrors:
    """OpenAI's envelope (chat, completions, embeddings and vLLM's other endpoints)."""

    def body(self, status: int, message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
        return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})

    def event(self, message: str, code: str, type_: str = "server_error") -> bytes:
        """An SSE event the OpenAI SDKs raise as ``APIError`` mid-stream."""
        return b"data: " + self.body(0, message, type_, code) + _SEP

    def from_upstream(self, status: int, body: bytes) -> bytes:
        """A replica's 4xx body in this envelope, whatever the replica sent.

        vLLM's own errors already have it; a route it does not serve answers with
        ``{"detail": "Not Found"}`` (e.g. /v1/embeddings on a generation model), and other
        OpenAI-compatible servers vary.
        """
        parsed = _json(body)
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict) and "message" in parsed["error"]:
            return body
        return self.body(status, _upstream_message(status, body), "invalid_request_error", f"upstream_{status}")

    def message_of(self, body: bytes) -> str | None:
        """The message of an error body in this envelope, or None."""
        parsed = _json(body)
        with contextlib.suppress(KeyError, TypeError):
            message = parsed["error"]["message"]
            return message if isinstance(message, str) else None
        return None


class ResponsesErrors(OpenAIErrors):
    """The Responses API: OpenAI's body; a stream ends with an ``error`` event, whose data
    carries the documented fields and an ``error`` object (the SDK raises ``APIError`` on it)."""

    def event(self, message: str, code: str, type_: str = "server_error") -> bytes:
        payload = {
            "type": "error",
            "code": code,
            "message": message,
            "param": None,
            "error": {"type": type_, "code": code, "message": message},
        }
        return b"event: error\ndata: " + orjson.dumps(payload) + _SEP


# Anthropic's error type for each status its SDK maps to an exception class.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_type(status: int) -> str:
    """Anthropic's error type for ``status``."""
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


class AnthropicErrors:
    """Anthropic's envelope (``/v1/messages``)."""

    def body(self, status: int, message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
        return orjson.dumps({"type": "error", "error": {"type": anthropic_type(status), "message": message}})

    def event(self, message: str, code: str, type_: str = "server_error") -> bytes:
        # A stream's status is already 200: the type says what went wrong, as Anthropic's do.
        kind = "overloaded_error" if code in ("no_healthy_replica", "queue_timeout") else "api_error"
        payload = {"type": "error", "error": {"type": kind, "message": message}}
        return b"event: error\ndata: " + orjson.dumps(payload) + _SEP

    def from_upstream(self, status: int, body: bytes) -> bytes:
        parsed = _json(body)
        if isinstance(parsed, dict) and parsed.get("type") == "error" and isinstance(parsed.get("error"), dict):
            return body
        message = OpenAIErrors().message_of(body) or _upstream_message(status, body)
        return self.body(status, message, "", None)

    def message_of(self, body: bytes) -> str | None:
        parsed = _json(body)
        with contextlib.suppress(KeyError, TypeError):
            message = parsed["error"]["message"]
            return message if isinstance(message, str) else None
        return None


def _json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def _upstream_message(status: int, body: bytes) -> str:
    if status == 404:
        return "The replica does not serve this endpoint or model (404)."
    detail = body[:200].decode("utf-8", "replace").strip()
    return f"The replica refused the request ({status}): {detail}"


OPENAI = OpenAIErrors()
RESPONSES = ResponsesErrors()
ANTHROPIC = AnthropicErrors()
