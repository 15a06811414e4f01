"""The answers of OpenAI's chat completions and completions: folded, replayed, keyed.

What an entry keeps: the text, tool calls, reasoning text, finish reason, usage and model
of the one choice. Only clean endings are kept (``stop``, ``length``, ``tool_calls``): an
``abort`` (vLLM's reason when a request was cancelled), a stream cut short, an error
event, several choices or a missing ``usage`` yield None.

A stream is read choice delta by choice delta (tool-call deltas merged by index). A replay
streams as a live answer relayed by the gateway does:

    chat        role delta {"role": "assistant", "content": ""} first, then content deltas,
                tool-call deltas, finish_reason on the last choice event
    completion  text chunks, finish_reason on the last one
    both        a usage-only event (``choices: []``) only if the client asked for
                ``stream_options.include_usage``, then ``data: [DONE]``

Both kinds store entries in layout 1, the one gateways wrote before other APIs were cached.
"""

from __future__ import annotations

from typing import Any, ClassVar

from dialects.answer import Answers, CachedCompletion, StreamCollector, data_event, split_text

# Endings that describe a complete answer worth replaying.
CACHEABLE_FINISH = frozenset({"stop", "length", "tool_calls"})
DONE = b"data: [DONE]\n\n"


class ChoicesAnswers(Answers):
    """Chat's (``chat``) or completions' (``completion``) answers: one choice of text."""

    def __init__(self, kind: str, id_prefix: str, *, chat: bool) -> None:
        super().__init__(kind, id_prefix, layout=1)
        self.chat = chat

    def collector(self, max_chars: int) -> StreamCollector:
        return ChoicesCollector(self.kind, chat=self.chat, max_chars=max_chars)

    def from_object(self, data: dict[str, Any]) -> CachedCompletion | None:
        choices = data.get("choices")
        usage = data.get("usage")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return None
        choice = choices[0]
        finish = choice.get("finish_reason")
        counts = usage_counts(usage)
        if finish not in CACHEABLE_FINISH or counts is None or not isinstance(data.get("model"), str):
            return None
        if self.chat:
            message = choice.get("message")
            if not isinstance(message, dict):
                return None
            content = message.get("content") or ""
            calls = message.get("tool_calls") or []
            reasoning = message.get("reasoning_content")
        else:
            content, calls, reasoning = choice.get("text") or "", [], None
        if not isinstance(content, str) or not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            return None
        return CachedCompletion(
            kind=self.kind,
            model=data["model"],
            content=content,
            finish_reason=finish,
            prompt_tokens=counts[0],
            completion_tokens=counts[1],
            tool_calls=tuple(calls),
            reasoning_content=reasoning if isinstance(reasoning, str) else None,
        )

    def replay_object(
        self, entry: CachedCompletion, *, completion_id: str, created: int, request: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """``chat.completion`` / ``text_completion`` as vLLM sends them."""
        if self.chat:
            message: dict[str, Any] = {
                "role": "assistant",
                # OpenAI sends null content alongside tool calls.
                "content": None if not entry.content and entry.tool_calls else entry.content,
                "tool_calls": list(entry.tool_calls),
            }
            if entry.reasoning_content is not None:
                message["reasoning_content"] = entry.reasoning_content
            choice: dict[str, Any] = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": entry.finish_reason,
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": entry.content,
                "logprobs": None,
                "finish_reason": entry.finish_reason,
                "stop_reason": None,
            }
            obj = "text_completion"
        return {
            "id": completion_id,
            "object": obj,
            "created": created,
            "model": entry.model,
            "choices": [choice],
            "usage": entry.usage,
        }

    def replay_events(
        self,
        entry: CachedCompletion,
        *,
        completion_id: str,
        created: int,
        include_usage: bool,
        request: dict[str, Any] | None = None,
    ) -> list[bytes]:
        head = {
            "id": completion_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": created,
            "model": entry.model,
        }
        choices: list[dict[str, Any]] = []
        if self.chat:
            choices.append(_delta({"role": "assistant", "content": ""}))
            if entry.reasoning_content:
                choices.extend(_delta({"reasoning_content": p}) for p in split_text(entry.reasoning_content))
            choices.extend(_delta({"content": p}) for p in split_text(entry.content))
            for index, call in enumerate(entry.tool_calls):
                choices.append(_delta({"tool_calls": [{"index": index, **call}]}))
            if len(choices) == 1:
                # No content and no tool calls: one empty delta still carries the finish reason.
                choices.append(_delta({"content": ""}))
        else:
            choices.extend(
                {"index": 0, "text": p, "logprobs": None, "finish_reason": None, "stop_reason": None}
                for p in split_text(entry.content) or [""]
            )
        choices[-1]["finish_reason"] = entry.finish_reason
        events = [data_event({**head, "choices": [c]}) for c in choices]
        if include_usage:
            events.append(data_event({**head, "choices": [], "usage": entry.usage}))
        events.append(DONE)
        return events

    def several_prompts(self, body: dict[str, Any]) -> bool:
        """Completions: a list of strings or of token-id lists is several prompts; a flat id list is one."""
        if self.chat:
            return False
        prompt = body.get("prompt")
        return isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt)


