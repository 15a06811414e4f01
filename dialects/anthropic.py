"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``), as vLLM serves it.

The prompt is ``system`` (a string or text blocks) plus ``messages`` (content as a string
or blocks: text, tool_use, tool_result, images). ``max_tokens`` is required. A stream is
Anthropic's typed events: ``message_start`` (the input tokens in ``message.usage``),
``content_block_*``, ``message_delta`` (the output tokens so far in ``usage``),
``message_stop``; errors come in Anthropic's envelope. ``anthropic-version`` and
``anthropic-beta`` pass through to the replica.
"""

from __future__ import annotations

from typing import Any

from dialects import anthropic_chat
from dialects.answer import Answers
from dialects.anthropic_answers import MESSAGES_ANSWERS, anthropic_usage
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
    string_list,
)
from dialects.chat_input import ChatInput, TemplateTraits
from dialects.envelopes import ANTHROPIC
from dialects.stream import SseScanner, TypedEventScanner

ANTHROPIC_HEADERS = ("anthropic-version", "anthropic-beta")

# The roles a message may have.
_ROLES = ("user", "assistant", "system")


class Messages(Dialect):
    name, path, operation, prompt_param = "messages", "/v1/messages", "chat", "messages"
    streams = True
    generates = True
    classifiable = True
    answers: Answers | None = MESSAGES_ANSWERS
    max_tokens_fields = ("max_tokens",)
    forward_headers = ANTHROPIC_HEADERS
    errors = ANTHROPIC

    def parse(self, raw: bytes, content_type: str | None = None) -> Call:
        body = json_object(raw)
        model = require_model(body)
        chars = self.prompt_chars(body)
        stream = stream_flag(body)
        max_tokens = positive_int(body, "max_tokens")
        if max_tokens is None:
            raise InvalidBody("'max_tokens' is required and must be a positive integer.", param="max_tokens")
        number_in(body, "temperature", 0.0, 1.0)
        number_in(body, "top_p", 0.0, 1.0)
        positive_int(body, "top_k")
        string_list(body, "stop_sequences")
        return Call(self, body, model, stream, True, max_tokens, estimate(chars), raw)

    def prompt_chars(self, body: dict[str, Any]) -> int:
        system = body.get("system")
        if system is not None and not isinstance(system, str | list):
            raise InvalidBody("'system' must be a string or an array of text blocks.", param="system")
        chars = len(_blocks_text(system))
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidBody("'messages' is required and must be a non-empty array.", param="messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise InvalidBody(f"'messages[{i}]' must be an object.", param=f"messages[{i}]")
            # "system": Anthropic's mid-conversation system messages (Claude Code sends them;
            # vLLM's /v1/messages takes them).
            if message.get("role") not in _ROLES:
                raise InvalidBody(
                    f"'messages[{i}].role' must be 'user', 'assistant' or 'system'.", param=f"messages[{i}].role"
                )
            content = message.get("content")
            if not isinstance(content, str | list):
                raise InvalidBody(
                    f"'messages[{i}].content' must be a string or an array of blocks.",
                    param=f"messages[{i}].content",
                )
            if isinstance(content, list) and not all(isinstance(b, dict) for b in content):
                raise InvalidBody(f"'messages[{i}].content' blocks must be objects.", param=f"messages[{i}].content")
            chars += len(_blocks_text(content)) + TOKENS_PER_MESSAGE * CHARS_PER_TOKEN
        return chars + schema_chars(body, ("tools",))

    def prompt(self, body: dict[str, Any]) -> PromptView:
        """``system`` as the system turn, then each message; the latest user text is the instruction."""
        segments: list[str] = []
        system = _blocks_text(body.get("system"))
        if system:
            segments.append(segment("system", system))
        instruction = ""
        messages = body.get("messages")
        for message in messages if isinstance(messages, list) else ():
            if not isinstance(message, dict):
                continue
            role, text = str(message.get("role", "")), _blocks_text(message.get("content"))
            segments.append(segment(role, text))
            if role == "user" and text:
                instruction = text
        return PromptView(tuple(segments), instruction)

    def prompt_input(self, body: dict[str, Any], traits: TemplateTraits) -> ChatInput:
        return anthropic_chat.chat_input(body, traits)

    def scanner(self, call: Call) -> SseScanner:
        return MessagesScanner()

    def usage(self, answer: dict[str, Any]) -> dict[str, int] | None:
        return anthropic_usage(answer.get("usage"), None)


class CountTokens(Messages):
    """``/v1/messages/count_tokens``: the same body (``max_tokens`` optional), answered
    ``{"input_tokens": N}``; nothing is generated, so nothing is charged."""

    name, path, operation = "count_tokens", "/v1/messages/count_tokens", "count_tokens"
    streams = False
    generates = False
    classifiable = False
    answers = None

    def parse(self, raw: bytes, content_type: str | None = None) -> Call:
        body = json_object(raw)
        model = require_model(body)
        chars = self.prompt_chars(body)
        return Call(self, body, model, False, False, None, estimate(chars), raw)

    def usage(self, answer: dict[str, Any]) -> dict[str, int] | None:
        return None


class MessagesScanner(TypedEventScanner):
    """A Messages stream: each ``content_block_delta`` is a token; usage from
    ``message_start`` (input) and ``message_delta`` (output, cumulative)."""

    __slots__ = ()

    TOKENS = frozenset({b"content_block_delta"})
    ENDS = frozenset({b"message_stop", b"error"})
    READ = frozenset({b"message_start", b"message_delta"})

    def _read(self, kind: bytes, data: dict[str, Any]) -> None:
        if kind == b"message_start":
            message = data.get("message")
            if isinstance(message, dict):
                self.usage = anthropic_usage(message.get("usage"), None)
        else:
            self.usage = anthropic_usage(data.get("usage"), self.usage)


def _blocks_text(content: Any) -> str:
    """The text of a string or of content blocks: text, tool calls' inputs, tool results."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    parts: list[str] = []
    for block in content:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif kind == "tool_use":
            parts.append(f"{block.get('name', '')}{block.get('input', '')}")
        elif kind == "tool_result":
            parts.append(_blocks_text(block.get("content")))
    return "".join(parts)


MESSAGES = Messages()
COUNT_TOKENS = CountTokens()
