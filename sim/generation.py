"""The request path every generation endpoint shares, whatever its wire format.

Chat, completions, Responses and Messages differ only in what they read from the body, what
their answer and their stream look like and how they shape an error; each is one
``GenerationApi`` object. ``serve`` is the same sequence for all of them:

    read body -> api.parse -> engine.submit -> api.complete(call, text) | api.stream(call)

A request whose ``tool_choice`` forces a call (each API reads its own shape of it and hands
``forced_call`` its tools) is answered with one call of that tool instead of text: its
arguments are fixed before generation (``arguments_for`` fills the schema's required
properties), the engine is asked for one token per ``CHARS_PER_TOKEN`` characters of them, and
each token it delivers is spelled as the next piece (``ToolCallStream``). The engine keeps the
timing and the token count; a limit that cuts the call short leaves the arguments unfinished
and the finish reason "length", as vLLM's would be.

The engine's stream is cancelled when the handler ends, so a client that leaves (aiohttp
cancels its handler) frees its slot, as vLLM aborts a request whose connection closed.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from sim.engine import CHARS_PER_TOKEN, SimRequest, SimStream
from sim.freeze import FREEZE_KEY, FrozenStream
from sim.lora_api import served_name
from sim.wire import ENGINE_KEY, PRIORITIES_KEY, SSE_HEADERS, Rejection, invalid, json_response, read_body

# vLLM's default when a request sets no token limit is "the rest of the context"; the
# simulator uses a bounded stand-in so a forgotten limit cannot stream forever.
DEFAULT_MAX_TOKENS = 256
# The chat finish reason of an answer that is a complete tool call; each API maps it to its own
# (Messages "tool_use", Responses "completed").
TOOL_CALLS = "tool_calls"
# vLLM's messages for a forcing tool_choice it cannot honour (its ChatCompletionRequest checks).
NO_TOOLS = "When using `tool_choice`, `tools` must be set."
UNKNOWN_TOOL = "The tool specified in `tool_choice` does not match any of the specified `tools`"
# A schema nested (or referring to itself) deeper than this gets ``{}``: a required property
# that contains itself has no finite value, and the walk must end.
MAX_SCHEMA_DEPTH = 16


# The prompt's ids from a real tokenizer (``sim.server --tokenizer``): given the endpoint's
# API and the body, the ids, or None where it cannot say (the simulator's own ids then).
TokenIds = Callable[[Any, dict[str, Any]], list[int] | None]
TOKEN_IDS_KEY: web.AppKey[TokenIds] = web.AppKey("token_ids")


@dataclass(frozen=True)
class ToolCall:
    """The one call a forcing ``tool_choice`` gets: the tool's name and its arguments as JSON text."""

    name: str
    arguments: str

    @property
    def pieces(self) -> list[str]:
        """The arguments as the simulator's tokens: one per ``CHARS_PER_TOKEN`` characters."""
        text = self.arguments
        return [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]


@dataclass(frozen=True)
class Generation:
    """What an endpoint asks of the engine, read from its body; ``tool_call``: answer with that call."""

    prompt: str
    max_tokens: int
    stream: bool = False
    seed: int | None = None
    tool_call: ToolCall | None = None
    # vLLM's ``ignore_eos`` extension (chat, completions, Responses): run to ``max_tokens``.
    ignore_eos: bool = False


@dataclass(frozen=True)
class Call:
    """One admitted request: its id, creation time, the served model, its body and its tokens."""

    id: str
    created: int
    model: str
    body: dict[str, Any]
    generation: Generation
    tokens: SimStream


class GenerationApi(Protocol):
    """One generation endpoint's wire format."""

    def new_id(self) -> str: ...

    def parse(self, body: dict[str, Any], served: str) -> Generation | Rejection: ...

    def error(self, rejection: Rejection) -> web.Response: ...

    def complete(self, call: Call, text: str) -> dict[str, Any]:
        """The whole answer, once ``call.tokens`` is exhausted (usage and finish reason are set)."""
        ...

    def stream(self, call: Call) -> AsyncIterator[bytes]:
        """The SSE events of a streamed answer; it iterates ``call.tokens`` itself."""
        ...


