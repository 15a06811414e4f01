"""What a request's prompt is made of before the replica tokenises it: the chat template's
inputs, or the completion's texts.

vLLM's chat endpoints (chat completions, Anthropic's Messages and the Responses API) all
turn their body into one chat completion: OpenAI chat messages, tool schemas as chat's
function tools, and the template's keyword arguments; its completions endpoint tokenises
the prompt as it is. Each dialect says which of these its body is (``Dialect.prompt_input``),
following vLLM's conversion of that API, so the gateway can count the prompt's tokens with
the model's own tokenizer and template (``tokens``) exactly as the replica will.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Keyword values vLLM drops when it merges the request's keywords over the template's
# (vllm/renderers/params.py, merge_kwargs): "unset".
UNSET = (None, "auto")


@dataclass(frozen=True, slots=True)
class TemplateTraits:
    """What vLLM learns of a model's chat template once, and some APIs' conversion reads.

    ``merge_inline_system``: the template refuses a system message after the first turn, so
    Messages' inline system turns are merged into the leading one. ``disabled_thinking_effort``:
    the ``reasoning_effort`` Messages' ``thinking: {type: disabled}`` becomes.
    """

    merge_inline_system: bool = False
    disabled_thinking_effort: str = "none"


@dataclass(slots=True)
class ChatInput:
    """A chat template's inputs: OpenAI chat messages (as the client's request has them,
    before vLLM's content parsing), chat's function tools as vLLM dumps them (None: no
    ``tools``), and the template's keywords (``add_generation_prompt``,
    ``continue_final_message``, ``documents``, ``reasoning_effort``... and the request's
    ``chat_template_kwargs``)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any]


@dataclass(frozen=True, slots=True)
class TextInput:
    """Prompts tokenised as they are (completions): texts, or token ids already."""

    prompts: tuple[str | tuple[int, ...], ...]
    add_special_tokens: bool = True


class NotCountable(Exception):
    """A body whose prompt the gateway cannot count exactly (images, a shape vLLM's conversion
    refuses...): the estimate stands in."""


def template_kwargs(user: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """The request's ``chat_template_kwargs`` with the API's own keywords over them, as vLLM
    merges them: an API keyword that is unset leaves the request's value."""
    merged = dict(user) if isinstance(user, dict) else {}
    reasoning_effort = extra.get("reasoning_effort")
    if reasoning_effort is not None and "enable_thinking" not in merged:
        # vLLM turns thinking on for templates that need it asked (Gemma's, Qwen's).
        extra = {**extra, "enable_thinking": reasoning_effort != "none"}
    merged.update((k, v) for k, v in extra.items() if not _unset(v))
    return merged


def _unset(value: Any) -> bool:
    return isinstance(value, str | type(None)) and value in UNSET


def function_tool(
    name: Any,
    description: Any = None,
    parameters: Any = None,
    strict: Any = None,
    defer_loading: Any = None,
    tool_defer_loading: Any = None,
) -> dict[str, Any]:
    """One tool as vLLM hands it to the template (its ``ChatCompletionToolsParam`` dumped):
    ``description`` and ``parameters`` always there (null when absent), ``strict`` and
    ``defer_loading`` only when set (the tool's own passed down to its function)."""
    if not isinstance(name, str):
        raise NotCountable("a tool without a name")
    if defer_loading is None:
        defer_loading = tool_defer_loading
    function: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if strict is not None:
        function["strict"] = strict
    if defer_loading is not None:
        function["defer_loading"] = defer_loading
    tool: dict[str, Any] = {"type": "function", "function": function}
    if tool_defer_loading is not None:
        tool["defer_loading"] = tool_defer_loading
    return tool


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Chat completions' ``tools`` as the template sees them."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise NotCountable("'tools' is not an array")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise NotCountable("a tool that is not a function")
        f = tool["function"]
        out.append(
            function_tool(
                f.get("name"),
                f.get("description"),
                f.get("parameters"),
                f.get("strict"),
                f.get("defer_loading"),
                tool.get("defer_loading"),
            )
        )
    return out
