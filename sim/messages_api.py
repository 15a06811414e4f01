"""Anthropic's Messages API as vLLM serves it: ``/v1/messages`` and ``/v1/messages/count_tokens``.

vLLM converts a Messages request to a chat completion and converts the answer back
(``vllm/entrypoints/anthropic/serving.py``); what that leaves on the wire, kept here:

* the message's id is the chat completion's (``chatcmpl-<hex>``);
* a whole answer is dumped without its null fields (no ``stop_sequence``);
* a stream has no ``ping``: message_start (``usage.output_tokens`` 0) when the first token is
  ready, content_block_start, one content_block_delta per token, then content_block_stop,
  message_delta (``stop_reason`` and both token counts) and message_stop. The events are
  dumped with only the fields vLLM set, so message_start's message has no ``type``/``role``;
* a ``tool_choice`` of ``{"type": "any"}`` or ``{"type": "tool", "name": ...}`` is answered with
  one ``tool_use`` block (``stop_reason`` "tool_use"); streamed, its content_block_start carries
  the block with ``input`` {} and each token is an ``input_json_delta``;
* errors from the handler are in Anthropic's envelope with vLLM's type names
  (``NotFoundError``), but a body that fails the request schema gets vLLM's OpenAI envelope,
  as on every route.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import web

from sim.engine import count_tokens as prompt_tokens
from sim.generation import Call, Generation, ToolCall, forced_call, seed_of, serve
from sim.prompts import Turn, render_chat
from sim.wire import (
    MODEL_KEY,
    Rejection,
    check_model,
    invalid,
    json_response,
    openai_error,
    positive_int,
    read_body,
)

BILLING_HEADER = "x-anthropic-billing-header"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _block_text(block: Any) -> str | None:
    """A content block as prompt text; tool calls and results are written out as text."""
    if not isinstance(block, dict):
        return None
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text") or "")
    if kind == "tool_use":
        return f"{block.get('name', '')}({orjson.dumps(block.get('input') or {}).decode()})"
    if kind == "tool_result":
        content = block.get("content")
        if isinstance(content, list):
            return "\n".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
        return str(content or "")
    if kind == "thinking":
        return str(block.get("thinking") or "")
    return ""  # images and other blocks carry no text


def _content_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = [_block_text(block) for block in content]
        return None if any(t is None for t in texts) else "\n".join(t for t in texts if t)
    return None


def _system_texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content] if content else []
    if not isinstance(content, list):
        return []
    texts = [b.get("text") for b in content if isinstance(b, dict) and b.get("type") == "text"]
    # vLLM drops Claude Code's per-request billing header: it would defeat prefix caching.
    return [t for t in texts if isinstance(t, str) and t and not t.startswith(BILLING_HEADER)]


def conversation(body: dict[str, Any]) -> list[Turn] | Rejection:
    """The request as turns: one system turn first (``system`` and any system-role messages,
    joined with nothing, as vLLM joins them), then the messages."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return invalid("messages must be a non-empty list")
    system = _system_texts(body.get("system"))
    turns: list[Turn] = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        text = _content_text(message.get("content")) if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system") or text is None:
            return invalid("each message needs a role (user or assistant) and content (a string or content blocks)")
        if role == "system":
            system.extend(_system_texts(message["content"]))
        else:
            turns.append((role, text))
    return [("system", "".join(system)), *turns] if system else turns


def tool_call_of(body: dict[str, Any]) -> ToolCall | Rejection | None:
    """The call a forcing ``tool_choice`` asks for; None for "auto", "none" or no choice."""
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "any":
        name = None
    elif kind == "tool" and isinstance(choice, dict):
        name = choice.get("name")
    else:
        return None
    tools = body.get("tools")
    # Client tools have an input schema; server tools (web search and the like) have none.
    client_tools = [
        (tool["name"], tool.get("input_schema"))
        for tool in (tools if isinstance(tools, list) else [])
        if isinstance(tool, dict) and isinstance(tool.get("name"), str) and "input_schema" in tool
    ]
    return forced_call(client_tools, name if isinstance(name, str) else None)


def tool_use_block(tool_call: ToolCall, block_id: str, arguments: str) -> dict[str, Any]:
    """The call as a whole ``tool_use`` block; arguments cut short by the token limit give no input."""
    try:
        given = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        given = {}
    return {"type": "tool_use", "id": block_id, "name": tool_call.name, "input": given}


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex}"


