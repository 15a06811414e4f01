"""OpenAI's Responses API (``POST /v1/responses``), as vLLM serves it.

The body's prompt is ``instructions`` plus ``input``: a string, or a list of items (messages
with string or part-list content, function calls and their outputs). A stream is a sequence
of typed events (``event: response.output_text.delta`` ...) that ends with
``response.completed`` (or ``response.incomplete`` / ``response.failed``), whose
``response`` carries the whole answer and its ``usage`` (``input_tokens``,
``output_tokens``, ``total_tokens``).

State (``store``, ``previous_response_id``) is the gateway's, not the replica's: a replica
is always sent ``store: false`` and never a ``previous_response_id`` (the gateway expands it
into the full input first), so any replica can answer any turn.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

from dialects import responses_chat
from dialects.base import (
    CHARS_PER_TOKEN,
    TOKENS_PER_MESSAGE,
    Call,
    Dialect,
    InvalidBody,
    PromptView,
    estimate,
    json_object,
    number_in,
    positive_int,
    require_model,
    schema_chars,
    segment,
    stream_flag,
    text_of,
)
from dialects.chat_input import ChatInput, TemplateTraits
from dialects.envelopes import RESPONSES
from dialects.responses_answers import RESPONSES_ANSWERS, responses_usage
from dialects.stream import SseScanner, TypedEventScanner

# The events that end a stream, with the answer in their ``response``.
_ENDS = frozenset({b"response.completed", b"response.incomplete", b"response.failed"})
# The first event: the response's id, which the client may cancel it by.
_CREATED = b"response.created"


class Responses(Dialect):
    name, path, operation, prompt_param = "responses", "/v1/responses", "chat", "input"
    streams = True
    generates = True
    classifiable = True
    answers = RESPONSES_ANSWERS
    max_tokens_fields = ("max_output_tokens",)
    errors = RESPONSES

    def parse(self, raw: bytes, content_type: str | None = None) -> Call:
        body = json_object(raw)
        model = require_model(body)
        chars = self.prompt_chars(body)
        stream = stream_flag(body)
        max_tokens = positive_int(body, "max_output_tokens")
        number_in(body, "temperature", 0.0, 2.0)
        number_in(body, "top_p", 0.0, 1.0)
        for name in ("store", "background"):
            if body.get(name) is not None and not isinstance(body[name], bool):
                raise InvalidBody(f"'{name}' must be a boolean.", param=name)
        previous = body.get("previous_response_id")
        if previous is not None and (not isinstance(previous, str) or not previous):
            raise InvalidBody("'previous_response_id' must be a non-empty string.", param="previous_response_id")
        if body.get("background"):
            raise InvalidBody(
                "Background responses are not supported by this gateway; send the request without 'background'.",
                param="background",
            )
        # Usage always arrives with the final event: the client's wish changes nothing upstream.
        return Call(self, body, model, stream, True, max_tokens, estimate(chars), raw)

    def prompt_chars(self, body: dict[str, Any]) -> int:
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise InvalidBody("'instructions' must be a string.", param="instructions")
        chars = len(instructions or "")
        value = body.get("input")
        if isinstance(value, str):
            if not value and not instructions:
                raise InvalidBody("'input' must not be empty.", param="input")
            return chars + len(value) + schema_chars(body, ("tools",))
        if not isinstance(value, list) or not value:
            raise InvalidBody("'input' is required: a string or a non-empty array of items.", param="input")
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise InvalidBody(f"'input[{i}]' must be an object.", param=f"input[{i}]")
            content = item.get("content")
            if content is not None and not isinstance(content, str | list):
                raise InvalidBody(
                    f"'input[{i}].content' must be a string or an array of parts.", param=f"input[{i}].content"
                )
            chars += len(_item_text(item)) + TOKENS_PER_MESSAGE * CHARS_PER_TOKEN
        return chars + schema_chars(body, ("tools",))

    def prompt(self, body: dict[str, Any]) -> PromptView:
        """``instructions`` as the system turn, then each input item; the latest user
        message is the instruction."""
        segments: list[str] = []
        instructions = body.get("instructions")
        if isinstance(instructions, str) and instructions:
            segments.append(segment("system", instructions))
        value = body.get("input")
        instruction = ""
        if isinstance(value, str):
            segments.append(segment("user", value))
            instruction = value
        elif isinstance(value, list):
            for item in value:
                if not isinstance(item, dict):
                    continue
                role, text = _item_role(item), _item_text(item)
                segments.append(segment(role, text))
                if role == "user":
                    instruction = text
        return PromptView(tuple(segments), instruction)

    def prompt_input(self, body: dict[str, Any], traits: TemplateTraits) -> ChatInput:
        return responses_chat.chat_input(body, traits)

    def upstream_body(self, call: Call, served_model: str) -> bytes:
        """Always rewritten: the served model, ``store: false``, no ``previous_response_id``."""
        body = {k: v for k, v in call.body.items() if k != "previous_response_id"}
        body["model"] = served_model
        body["store"] = False
        return orjson.dumps(body)

    def scanner(self, call: Call) -> SseScanner:
        return ResponsesScanner()

    def usage(self, answer: dict[str, Any]) -> dict[str, int] | None:
        return responses_usage(answer.get("usage"))


class ResponsesScanner(TypedEventScanner):
    """A Responses stream: every ``*.delta`` event of text or arguments is a token."""

    __slots__ = ()

    TOKENS = frozenset(
        {
            b"response.output_text.delta",
            b"response.reasoning_text.delta",
            b"response.reasoning_summary_text.delta",
            b"response.function_call_arguments.delta",
            b"response.refusal.delta",
        }
    )
    ENDS = _ENDS | {b"error"}
    READ = _ENDS | {_CREATED}

    def _read(self, kind: bytes, data: dict[str, Any]) -> None:
        response = data.get("response")
        if not isinstance(response, dict):
            return
        if kind == _CREATED:
            self.started = response
        else:
            self.final = response
            self.usage = responses_usage(response.get("usage"))


_NO_PREVIOUS = re.compile(rb'"previous_response_id"\s*:\s*null')


def echo_previous(previous: str) -> Callable[[bytes], bytes]:
    """Put ``previous`` back in a replica's answer (a body, or whole stream events).

    The replica was sent the expanded input without ``previous_response_id``, so its answer
    says ``null``; OpenAI's API (and vLLM, when it keeps responses itself) echoes the id.
    """
    value = b'"previous_response_id":' + orjson.dumps(previous)

    def rewrite(data: bytes) -> bytes:
        return _NO_PREVIOUS.sub(value, data) if b"previous_response_id" in data else data

    return rewrite


def input_items(body: dict[str, Any]) -> list[Any]:
    """A request's ``input`` as a list of items (a string is one user message)."""
    value = body.get("input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return list(value) if isinstance(value, list) else []


def _item_role(item: dict[str, Any]) -> str:
    role = item.get("role")
    if isinstance(role, str):
        return role
    kind = item.get("type")
    if kind == "function_call_output":
        return "tool"
    return "assistant" if kind in ("function_call", "reasoning") else str(kind or "")


def _item_text(item: dict[str, Any]) -> str:
    """The text of an input item: a message's content, a call's name and arguments, a tool's output."""
    if "content" in item:
        return text_of(item.get("content"))
    kind = item.get("type")
    if kind == "function_call":
        return f"{item.get('name', '')}{item.get('arguments', '')}"
    if kind == "function_call_output":
        output = item.get("output")
        return output if isinstance(output, str) else text_of(output)
    if kind == "reasoning":
        return text_of(item.get("summary"))
    return ""


RESPONSES_API = Responses()
