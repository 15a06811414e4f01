"""OpenAI's Responses API as vLLM serves it: ``POST /v1/responses``.

What vLLM sends (``vllm/entrypoints/openai/responses/serving.py``, ``protocol.py``, the
simple streaming path of ``streaming_events.py`` and ``api_router.py``), kept here:

* the response object is vLLM's ``ResponsesResponse`` dumped whole, null fields included;
  ``status`` is "incomplete" with ``incomplete_details.reason`` "max_output_tokens" when the
  answer hit the client's limit, "completed" otherwise (see ``status_of``);
* a stream is ``event: <type>\\ndata: <json>\\n\\n`` events numbered by ``sequence_number``
  from 0, and no ``[DONE]``: response.created and response.in_progress at once, then with the
  first token response.output_item.added and response.content_part.added, one
  response.output_text.delta per token, then response.output_text.done,
  response.content_part.done, response.output_item.done and response.completed (always that
  type, whatever the status), whose response carries the usage;
* a ``tool_choice`` of "required" or ``{"type": "function", "name": ...}`` is answered with one
  ``function_call`` output item instead of a message (``sim.generation.forced_call``); its stream
  is response.output_item.added (the item with empty arguments, "in_progress"), one
  response.function_call_arguments.delta per token, response.function_call_arguments.done
  (vLLM adds the tool's ``name``), response.output_item.done and response.completed;
* vLLM keeps no responses unless ``VLLM_ENABLE_RESPONSES_API_STORE`` is set, so a
  ``previous_response_id`` is not found (404) and ``background`` is refused (400).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from aiohttp import web

from sim.generation import (
    TOOL_CALLS,
    Call,
    Generation,
    ToolCall,
    forced_call,
    ignore_eos_of,
    max_tokens_of,
    seed_of,
    serve,
)
from sim.prompts import Turn, render_chat, text_of
from sim.wire import Rejection, check_model, invalid, openai_error

# vLLM's sampling defaults when the request sets none (ResponsesRequest._DEFAULT_SAMPLING_PARAMS).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
NO_STORE = (
    "This vLLM engine does not support `store=True` and therefore does not support the background mode. "
    "To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when "
    "launching the vLLM server."
)


def _item_turn(item: dict[str, Any]) -> Turn | Rejection | None:
    kind = item.get("type", "message")
    if kind == "message":
        role, content = item.get("role"), item.get("content")
        if not isinstance(role, str) or not isinstance(content, (str, list)):
            return invalid("a message item needs a role and content (a string or a list of parts)")
        return role, text_of(content)
    if kind == "function_call":
        return "assistant", f"{item.get('name', '')}({item.get('arguments', '')})"
    if kind == "function_call_output":
        output = item.get("output")
        return "tool", output if isinstance(output, str) else text_of(output)
    return None  # reasoning and other items add no text


def conversation(body: dict[str, Any]) -> list[Turn] | Rejection:
    """``instructions`` (as the system turn) and every input item, in order."""
    turns: list[Turn] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        turns.append(("system", instructions))
    given = body.get("input")
    if isinstance(given, str):
        return [*turns, ("user", given)]
    if not isinstance(given, list):
        return invalid("input is required: a string or a list of input items")
    for item in given:
        if not isinstance(item, dict):
            return invalid("each input item must be an object")
        turn = _item_turn(item)
        if isinstance(turn, Rejection):
            return turn
        if turn is not None:
            turns.append(turn)
    return turns


def tool_call_of(body: dict[str, Any]) -> ToolCall | Rejection | None:
    """The call a forcing ``tool_choice`` asks for; None for "auto", "none" or no choice."""
    choice = body.get("tool_choice")
    if choice == "required":
        name = None
    elif isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
    else:
        return None
    tools = body.get("tools")
    functions = [
        (tool["name"], tool.get("parameters"))
        for tool in (tools if isinstance(tools, list) else [])
        if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("name"), str)
    ]
    return forced_call(functions, name if isinstance(name, str) else None)


def _number(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def usage(prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    """vLLM's ResponseUsage; its per-turn lists stay empty for a plain (tool-less) generation."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt_tokens + output_tokens,
    }


def response_object(
    call: Call, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
) -> dict[str, Any]:
    """vLLM's ResponsesResponse, every field in its order; the request's settings echoed."""
    body = call.body
    return {
        "id": call.id,
        "created_at": call.created,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "model": call.model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": _number(body.get("temperature"), DEFAULT_TEMPERATURE),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": _number(body.get("top_p"), DEFAULT_TOP_P),
        "background": False,
        "max_output_tokens": call.generation.max_tokens,
        "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": None,
        "prompt": None,
        "reasoning": body.get("reasoning"),
        "service_tier": body.get("service_tier", "auto"),
        "status": status,
        "text": body.get("text"),
        "top_logprobs": None,
        "truncation": body.get("truncation", "disabled"),
        "usage": usage,
        "user": body.get("user"),
        "input_messages": None,
        "output_messages": None,
    }


