"""The ``Dialect`` every API implements, the ``Call`` it parses, and the shared validation.

Validation covers what the gateway relies on (model, the prompt, stream, token counts,
sampling ranges); every other field is forwarded untouched, since vLLM accepts many
extensions. Errors name the offending parameter (``InvalidBody.param``); the gateway turns
them into a 400 in the dialect's envelope.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from dialects.envelopes import OPENAI, OpenAIErrors

if TYPE_CHECKING:
    from dialects.answer import Answers
    from dialects.chat_input import ChatInput, TemplateTraits, TextInput
    from dialects.envelopes import AnthropicErrors
    from dialects.stream import SseScanner

# Prompt tokens are estimated when the body is parsed: ~4 characters per token on English
# text (OpenAI's rule of thumb). The model's tokenizer replaces the estimate where one is
# configured (tokens/); otherwise it serves the context check, reservations and routing,
# and the replica's own `usage` settles the real count.
CHARS_PER_TOKEN = 4
# Per-message framing (role tags, separators) in chat templates, in tokens.
TOKENS_PER_MESSAGE = 4
# Deepest nesting of arrays and objects a body may have. orjson parses to depth 1,024 but
# serialises only to 255 (the cache key and a rewritten body are serialised), and no
# request (a tool's JSON schema included) comes near either.
MAX_JSON_DEPTH = 128
JSON = "application/json"
# Separators of a prompt's segments (``PromptView.segments``): a role, then its text.
ROLE_END, TURN_END = "\x1f", "\x1e"


class InvalidBody(Exception):
    """A request body the dialect refuses: what is wrong, and which parameter."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class PromptView:
    """A prompt as routing and the classifier read it, whatever the API.

    ``segments``: the prompt's text in the order the replica's template renders it, each
    turn as ``role + ROLE_END + text + TURN_END`` (a bare completions prompt is one segment
    as it is), so prefix placement hashes what the replica's prefix cache holds.
    ``instruction``: the text the classifier scores (the latest user turn).
    """

    segments: tuple[str, ...]
    instruction: str


@dataclass(slots=True)
class Call:
    """One validated request."""

    dialect: Dialect
    body: dict[str, Any]
    model: str
    stream: bool
    # The client asked for the final usage chunk (stream_options.include_usage).
    client_wants_usage: bool
    max_tokens: int | None
    # The prompt's tokens: estimated from its characters when parsed (``estimate``), then
    # counted with the model's tokenizer where one is configured (``prompt_tokens_counted``).
    prompt_tokens: int
    # Raw bytes, forwarded as-is when nothing needs rewriting.
    raw: bytes
    # Choices asked for (``n``): each may generate up to ``max_tokens``.
    n: int = 1
    # The body's media type, sent upstream as the request's Content-Type.
    content_type: str = JSON
    # Whether ``prompt_tokens`` is the model's tokenizer's count (what the replica's usage
    # will say) rather than the estimate.
    prompt_tokens_counted: bool = False
    # The prompt's token ids, kept only for a model whose replicas publish KV-cache events
    # (``tokens.counter.PromptCounter.count(ids=True)``): what the exact prefix index hashes.
    prompt_token_ids: list[int] | None = None
    _prompt: PromptView | None = None

    def upstream_body(self, served_model: str) -> bytes:
        """The body to send upstream (``Dialect.upstream_body``)."""
        return self.dialect.upstream_body(self, served_model)

    @property
    def prompt(self) -> PromptView:
        """The prompt as routing and the classifier read it, worked out once."""
        if self._prompt is None:
            self._prompt = self.dialect.prompt(self.body)
        return self._prompt


