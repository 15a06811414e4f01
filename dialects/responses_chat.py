"""A Responses body as the chat messages vLLM's ``/v1/responses`` renders.

It follows vLLM's conversion (``vllm/entrypoints/openai/responses/utils.py``,
``construct_input_messages`` and ``construct_tool_dicts``), for models without Harmony:

- ``instructions`` is a leading system message; a string ``input`` is one user message.
- of the input items, a message with a role is passed as it is (an assistant's keeps only
  its first part's text); a ``function_call`` joins the assistant message just before it as
  one of its ``tool_calls`` (or starts one), as its reasoning does; a ``function_call_output``
  is a ``tool`` message.
- function tools become chat's function tools; other tool kinds are not rendered.
- the final message is continued instead of answered when it is an assistant message (or
  reasoning) still ``in_progress`` or ``incomplete``.
"""

from __future__ import annotations

from typing import Any

from dialects.chat_input import ChatInput, NotCountable, TemplateTraits, function_tool, template_kwargs

_PARTIAL = ("in_progress", "incomplete")


def chat_input(body: dict[str, Any], traits: TemplateTraits) -> ChatInput:
    """The chat template's inputs for the Responses ``body`` (its stored history expanded)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    value = body.get("input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        for item in value:
            message = _message(item, messages[-1] if messages else None)
            if message is not None:
                messages.append(message)
    continue_final = _partial(value)
    reasoning = body.get("reasoning")
    extra = {
        "add_generation_prompt": not continue_final,
        "continue_final_message": continue_final,
        "reasoning_effort": reasoning.get("effort") if isinstance(reasoning, dict) else None,
    }
    return ChatInput(messages, _tools(body.get("tools")), template_kwargs(body.get("chat_template_kwargs"), extra))


def _message(item: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any] | None:
    """``item`` as a new chat message, or None when it joined ``previous`` (an assistant's)."""
    assistant = previous if previous is not None and previous.get("role") == "assistant" else None
    kind = item.get("type")
    if kind == "function_call":
        if item.get("namespace"):
            raise NotCountable("a namespaced function call")
        call = {
            "id": item.get("call_id"),
            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            "type": "function",
        }
        if assistant is not None:
            calls = assistant.get("tool_calls")
            if calls is None:
                assistant["tool_calls"] = [call]
                return None
            if isinstance(calls, list):
                assistant["tool_calls"] = [*calls, call]  # a copy: the list may be the body's
                return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise NotCountable("encrypted reasoning")  # vLLM refuses it
        content, summary = item.get("content"), item.get("summary")
        reasoning = content[0].get("text") if content else summary[0].get("text") if summary else ""
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        content = item.get("content")
        text: Any = None
        if isinstance(content, str):
            text = content
        elif isinstance(content, list) and content and isinstance(content[0], dict):
            text = content[0].get("text")
        if text is not None:
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    if "role" in item:
        return dict(item)
    raise NotCountable(f"an input item of type {kind!r}")


def _partial(value: Any) -> bool:
    """Whether the last input item is an assistant message (or reasoning) to continue."""
    if not isinstance(value, list) or not value:
        return False
    last = value[-1]
    if last.get("type", "message") not in ("message", "reasoning"):
        return False
    return last.get("status") in _PARTIAL


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise NotCountable("'tools' is not an array")
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            raise NotCountable("a tool that is not an object")
        if tool.get("type") == "namespace":
            raise NotCountable("a namespace of tools")
        if tool.get("type") != "function":
            continue
        out.append(
            function_tool(
                tool.get("name"),
                tool.get("description"),
                tool.get("parameters"),
                tool.get("strict"),
                tool.get("defer_loading"),
            )
        )
    return out
