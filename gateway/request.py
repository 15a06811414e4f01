"""Parse and validate an OpenAI request body once, into a ``Call``.

Validation covers what the gateway relies on (model, messages/prompt/input, stream,
token counts, sampling ranges); every other field is forwarded untouched, since vLLM
accepts many extensions. Errors name the offending parameter in OpenAI's ``param``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from gateway.errors import BadRequest

# Prompt tokens are estimated before any tokenizer runs: ~4 characters per token on
# English text (OpenAI's rule of thumb). Only used for reservations and routing; the
# replica's own `usage` settles the real count.
CHARS_PER_TOKEN = 4
# Per-message framing (role tags, separators) in chat templates, in tokens.
TOKENS_PER_MESSAGE = 4
# Deepest nesting of arrays and objects a body may have. orjson parses to depth 1,024 but
# serialises only to 255 (the cache key and a rewritten body are serialised), and no
# OpenAI request (a tool's JSON schema included) comes near either.
MAX_JSON_DEPTH = 128


class Endpoint(StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    EMBEDDINGS = "/v1/embeddings"

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(slots=True)
class Call:
    """One validated request."""

    endpoint: Endpoint
    body: dict[str, Any]
    model: str
    stream: bool
    # The client asked for the final usage chunk (stream_options.include_usage).
    client_wants_usage: bool
    max_tokens: int | None
    prompt_tokens_estimate: int
    # Raw bytes, forwarded as-is when nothing needs rewriting.
    raw: bytes
    # Choices asked for (``n``): each may generate up to ``max_tokens``.
    n: int = 1

    def upstream_body(self, served_model: str) -> bytes:
        """The body to send upstream: the raw bytes unless the model or usage flag must change."""
        if served_model == self.model and not (self.stream and not self.client_wants_usage):
            return self.raw
        body = dict(self.body)
        body["model"] = served_model
        if self.stream:
            # Always ask for usage so limits and metrics settle on real counts; the
            # gateway drops the usage chunk again when the client did not ask for it.
            options = dict(body.get("stream_options") or {})
            options["include_usage"] = True
            body["stream_options"] = options
        return orjson.dumps(body)


def parse_call(endpoint: Endpoint, raw: bytes) -> Call:
    """Validate ``raw`` for ``endpoint``; raise ``BadRequest`` with ``param`` set."""
    if not raw:
        raise BadRequest("The request body is empty; expected a JSON object.")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc.msg}.") from exc
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    if _deeper_than(body, MAX_JSON_DEPTH):
        raise BadRequest(f"The request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels.")

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string.", param="model")

    if endpoint is Endpoint.CHAT:
        chars = _chat_chars(body.get("messages"))
    elif endpoint is Endpoint.COMPLETIONS:
        chars = _prompt_chars(body.get("prompt"))
    else:
        chars = _embedding_chars(body.get("input"))

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean.", param="stream")
    if endpoint is Endpoint.EMBEDDINGS and stream:
        raise BadRequest("Embeddings cannot be streamed.", param="stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequest("'stream_options' must be an object.", param="stream_options")
        if not stream:
            raise BadRequest("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    wants_usage = bool(options and options.get("include_usage"))

    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    n = _positive_int(body, "n") or 1
    if endpoint is Endpoint.CHAT:
        chars += _schema_chars(body)
    _number_in(body, "temperature", 0.0, 2.0)
    _number_in(body, "top_p", 0.0, 1.0)
    _number_in(body, "presence_penalty", -2.0, 2.0)
    _number_in(body, "frequency_penalty", -2.0, 2.0)
    stop = body.get("stop")
    if (
        stop is not None
        and not isinstance(stop, str)
        and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise BadRequest("'stop' must be a string or a list of strings.", param="stop")

    return Call(
        endpoint=endpoint,
        body=body,
        model=model,
        stream=stream,
        client_wants_usage=wants_usage,
        max_tokens=max_tokens,
        prompt_tokens_estimate=max(1, chars // CHARS_PER_TOKEN),
        raw=raw,
        n=n,
    )


def _schema_chars(body: dict[str, Any]) -> int:
    """Characters the tool and function schemas add to the prompt (chat templates render
    them in); their JSON length stands in for the rendered text."""
    chars = 0
    for name in ("tools", "functions"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, list):
            raise BadRequest(f"'{name}' must be an array.", param=name)
        try:
            chars += len(orjson.dumps(value))
        except orjson.JSONEncodeError as exc:  # nested deeper than orjson writes
            raise BadRequest(f"'{name}' is nested too deeply.", param=name) from exc
    return chars


def _deeper_than(value: dict[str, Any], limit: int) -> bool:
    """Whether ``value`` nests arrays and objects more than ``limit`` levels deep."""
    level: list[Any] = [value]
    for _ in range(limit):
        below: list[Any] = []
        for item in level:
            children = item.values() if isinstance(item, dict) else item
            below.extend(child for child in children if isinstance(child, dict | list))
        if not below:
            return False
        level = below
    return True


def _chat_chars(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required and must be a non-empty array.", param="messages")
    chars = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"'messages[{i}]' must be an object.", param=f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise BadRequest(f"'messages[{i}].role' is required and must be a string.", param=f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    raise BadRequest(f"'messages[{i}].content' parts must be objects.", param=f"messages[{i}].content")
                text = part.get("text")
                if isinstance(text, str):
                    chars += len(text)
        elif content is None:
            if role != "assistant" or not message.get("tool_calls"):
                raise BadRequest(f"'messages[{i}].content' is required.", param=f"messages[{i}].content")
        else:
            raise BadRequest(
                f"'messages[{i}].content' must be a string or an array of parts.", param=f"messages[{i}].content"
            )
        chars += TOKENS_PER_MESSAGE * CHARS_PER_TOKEN
    return chars


def _prompt_chars(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return sum(len(p) for p in prompt)
        if all(isinstance(t, int) for t in prompt):
            return len(prompt) * CHARS_PER_TOKEN
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return sum(len(p) for p in prompt) * CHARS_PER_TOKEN
    raise BadRequest("'prompt' is required: a string, an array of strings, or an array of token ids.", param="prompt")


def _embedding_chars(value: Any) -> int:
    try:
        return _prompt_chars(value)
    except BadRequest:
        raise BadRequest(
            "'input' is required: a string, an array of strings, or an array of token ids.", param="input"
        ) from None


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"'{name}' must be a positive integer.", param=name)
    return value


def _number_in(body: dict[str, Any], name: str, low: float, high: float) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be a number between {low:g} and {high:g}.", param=name)


# The body field that carries the prompt, by endpoint.
_PROMPT_PARAMS = {Endpoint.CHAT: "messages", Endpoint.COMPLETIONS: "prompt", Endpoint.EMBEDDINGS: "input"}


def context_overflow(call: Call, max_model_len: int) -> BadRequest | None:
    """OpenAI's 400 ``context_length_exceeded`` when the prompt (estimated) and ``max_tokens``
    cannot fit in a context of ``max_model_len`` tokens; None when they may.

    The prompt's size is the gateway's estimate (``CHARS_PER_TOKEN``), not a tokenizer's
    count, so a prompt near the limit may be judged either way; the point is to refuse a
    request that plainly cannot fit before it takes a quota, a queue slot or a replica.
    """
    prompt = call.prompt_tokens_estimate
    completion = call.max_tokens or 0
    if prompt + completion <= max_model_len:
        return None
    param = _PROMPT_PARAMS[call.endpoint]
    where = "messages" if param == "messages" else "prompt"
    return BadRequest(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"about {prompt + completion} tokens ({prompt} in the {where}, {completion} in the completion). "
        f"Please reduce the length of the {where} or completion.",
        code="context_length_exceeded",
        param=param,
    )