def output_text(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def message_item(item_id: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"id": item_id, "content": content, "role": "assistant", "status": status, "type": "message"}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    """vLLM's ResponseFunctionToolCall, its fields in the SDK model's order."""
    return {
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
        "type": "function_call",
        "id": item_id,
        "status": status,
    }


def status_of(call: Call) -> str:
    """ "incomplete" when the answer hit the client's ``max_output_tokens``.

    Without one, vLLM lets the model run to its end of sequence and answers "completed"; the
    simulator's answer ends on its own too (``sim.answer_lengths``), and one that reaches the
    stand-in limit (``DEFAULT_MAX_TOKENS``: with ``ignore_eos``, or a long draw) is reported
    "completed" as well, since clients such as the Agents SDK treat an incomplete response as a
    failure.
    """
    hit_limit = call.tokens.finish_reason == "length" and call.body.get("max_output_tokens") is not None
    return "incomplete" if hit_limit else "completed"


class ResponsesApi:
    """``POST /v1/responses``."""

    def new_id(self) -> str:
        return f"resp_{uuid.uuid4().hex}"

    def parse(self, body: dict[str, Any], served: str) -> Generation | Rejection:
        turns = conversation(body)
        if isinstance(turns, Rejection):
            return turns
        if body.get("background") and body.get("store") is False:
            return invalid("background can only be used when `store` is true")
        rejection = check_model(body, served, optional=True)
        if rejection is not None:
            return rejection
        if body.get("background"):
            return Rejection(400, NO_STORE, "invalid_request_error", "background")
        previous = body.get("previous_response_id")
        if previous is not None:
            return Rejection(404, f"Response with id '{previous}' not found.", "invalid_request_error", "response_id")
        max_tokens = max_tokens_of(body, "max_output_tokens")
        if isinstance(max_tokens, Rejection):
            return max_tokens
        tool_call = tool_call_of(body)
        if isinstance(tool_call, Rejection):
            return tool_call
        stream, seed, ignore_eos = bool(body.get("stream")), seed_of(body), ignore_eos_of(body)
        prompt = render_chat(turns)
        return Generation(prompt, max_tokens, stream=stream, seed=seed, tool_call=tool_call, ignore_eos=ignore_eos)

    def error(self, rejection: Rejection) -> web.Response:
        return openai_error(rejection)

    def complete(self, call: Call, text: str) -> dict[str, Any]:
        tool_call = call.generation.tool_call
        if tool_call is not None:
            item_id, call_id = _call_ids()
            output = [function_call_item(item_id, call_id, tool_call.name, text, _call_status(call))]
        else:
            content = [output_text(text, None)] if text else []
            output = [message_item(f"msg_{uuid.uuid4().hex}", content, "completed")]
        tokens = call.tokens
        return response_object(call, status_of(call), output, usage(tokens.prompt_tokens, tokens.completion_tokens))

    async def stream(self, call: Call) -> AsyncIterator[bytes]:
        numbers = itertools.count()

        def event(kind: str, **fields: Any) -> bytes:
            # The SDK's event models list their fields alphabetically; vLLM dumps them in that order.
            payload = dict(sorted({**fields, "sequence_number": next(numbers), "type": kind}.items()))
            return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

        started = response_object(call, "in_progress", [], None)
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        tool_call = call.generation.tool_call
        if tool_call is not None:
            async for raw in _call_events(call, tool_call, event):
                yield raw
            return
        item_id = f"msg_{uuid.uuid4().hex}"
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        pieces: list[str] = []
        async for piece in call.tokens:
            if not pieces:
                item = message_item(item_id, [], "in_progress")
                yield event("response.output_item.added", item=item, output_index=0)
                yield event("response.content_part.added", part=output_text("", []), **where)
            pieces.append(piece)
            yield event("response.output_text.delta", delta=piece, logprobs=[], **where)
        text = "".join(pieces)
        content = [output_text(text, None)] if text else []
        if pieces:
            yield event("response.output_text.done", text=text, logprobs=[], **where)
            yield event("response.content_part.done", part=output_text(text, None), **where)
            item = message_item(item_id, content, "completed")
            yield event("response.output_item.done", item=item, output_index=0)
        tokens = call.tokens
        output = [message_item(item_id, content, "completed")]
        done = response_object(call, status_of(call), output, usage(tokens.prompt_tokens, tokens.completion_tokens))
        yield event("response.completed", response=done)


def _call_ids() -> tuple[str, str]:
    """A function call's item id and call id."""
    return f"fc_{uuid.uuid4().hex}", f"call_{uuid.uuid4().hex}"


def _call_status(call: Call) -> str:
    """ "completed" once every piece of the arguments came out, "incomplete" when cut short."""
    return "completed" if call.tokens.finish_reason == TOOL_CALLS else "incomplete"


async def _call_events(call: Call, tool_call: ToolCall, event: Callable[..., bytes]) -> AsyncIterator[bytes]:
    """A forced call's events after response.in_progress, one arguments delta per token."""
    item_id, call_id = _call_ids()
    pieces: list[str] = []
    async for piece in call.tokens:
        if not pieces:
            item = function_call_item(item_id, call_id, tool_call.name, "", "in_progress")
            yield event("response.output_item.added", item=item, output_index=0)
        pieces.append(piece)
        yield event("response.function_call_arguments.delta", delta=piece, item_id=item_id, output_index=0)
    arguments = "".join(pieces)
    item = function_call_item(item_id, call_id, tool_call.name, arguments, _call_status(call))
    if pieces:
        where = {"item_id": item_id, "output_index": 0}
        yield event("response.function_call_arguments.done", arguments=arguments, name=tool_call.name, **where)
        yield event("response.output_item.done", item=item, output_index=0)
    tokens = call.tokens
    done = response_object(call, status_of(call), [item], usage(tokens.prompt_tokens, tokens.completion_tokens))
    yield event("response.completed", response=done)


RESPONSES = ResponsesApi()


async def create_response(request: web.Request) -> web.StreamResponse:
    return await serve(request, RESPONSES)
