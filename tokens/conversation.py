"""Chat messages as the conversation a template renders, the way vLLM prepares them.

vLLM (``vllm/renderers/chat_utils.py``, ``parse_chat_messages``) reads each message's
content into parts, then hands the template either the parts (templates that loop over
them: ``"openai"``) or their texts joined with newlines (``"string"``); it drops Claude
Code's billing header line from system text, joins a tool message's text parts into one
string, keeps an assistant's ``tool_calls`` with their arguments parsed from JSON, and its
``reasoning`` (also as ``reasoning_content``). A template that does not know the
``developer`` role gets it as ``system``, every system message merged into the first
(``vllm/renderers/hf.py``). Media parts are not counted here: their tokens are the model's
processor's business, so such a conversation is ``NotCountable``.
"""

from __future__ import annotations

import json
from typing import Any

from dialects.chat_input import NotCountable

# Part types read as text, and the field holding their text.
_TEXT_FIELDS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# Text parts skipped when their text is missing (other text parts make vLLM fail).
_SKIP_EMPTY = ("text", "refusal")
# Fields of a content part vLLM knows; the others pass through to "openai" templates.
_KNOWN_PART_FIELDS = frozenset(
    {
        "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url",
        "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid",
        "video_embeds", "video_url",
    }
)  # fmt: skip
BILLING_HEADER = "x-anthropic-billing-header"


def conversation(messages: list[dict[str, Any]], content_format: str, developer_role: bool) -> list[dict[str, Any]]:
    """The messages as the template receives them (new objects: ``messages`` is not changed)."""
    out = [_message(m, content_format) for m in messages]
    for message in out:
        calls = message.get("tool_calls")
        if message["role"] == "assistant" and isinstance(calls, list):
            if calls:
                message["tool_calls"] = [_tool_call(c) for c in calls]
            else:
                del message["tool_calls"]
    if not developer_role and any(m["role"] == "developer" for m in out):
        out = _without_developer(out)
    return out


def _message(message: Any, content_format: str) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise NotCountable("a message without a role")
    role = message["role"]
    content = message.get("content")
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise NotCountable("message content that is neither text nor parts")
    if role == "system":
        parts = _without_billing_header(parts)
    wrap = content_format == "openai"
    read = [p for p in (_part(part, wrap) for part in parts) if p is not None]
    result: dict[str, Any] = {"role": role, "content": read if wrap else "\n".join(read)}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            result["tool_calls"] = list(message["tool_calls"])
        if (reasoning := message.get("reasoning")) is not None:
            result["reasoning"] = result["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        got = result["content"]
        if isinstance(got, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in got):
            result["content"] = "\n".join(p.get("text", "") for p in got)
    if isinstance(message.get("name"), str):
        result["name"] = message["name"]
    if isinstance(message.get("task"), str):
        result["task"] = message["task"]
    if role == "developer":
        result["tools"] = message.get("tools")
    return result


def _part(part: Any, wrap: bool) -> Any:
    """A content part as the template gets it: a text (``wrap``: a text part), or None (skipped)."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if wrap else part
    if not isinstance(part, dict):
        raise NotCountable("a content part that is not an object")
    kind = part.get("type")
    if kind in _TEXT_FIELDS:
        text = part.get(_TEXT_FIELDS[kind])
        if text is None:
            if kind in _SKIP_EMPTY:
                return None
            raise NotCountable(f"a {kind} part without its text")
        if not isinstance(text, str):
            raise NotCountable("a text part whose text is not a string")
        if not wrap:
            return text
        return {"type": "text", "text": text, **{k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}}
    if kind == "tool_reference":
        name = part.get("name")
        return {"type": "tool_reference", "name": name} if wrap else name
    raise NotCountable(f"a {kind!r} content part")


def _without_billing_header(parts: list[Any]) -> list[Any]:
    """System parts without Claude Code's billing header line (its hash changes every request)."""
    out: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) else None
        if isinstance(part, dict) and part.get("type") != "text":
            text = None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _tool_call(call: Any) -> dict[str, Any]:
    """A tool call with its arguments an object (templates expect one): JSON text parsed, and
    anything that is not an object (or not JSON) as ``{}``, as vLLM does."""
    if not isinstance(call, dict):
        raise NotCountable("a tool call that is not an object")
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise NotCountable("a tool call that is not a function's")
    arguments = function.get("arguments")
    if not arguments:
        parsed: Any = {}
    elif isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = {}
    else:
        parsed = arguments
    if not isinstance(parsed, dict):
        parsed = {}
    return {**call, "function": {**function, "arguments": parsed}}


def _without_developer(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer messages as system ones, and every system message merged into the first."""
    converted = []
    for m in messages:
        if m["role"] == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        converted.append(m)
    systems: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(converted):
        if m["role"] != "system":
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(systems)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, dict) else p for p in content if isinstance(p, str) or "text" in p
            )
        if content:
            systems.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest]