class Dialect:
    """One API: its path, and everything the request path needs to know of its bodies.

    Subclasses override what differs; the defaults describe a JSON endpoint addressed by
    ``model``, answered whole, in OpenAI's error envelope, with no prompt to route on.
    """

    # The metric and log label, the route (and the replica's path), the GenAI operation
    # name of its spans, the body field that holds the prompt.
    name: str = ""
    path: str = ""
    operation: str = ""
    prompt_param: str = "input"
    # Whether a request may ask for a stream; whether it produces tokens (load, TTFT).
    streams: bool = False
    generates: bool = False
    # Whether ``auto`` (and the tenant's classify_models) is classified into a tier.
    classifiable: bool = False
    # What the API does with its answers when the exact cache may keep them (fold, replay,
    # key rules: ``dialects.answer``), or None: its answers are never cached.
    answers: Answers | None = None
    # The body fields that cap generated tokens: the first one present is the one a clamp
    # lowers, else the last is set.
    max_tokens_fields: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
    # A multipart upload (audio), bounded by ``server.max_audio_bytes`` instead of ``max_body_bytes``.
    multipart: bool = False
    # A whole answer is a JSON object (one that is not is a replica's failure, retried);
    # audio answers as text, SRT or VTT when the client asks for them.
    answers_json: bool = True
    # Request headers passed on to the replica as they came (lower case).
    forward_headers: tuple[str, ...] = ()
    errors: OpenAIErrors | AnthropicErrors = OPENAI

    def parse(self, raw: bytes, content_type: str | None = None) -> Call:
        """Validate ``raw``; raise ``InvalidBody`` with ``param`` set."""
        body = json_object(raw)
        model = require_model(body)
        chars = self.prompt_chars(body)
        return Call(self, body, model, False, False, None, estimate(chars), raw)

    def prompt_chars(self, body: dict[str, Any]) -> int:
        """The characters of the prompt (validating it)."""
        return 0

    def prompt(self, body: dict[str, Any]) -> PromptView:
        return PromptView((), "")

    def prompt_input(self, body: dict[str, Any], traits: TemplateTraits) -> ChatInput | TextInput | None:
        """What the replica tokenises for this body (``dialects.chat_input``): the chat
        template's inputs, or the prompt's texts; None when the API has no prompt the
        gateway counts. Raises ``NotCountable`` for a body it cannot count exactly."""
        return None

    def question(self, body: dict[str, Any]) -> str | None:
        """The text the semantic cache compares by meaning, stripped; None if there is none."""
        return None

    def without_question(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with the question taken out (what must match exactly around it)."""
        return body

    def upstream_body(self, call: Call, served_model: str) -> bytes:
        """The body to send upstream: the raw bytes unless the model name must change."""
        if served_model == call.model:
            return call.raw
        return orjson.dumps({**call.body, "model": served_model})

    def scanner(self, call: Call) -> SseScanner:
        raise NotImplementedError(f"{self.name} does not stream")

    def usage(self, answer: dict[str, Any]) -> dict[str, int] | None:
        """The usage of a whole answer as ``prompt_tokens``/``completion_tokens``/``total_tokens``."""
        return openai_usage(answer.get("usage"))

    def __repr__(self) -> str:
        return f"<dialect {self.name} {self.path}>"


# -- shared validation ------------------------------------------------------------------------


def json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` parsed as a JSON object no deeper than ``MAX_JSON_DEPTH``."""
    if not raw:
        raise InvalidBody("The request body is empty; expected a JSON object.")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidBody(f"The request body is not valid JSON: {exc.msg}.") from exc
    if not isinstance(body, dict):
        raise InvalidBody("The request body must be a JSON object.")
    if deeper_than(body, MAX_JSON_DEPTH):
        raise InvalidBody(f"The request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels.")
    return body


def require_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidBody("'model' is required and must be a non-empty string.", param="model")
    return model


def stream_flag(body: dict[str, Any]) -> bool:
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise InvalidBody("'stream' must be a boolean.", param="stream")
    return stream


def estimate(chars: int) -> int:
    """Prompt tokens estimated from characters (at least one)."""
    return max(1, chars // CHARS_PER_TOKEN)


def deeper_than(value: dict[str, Any], limit: int) -> bool:
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


def positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidBody(f"'{name}' must be a positive integer.", param=name)
    return value


def number_in(body: dict[str, Any], name: str, low: float, high: float) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise InvalidBody(f"'{name}' must be a number between {low:g} and {high:g}.", param=name)


def schema_chars(body: dict[str, Any], names: tuple[str, ...] = ("tools", "functions")) -> int:
    """Characters the tool and function schemas add to the prompt (chat templates render
    them in); their JSON length stands in for the rendered text."""
    chars = 0
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, list):
            raise InvalidBody(f"'{name}' must be an array.", param=name)
        try:
            chars += len(orjson.dumps(value))
        except orjson.JSONEncodeError as exc:  # nested deeper than orjson writes
            raise InvalidBody(f"'{name}' is nested too deeply.", param=name) from exc
    return chars


def string_list(body: dict[str, Any], name: str) -> None:
    """``name`` is absent, a string, or a list of strings."""
    value = body.get(name)
    if (
        value is not None
        and not isinstance(value, str)
        and not (isinstance(value, list) and all(isinstance(s, str) for s in value))
    ):
        raise InvalidBody(f"'{name}' must be a string or a list of strings.", param=name)


def text_of(content: Any) -> str:
    """The text of a message's content: a string, or the text of its parts (``text`` fields)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def segment(role: str, text: str) -> str:
    return f"{role}{ROLE_END}{text}{TURN_END}"


def openai_usage(usage: Any) -> dict[str, int] | None:
    """OpenAI's usage object as it is, when it is one."""
    return usage if isinstance(usage, dict) else None