async def serve(request: web.Request, api: GenerationApi) -> web.StreamResponse:
    body = await read_body(request)
    if isinstance(body, Rejection):
        return api.error(body)
    served = served_name(request.app, body)
    generation = api.parse(body, served)
    if isinstance(generation, Rejection):
        return api.error(generation)
    priority = body.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        return api.error(invalid("priority must be an integer"))
    counts = request.app[PRIORITIES_KEY]
    counts[priority] = counts.get(priority, 0) + 1
    rid = api.new_id()
    pieces = generation.tool_call.pieces if generation.tool_call is not None else None
    max_tokens = generation.max_tokens if pieces is None else min(generation.max_tokens, len(pieces))
    # A tool call's arguments are fixed beforehand: its answer ends with the last piece, not before.
    ignore_eos = generation.ignore_eos or pieces is not None
    count_ids = request.app.get(TOKEN_IDS_KEY)
    token_ids = count_ids(api, body) if count_ids is not None else None
    request_ = SimRequest(
        rid, generation.prompt, max_tokens, seed=generation.seed, ignore_eos=ignore_eos, token_ids=token_ids
    )
    freeze = request.app[FREEZE_KEY]
    await freeze.admit()  # a frozen replica answers nothing until it thaws
    try:
        tokens: SimStream = request.app[ENGINE_KEY].submit(request_)
    except ValueError as exc:  # the prompt does not fit the context window
        return api.error(Rejection(400, str(exc)))
    tokens = FrozenStream(tokens, freeze)
    if pieces is not None:
        tokens = ToolCallStream(tokens, pieces)
    call = Call(rid, int(time.time()), served, body, generation, tokens)
    try:
        if generation.stream:
            response = web.StreamResponse(headers=SSE_HEADERS)
            await response.prepare(request)
            async for event in api.stream(call):
                await response.write(event)
            await response.write_eof()
            return response
        text = "".join([piece async for piece in tokens])
    finally:
        tokens.cancel()
    return json_response(api.complete(call, text))


def max_tokens_of(body: dict[str, Any], *keys: str) -> int | Rejection:
    """The first of ``keys`` the body sets, else the default; vLLM refuses a limit below 1."""
    key = next((k for k in keys if body.get(k) is not None), None)
    if key is None:
        return DEFAULT_MAX_TOKENS
    value = body[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        return Rejection(400, f"{key} must be at least 1, got {value}.", param=key)
    return value


def ignore_eos_of(body: dict[str, Any]) -> bool:
    """vLLM's ``ignore_eos``: keep generating past the end of the answer, up to the limit."""
    return body.get("ignore_eos") is True


def seed_of(body: dict[str, Any]) -> int | None:
    seed = body.get("seed")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


class ToolCallStream:
    """The engine's tokens spelled as a tool call's arguments: its i-th token is the i-th piece.

    ``finish_reason`` is ``TOOL_CALLS`` once every piece came out, else the engine's own
    ("length" when the client's limit cut the call short, "abort" when the client left).
    """

    def __init__(self, tokens: SimStream, pieces: Sequence[str]) -> None:
        self.prompt_tokens = tokens.prompt_tokens
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._tokens = tokens
        self._pieces = pieces

    def cancel(self) -> None:
        self._tokens.cancel()

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            async for _ in self._tokens:  # the engine was asked for no more tokens than pieces
                self.completion_tokens += 1
                yield self._pieces[self.completion_tokens - 1]
        finally:
            done = self.completion_tokens == len(self._pieces)
            self.finish_reason = TOOL_CALLS if done else self._tokens.finish_reason


def forced_call(tools: Sequence[tuple[str, Any]], name: str | None) -> ToolCall | Rejection:
    """The call a forcing ``tool_choice`` asks for, from the request's (name, parameters schema)
    tools: the tool ``name``, or the first one when the choice names none ("required", "any")."""
    if not tools:
        return invalid(NO_TOOLS)
    if name is None:
        name, schema = tools[0]
    else:
        found = [schema for tool, schema in tools if tool == name]
        if not found:
            return invalid(UNKNOWN_TOOL)
        schema = found[0]
    return ToolCall(name, json.dumps(arguments_for(schema), ensure_ascii=False))


def arguments_for(schema: Any) -> Any:
    """A value that validates against a JSON schema, built the same way every time: each required
    property filled by its type (string "x", integer and number 1, boolean true, array [],
    object its own required properties), an ``enum`` or ``const`` by its first value, a local
    ``$ref`` and the first of ``anyOf``/``oneOf``/``allOf`` followed, bounds and minimum sizes kept."""
    return _example(schema, schema, 0)


def _example(schema: Any, root: Any, depth: int) -> Any:
    if not isinstance(schema, dict) or depth > MAX_SCHEMA_DEPTH:
        return {}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target = root
        for key in (k for k in ref[1:].split("/") if k):  # a JSON pointer into the schema itself
            target = target.get(key) if isinstance(target, dict) else None
        return _example(target, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return _example(options[0], root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "string":
        return "x" * max(1, _int(schema.get("minLength"), 1))
    if kind in ("integer", "number"):
        return _number_in(schema, integer=kind == "integer")
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    if kind == "array":
        return [_example(schema.get("items"), root, depth + 1) for _ in range(_int(schema.get("minItems"), 0))]
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = schema.get("required")
    names = [name for name in required if isinstance(name, str)] if isinstance(required, list) else []
    return {name: _example(properties.get(name, {}), root, depth + 1) for name in names}


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _number_in(schema: dict[str, Any], *, integer: bool) -> int | float:
    """1, or the nearest value the schema's ``minimum``/``maximum`` allow."""
    value: int | float = 1
    low, high = schema.get("minimum"), schema.get("maximum")
    if isinstance(low, (int, float)) and not isinstance(low, bool) and value < low:
        value = math.ceil(low) if integer else low
    if isinstance(high, (int, float)) and not isinstance(high, bool) and value > high:
        value = math.floor(high) if integer else high
    return value