def _error(rejection: Rejection) -> web.Response:
    if rejection.schema:
        return openai_error(rejection)
    body = {"type": "error", "error": {"type": rejection.type_, "message": rejection.message}}
    return web.Response(status=rejection.status, body=orjson.dumps(body), content_type="application/json")


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


class MessagesApi:
    """``POST /v1/messages``."""

    def new_id(self) -> str:
        return f"chatcmpl-{uuid.uuid4().hex}"

    def parse(self, body: dict[str, Any], served: str) -> Generation | Rejection:
        if not isinstance(body.get("model"), str) or not body["model"]:
            return invalid("model is required")
        if not positive_int(body.get("max_tokens")):
            return invalid("max_tokens is required and must be positive")
        turns = conversation(body)
        if isinstance(turns, Rejection):
            return turns
        rejection = check_model(body, served)
        if rejection is not None:
            return rejection
        tool_call = tool_call_of(body)
        if isinstance(tool_call, Rejection):
            return tool_call
        stream, seed = bool(body.get("stream")), seed_of(body)
        return Generation(render_chat(turns), body["max_tokens"], stream=stream, seed=seed, tool_call=tool_call)

    def error(self, rejection: Rejection) -> web.Response:
        return _error(rejection)

    def complete(self, call: Call, text: str) -> dict[str, Any]:
        tokens = call.tokens
        tool_call = call.generation.tool_call
        if tool_call is not None:
            content = [tool_use_block(tool_call, _tool_use_id(), text)]
        else:
            content = [{"type": "text", "text": text}]
        payload: dict[str, Any] = {
            "id": call.id,
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": call.model,
        }
        stop_reason = STOP_REASONS.get(tokens.finish_reason or "")
        if stop_reason is not None:
            payload["stop_reason"] = stop_reason
        payload["usage"] = {"input_tokens": tokens.prompt_tokens, "output_tokens": tokens.completion_tokens}
        return payload

    async def stream(self, call: Call) -> AsyncIterator[bytes]:
        tokens = call.tokens
        tool_call = call.generation.tool_call
        if tool_call is not None:
            opened: dict[str, Any] = {"type": "tool_use", "id": _tool_use_id(), "name": tool_call.name, "input": {}}
        else:
            opened = {"type": "text", "text": ""}
        started = False
        async for piece in tokens:
            if not started:
                started = True
                message: dict[str, Any] = {
                    "id": call.id,
                    "content": [],
                    "model": call.model,
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": tokens.prompt_tokens, "output_tokens": 0},
                }
                yield _event("message_start", {"type": "message_start", "message": message})
                block = {"type": "content_block_start", "content_block": opened, "index": 0}
                yield _event("content_block_start", block)
            if piece:
                if tool_call is not None:
                    change = {"type": "input_json_delta", "partial_json": piece}
                else:
                    change = {"type": "text_delta", "text": piece}
                yield _event("content_block_delta", {"type": "content_block_delta", "delta": change, "index": 0})
        if started:
            yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
        usage = {"input_tokens": tokens.prompt_tokens, "output_tokens": tokens.completion_tokens}
        stop_reason = STOP_REASONS.get(tokens.finish_reason or "stop")
        yield _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop_reason}, "usage": usage})
        yield _event("message_stop", {"type": "message_stop"})


MESSAGES = MessagesApi()


async def create_message(request: web.Request) -> web.StreamResponse:
    return await serve(request, MESSAGES)


async def count_tokens(request: web.Request) -> web.Response:
    """``POST /v1/messages/count_tokens``: the prompt tokens ``/v1/messages`` would count."""
    body = await read_body(request)
    if isinstance(body, Rejection):
        return _error(body)
    if not isinstance(body.get("model"), str) or not body["model"]:
        return _error(invalid("model is required"))
    turns = conversation(body)
    if isinstance(turns, Rejection):
        return _error(turns)
    rejection = check_model(body, request.app[MODEL_KEY])
    if rejection is not None:
        return _error(rejection)
    count = prompt_tokens(render_chat(turns))
    return json_response({"input_tokens": count, "context_management": {"original_input_tokens": count}})
