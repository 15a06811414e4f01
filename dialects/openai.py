"""OpenAI's chat completions, completions and embeddings, as vLLM serves them."""

from __future__ import annotations

from typing import Any

import orjson

from dialects.base import (
    CHARS_PER_TOKEN,
    JSON,
    ROLE_END,
    TOKENS_PER_MESSAGE,
    TURN_END,
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
    stream_flag,
    string_list,
    text_of,
)
from dialects.chat_input import ChatInput, NotCountable, TemplateTraits, TextInput, chat_tools, template_kwargs
from dialects.openai_answers import CHAT_ANSWERS, COMPLETION_ANSWERS
from dialects.stream import SseScanner


class _Generation(Dialect):
    """What chat and completions share: streaming with OpenAI's chunks, sampling parameters."""

    streams = True
    generates = True
    classifiable = True

    def parse(self, raw: bytes, content_type: str | None = None) -> Call:
        body = json_object(raw)
        model = require_model(body)
        chars = self.prompt_chars(body)
        stream = stream_flag(body)
        options = body.get("stream_options")
        if options is not None:
            if not isinstance(options, dict):
                raise InvalidBody("'stream_options' must be an object.", param="stream_options")
            if not stream:
                raise InvalidBody("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
        wants_usage = bool(options and options.get("include_usage"))
        max_tokens = positive_int(body, "max_completion_tokens") or positive_int(body, "max_tokens")
        n = positive_int(body, "n") or 1
        number_in(body, "temperature", 0.0, 2.0)
        number_in(body, "top_p", 0.0, 1.0)
        number_in(body, "presence_penalty", -2.0, 2.0)
        number_in(body, "frequency_penalty", -2.0, 2.0)
        string_list(body, "stop")
        return Call(self, body, model, stream, wants_usage, max_tokens, estimate(chars), raw, n)

    def upstream_body(self, call: Call, served_model: str) -> bytes:
        """The raw bytes unless the model or the usage flag must change."""
        if served_model == call.model and not (call.stream and not call.client_wants_usage):
            return call.raw
        body = dict(call.body)
        body["model"] = served_model
        if call.stream:
            # Always ask for usage so limits and metrics settle on real counts; the
            # gateway drops the usage chunk again when the client did not ask for it.
            options = dict(body.get("stream_options") or {})
            options["include_usage"] = True
            body["stream_options"] = options
        return orjson.dumps(body)

    def scanner(self, call: Call) -> SseScanner:
        return SseScanner(drop_usage=not call.client_wants_usage)


class Chat(_Generation):
    name, path, operation, prompt_param = "chat", "/v1/chat/completions", "chat", "messages"
    answers = CHAT_ANSWERS

    def prompt_chars(self, body: dict[str, Any]) -> int:
        return _chat_chars(body.get("messages")) + schema_chars(body)

    def prompt(self, body: dict[str, Any]) -> PromptView:
        """Every message as a role-tagged segment; the latest user message is the instruction.

        System prompts (mostly a fixed persona) and earlier turns are left out of the
        instruction: the question being asked now is what the tier must answer.
        """
        messages = body.get("messages")
        if not isinstance(messages, list):
            return PromptView((), "")
        segments: list[str] = []
        instruction = ""
        for message in messages:
            if not isinstance(message, dict):
                continue
            role, text = message.get("role", ""), text_of(message.get("content"))
            segments.append(f"{role}{ROLE_END}{text}{TURN_END}")  # segment(), inline: once per message
            if role == "user":
                instruction = text
        return PromptView(tuple(segments), instruction)

    def prompt_input(self, body: dict[str, Any], traits: TemplateTraits) -> ChatInput:
        """The messages as they came, the tools as vLLM dumps them, and chat's template keywords
        (vLLM's ``ChatCompletionRequest.build_chat_params``)."""
        messages = body["messages"]
        extra = {
            "add_generation_prompt": body.get("add_generation_prompt", True),
            "continue_final_message": body.get("continue_final_message", False),
            "documents": body.get("documents"),
            "reasoning_effort": body.get("reasoning_effort"),
        }
        return ChatInput(
            list(messages), chat_tools(body.get("tools")), template_kwargs(body.get("chat_template_kwargs"), extra)
        )

    def question(self, body: dict[str, Any]) -> str | None:
        """The last message, when it is a user message with string content (a tool result or a
        multi-part message is not a question the embedder was made for)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
            return None
        last = messages[-1]
        text = last.get("content")
        if last.get("role") != "user" or not isinstance(text, str):
            return None
        return text.strip() or None

    def without_question(self, body: dict[str, Any]) -> dict[str, Any]:
        """The last message keeps its other fields."""
        messages = body["messages"]
        last = {k: v for k, v in messages[-1].items() if k != "content"}
        return {**body, "messages": [*messages[:-1], last]}


class Completions(_Generation):
    name, path, operation, prompt_param = "completions", "/v1/completions", "text_completion", "prompt"
    answers = COMPLETION_ANSWERS

    def prompt_chars(self, body: dict[str, Any]) -> int:
        return _prompt_chars(body.get("prompt"))

    def prompt(self, body: dict[str, Any]) -> PromptView:
        """The prompt (the first, of several) as one segment and as the instruction."""
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt and isinstance(prompt[0], str) else None
        if not isinstance(prompt, str):
            return PromptView((), "")
        return PromptView((prompt,), prompt)

    def prompt_input(self, body: dict[str, Any], traits: TemplateTraits) -> TextInput:
        """Each prompt tokenised as it is, special tokens added (vLLM's completions default)."""
        prompt = body.get("prompt")
        add_special = body.get("add_special_tokens", True)
        if isinstance(prompt, str):
            return TextInput((prompt,), add_special is not False)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return TextInput((tuple(prompt),))
        if isinstance(prompt, list):
            prompts: list[str | tuple[int, ...]] = []
            for p in prompt:
                if isinstance(p, str):
                    prompts.append(p)
                elif isinstance(p, list):
                    prompts.append(tuple(p))
                else:
                    raise NotCountable("a prompt that is neither text nor token ids")
            return TextInput(tuple(prompts), add_special is not False)
        raise NotCountable("no prompt")

    def question(self, body: dict[str, Any]) -> str | None:
        """The one prompt string."""
        text = body.get("prompt")
        if isinstance(text, list) and len(text) == 1:
            text = text[0]
        if not isinstance(text, str):
            return None
        return text.strip() or None

    def without_question(self, body: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in body.items() if k != "prompt"}


class Embeddings(Dialect):
    name, path, operation, prompt_param = "embeddings", "/v1/embeddings", "embeddings", "input"

    def parse(self, raw: bytes, content_type: str | None = None) -> Call:
        body = json_object(raw)
        model = require_model(body)
        chars = self.prompt_chars(body)
        if stream_flag(body):
            raise InvalidBody("Embeddings cannot be streamed.", param="stream")
        return Call(self, body, model, False, False, None, estimate(chars), raw, content_type=JSON)

    def prompt_chars(self, body: dict[str, Any]) -> int:
        try:
            return _prompt_chars(body.get("input"))
        except InvalidBody:
            raise InvalidBody(
                "'input' is required: a string, an array of strings, or an array of token ids.", param="input"
            ) from None


def _chat_chars(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise InvalidBody("'messages' is required and must be a non-empty array.", param="messages")
    chars = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidBody(f"'messages[{i}]' must be an object.", param=f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidBody(f"'messages[{i}].role' is required and must be a string.", param=f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    raise InvalidBody(f"'messages[{i}].content' parts must be objects.", param=f"messages[{i}].content")
                text = part.get("text")
                if isinstance(text, str):
                    chars += len(text)
        elif content is None:
            if role != "assistant" or not message.get("tool_calls"):
                raise InvalidBody(f"'messages[{i}].content' is required.", param=f"messages[{i}].content")
        else:
            raise InvalidBody(
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
    raise InvalidBody("'prompt' is required: a string, an array of strings, or an array of token ids.", param="prompt")


CHAT = Chat()
COMPLETIONS = Completions()
EMBEDDINGS = Embeddings()
