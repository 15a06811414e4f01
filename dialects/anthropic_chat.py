"""A Messages body as the chat completion vLLM's ``/v1/messages`` turns it into.

It follows vLLM's conversion (``vllm/entrypoints/anthropic/serving.py``,
``to_chat_completion_request``) step for step, since the prompt the replica tokenises is
that chat completion rendered by the model's template:

- ``system`` (a string or text blocks) becomes one leading system message, its blocks
  joined with nothing between them; Claude Code's ``x-anthropic-billing-header`` block is
  left out (its per-request hash would defeat the prefix cache). Inline system messages
  stay where they are, or join the leading one when the template wants system first.
- a ``tool_result`` block of a user turn becomes a ``tool`` message placed before that
  turn's own message; ``tool_use`` blocks become the assistant's ``tool_calls``; ``thinking``
  becomes its ``reasoning``; a turn of one text block has that text as its content.
- tools become chat's function tools (``input_schema`` as ``parameters``).
"""

from __future__ import annotations

from typing import Any

from dialects.chat_input import ChatInput, NotCountable, TemplateTraits, function_tool, template_kwargs

BILLING_HEADER = "x-anthropic-billing-header"


def chat_input(body: dict[str, Any], traits: TemplateTraits) -> ChatInput:
    """The chat template's inputs for the Messages ``body``."""
    messages = body["messages"]
    out: list[dict[str, Any]] = []
    system_parts: list[str] = []
    system = body.get("system")
    if isinstance(system, str):
        if system:
            system_parts.append(system)
    elif isinstance(system, list):
        for block in system:
            text = block.get("text") if isinstance(block, dict) and block.get("type") == "text" else None
            if isinstance(text, str) and text and not text.startswith(BILLING_HEADER):
                system_parts.append(text)
    if traits.merge_inline_system:
        for message in messages:
            if message.get("role") == "system" and (text := _system_text(message.get("content"))):
                system_parts.append(text)
    if system_parts:
        out.append({"role": "system", "content": "".join(system_parts)})
    for message in messages:
        role = message.get("role")
        content = message.get("content")
        if role == "system":
            if not traits.merge_inline_system and (text := _system_text(content)):
                out.append({"role": "system", "content": text})
            continue
        converted: dict[str, Any] = {"role": role}
        if isinstance(content, str):
            converted["content"] = content
        else:
            _convert_blocks(content, role, converted, out)
        if not (role == "user" and "content" not in converted):
            out.append(converted)
    return ChatInput(out, _tools(body), _kwargs(body, traits))


def _system_text(content: Any) -> str | None:
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [
        b["text"]
        for b in content
        if b.get("type") == "text"
        and isinstance(b.get("text"), str)
        and b["text"]
        and not b["text"].startswith(BILLING_HEADER)
    ]
    return "".join(parts) if parts else None


def _convert_blocks(
    blocks: list[dict[str, Any]], role: str, converted: dict[str, Any], out: list[dict[str, Any]]
) -> None:
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            text = block.get("text")
            if isinstance(text, str) and text:
                parts.append({"type": "text", "text": text})
        elif kind == "thinking":
            thinking = block.get("thinking")
            if isinstance(thinking, str):
                reasoning.append(thinking)
        elif kind == "tool_use":
            arguments = block.get("input")
            if arguments is not None and not isinstance(arguments, dict):
                raise NotCountable("a tool_use input that is not an object")
            # vLLM writes the input as a JSON string, then parses it back for the template.
            tool_calls.append(
                {
                    "id": block.get("id") or "",
                    "type": "function",
                    "function": {"name": block.get("name") or "", "arguments": arguments or {}},
                }
            )
        elif kind == "tool_result":
            if role == "user":
                _user_tool_result(block, out)
            else:
                result = block.get("content")
                # Python's str() of the block's content, as vLLM writes it.
                parts.append({"type": "text", "text": f"Tool result: {result if result else ''}"})
        elif kind in ("redacted_thinking", "tool_reference"):
            continue
        else:  # images (their tokens are the model's processor's), tool additions and removals
            raise NotCountable(f"a {kind!r} block")
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if tool_calls:
        converted["tool_calls"] = tool_calls
    if parts:
        converted["content"] = parts[0]["text"] if len(parts) == 1 else parts


def _user_tool_result(block: dict[str, Any], out: list[dict[str, Any]]) -> None:
    content = block.get("content")
    text = ""
    references: list[dict[str, Any]] = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts: list[str] = []
        for item in content:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image":
                raise NotCountable("an image in a tool result")
            elif kind == "tool_reference" and (name := item.get("tool_name") or item.get("name")):
                references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    out.append({"role": "tool", "tool_call_id": call_id, "content": text or ""})
    if references:
        out.append({"role": "tool", "tool_call_id": call_id, "content": references})


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise NotCountable("'tools' is not an array")
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            raise NotCountable("a tool that is not an object")
        out.append(
            function_tool(
                tool.get("name"),
                tool.get("description"),
                tool.get("input_schema"),
                tool.get("strict"),
                tool.get("defer_loading"),
            )
        )
    return out


def _kwargs(body: dict[str, Any], traits: TemplateTraits) -> dict[str, Any]:
    effort = None
    output_config = body.get("output_config")
    if isinstance(output_config, dict):
        effort = output_config.get("effort")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        effort = traits.disabled_thinking_effort
    extra = {"add_generation_prompt": True, "continue_final_message": False, "reasoning_effort": effort}
    return template_kwargs(body.get("chat_template_kwargs"), extra)