class ChoicesCollector(StreamCollector):
    """OpenAI's chat and completions chunks: choice deltas, tool-call deltas by index, a usage chunk."""

    __slots__ = ("_calls", "_chat", "_content", "_finish", "_kind", "_model", "_reasoning", "_usage")

    END: ClassVar[bytes] = b"[DONE]"

    def __init__(self, kind: str, *, chat: bool, max_chars: int) -> None:
        super().__init__(max_chars=max_chars)
        self._kind = kind
        self._chat = chat
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._model: str | None = None
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None

    def _take(self, data: dict[str, Any]) -> bool:
        if isinstance(data.get("model"), str):
            self._model = data["model"]
        usage = data.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        choices = data.get("choices") or []
        if not isinstance(choices, list):
            return False
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                return False
            if self._chat:
                delta = choice.get("delta") or {}
                if not isinstance(delta, dict) or not self._add_calls(delta.get("tool_calls")):
                    return False
                text = delta.get("content")
                reasoning = delta.get("reasoning_content")
                if isinstance(reasoning, str):
                    self._reasoning.append(reasoning)
                    self._chars += len(reasoning)
            else:
                text = choice.get("text")
            if isinstance(text, str) and text:
                self._content.append(text)
                self._chars += len(text)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
        return True

    def _add_calls(self, deltas: Any) -> bool:
        """Merge tool-call deltas; False on a shape that cannot be a tool call."""
        # They arrive by index: id, type and name once, the arguments in pieces.
        if deltas is None:
            return True
        if not isinstance(deltas, list):
            return False
        for delta in deltas:
            if not isinstance(delta, dict):
                return False
            index, function = delta.get("index", 0), delta.get("function") or {}
            if not isinstance(index, int) or not isinstance(function, dict):
                return False
            call = self._calls.setdefault(index, {"function": {"arguments": ""}})
            for name in ("id", "type"):
                if delta.get(name) is not None:
                    call[name] = delta[name]
            if function.get("name") is not None:
                call["function"]["name"] = function["name"]
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                call["function"]["arguments"] += arguments
                self._chars += len(arguments)
        return True

    def result(
        self, usage: dict[str, Any] | None = None, final: dict[str, Any] | None = None
    ) -> CachedCompletion | None:
        if self._failed:
            return None
        counts = usage_counts(self._usage or usage)
        if counts is None or self._finish not in CACHEABLE_FINISH or self._model is None:
            return None
        calls = tuple(self._calls[i] for i in sorted(self._calls))
        return CachedCompletion(
            kind=self._kind,
            model=self._model,
            content="".join(self._content),
            finish_reason=self._finish,
            prompt_tokens=counts[0],
            completion_tokens=counts[1],
            tool_calls=calls,
            reasoning_content="".join(self._reasoning) if self._reasoning else None,
        )


def usage_counts(usage: Any) -> tuple[int, int] | None:
    """Prompt and completion tokens of OpenAI's ``usage``, when it has both."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return prompt, completion


def _delta(delta: dict[str, Any]) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}


# Ids as vLLM's: ``chatcmpl-<32 hex>``, ``cmpl-<32 hex>``.
CHAT_ANSWERS = ChoicesAnswers("chat", "chatcmpl-", chat=True)
COMPLETION_ANSWERS = ChoicesAnswers("completion", "cmpl-", chat=False)
