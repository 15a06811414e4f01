"""Continuing Anthropic Messages streams, through vLLM's chat completions.

Anthropic continues a trailing assistant message (prefill); vLLM's ``/v1/messages`` does
not: it turns the request into a chat request without ``continue_final_message`` (vllm
0.32, ``entrypoints/anthropic/serving.py``, ``_build_base_request``), so a trailing
assistant turn is rendered closed and a new one is generated after it. But that endpoint
is itself a translation to chat: the same chat request, plus the partial text as a
continued assistant message, sent to ``/v1/chat/completions``, renders the original prompt
followed by the partial text. This module builds that request for text-only conversations
(the translation of tools, images, thinking and inline system turns is left to vLLM, not
repeated here) and turns the chat chunks back into the Messages events the client expects.
"""

from __future__ import annotations

from typing import Any

from dialects.continuation.base import Continuation, counts, events, remaining, stop_may_straddle, typed_event
from dialects.continuation.chat import CHAT_PATH

# A system block vLLM drops (Claude Code's per-request header), as its translation does.
_BILLING_HEADER = "x-anthropic-billing-header"
# Fields that change what vLLM's translation does beyond plain text: not continued.
_REFUSED = ("tools", "tool_choice", "thinking", "output_config")
# vLLM's own request fields its translation passes through to the chat request.
_PASSED = ("top_k", "top_p", "temperature", "cache_salt", "chat_template_kwargs", "vllm_xargs", "watermarking")


def plan_messages(call_body: dict[str, Any], relayed: bytes, tokens: int | None = None) -> Continuation | None:
    """The continuation of a Messages stream cut inside its first (text) block, as a chat
    request. ``tokens``: the relayed text's tokens when the caller knows them; else each
    delta counts one, a lower bound (vLLM merges a late reader's tokens into one delta and
    sends none for a token that ends inside a character), so the continuation may run past
    ``max_tokens`` by the difference."""
    if any(call_body.get(name) not in (None, [], {}) for name in _REFUSED):
        return None
    messages = _chat_messages(call_body)
    if messages is None or messages[-1]["role"] != "user":
        return None  # the client's own prefill is rendered closed by vLLM: not reproducible
    seen = _read(relayed)
    if seen is None:
        return None
    start, pieces = seen
    partial = "".join(pieces)
    if not partial or stop_may_straddle(call_body.get("stop_sequences"), partial):
        return None
    tokens = len(pieces) if tokens is None else tokens
    body: dict[str, Any] = {"model": call_body.get("model"), "messages": [*messages]}
    body["messages"].append({"role": "assistant", "content": partial})
    left = remaining(call_body.get("max_tokens"), tokens)
    body["max_tokens"] = body["max_completion_tokens"] = left
    if call_body.get("stop_sequences"):
        body["stop"] = call_body["stop_sequences"]
    for name in _PASSED:
        if call_body.get(name) is not None:
            body[name] = call_body[name]
    body.update(
        continue_final_message=True,
        add_generation_prompt=False,
        stream=True,
        stream_options={"include_usage": True},
    )
    return Continuation(CHAT_PATH, body, tokens, partial, MessagesSplicer(start, tokens))


class MessagesSplicer:
    """Turns the continuation's chat chunks into the rest of the client's Messages stream:
    a ``content_block_delta`` per non-empty text (vLLM's translation skips empty ones),
    ``content_block_stop`` when the choice finishes, then ``message_delta`` (the stop
    reason mapped as vLLM maps it, the client's usage) and ``message_stop`` on the usage
    chunk. ``[DONE]`` and the opening role chunk are dropped; comments pass.

    Usage: ``input_tokens`` as the original's ``message_start`` said (exact);
    ``output_tokens`` = the partial text's tokens as planned (the relayed deltas, the
    count the continuation's ``max_tokens`` was lowered by) + the continuation's completion
    tokens: never past the client's ``max_tokens``. (The continuation's prompt minus the
    original's would count the partial text re-tokenised, which overcounts wherever it
    re-tokenises differently: 40-50 tokens over ``max_tokens`` on the test model.)
    """

    __slots__ = ("_finish", "_input", "_stop_reason", "_tokens", "_usage")

    def __init__(self, start: dict[str, Any], tokens: int) -> None:
        usage = start.get("usage")
        usage = usage if isinstance(usage, dict) else {}
        self._input = {k: v for k, v in usage.items() if k != "output_tokens" and isinstance(v, int)}
        self._tokens = tokens
        self._finish: Any = None
        self._stop_reason: Any = None
        self._usage: dict[str, int] | None = None

    @property
    def usage(self) -> dict[str, int] | None:
        return self._usage

    def splice(self, block: bytes) -> bytes:
        out: list[bytes] = []
        for event in events(block):
            chunk = event.data
            if event.done:
                continue
            if not isinstance(chunk, dict):
                out.append(event.raw)
                continue
            if "error" in chunk:
                error = chunk["error"] if isinstance(chunk["error"], dict) else {}
                message = error.get("message", "The replica failed.")
                out.append(typed_event("error", {"type": "error", "error": {"type": "api_error", "message": message}}))
                continue
            for choice in chunk.get("choices") or ():
                if not isinstance(choice, dict):
                    continue
                delta = choice.get("delta")
                text = delta.get("content") if isinstance(delta, dict) else None
                if isinstance(text, str) and text:
                    piece = {"type": "text_delta", "text": text}
                    out.append(typed_event("content_block_delta", _delta(piece)))
                if choice.get("finish_reason") is not None and self._finish is None:
                    self._finish, self._stop_reason = choice["finish_reason"], choice.get("stop_reason")
                    out.append(typed_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
            usage = chunk.get("usage")
            if isinstance(usage, dict) and not chunk.get("choices") and self._finish is not None:
                out.append(self._end(usage))
        return b"".join(out)

    def _end(self, usage: dict[str, Any]) -> bytes:
        completion = usage.get("completion_tokens")
        prompt = sum(self._input.values())
        output = self._tokens + (completion if isinstance(completion, int) else 0)
        stop_reason, stop_sequence = _stop_reason(self._finish, self._stop_reason)
        client = {**self._input, "output_tokens": output}
        self._usage = counts(prompt, output)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        return typed_event("message_delta", {"type": "message_delta", "delta": delta, "usage": client}) + typed_event(
            "message_stop", {"type": "message_stop"}
        )


def _delta(piece: dict[str, Any]) -> dict[str, Any]:
    # Key order as vLLM writes it.
    return {"type": "content_block_delta", "delta": piece, "index": 0}


def _stop_reason(finish: Any, stop_reason: Any) -> tuple[str | None, str | None]:
    """vLLM's mapping (``_to_anthropic_stop_reason``), without tools."""
    if finish == "length":
        return "max_tokens", None
    if finish != "stop":
        return None, None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _read(relayed: bytes) -> tuple[dict[str, Any], list[str]] | None:
    """The relayed ``message_start``'s message and the texts of its first block, while that
    block is a text block still open; None for anything else (thinking, a tool, the end)."""
    start: dict[str, Any] | None = None
    opened = False
    pieces: list[str] = []
    for event in events(relayed):
        data = event.data
        if data is None and not event.kind:
            continue  # a comment
        kind = event.kind
        if kind == "ping":
            continue
        if not isinstance(data, dict):
            return None
        if kind == "message_start" and start is None and isinstance(data.get("message"), dict):
            start = data["message"]
        elif kind == "content_block_start" and start is not None and not opened and data.get("index") == 0:
            block = data.get("content_block")
            if not isinstance(block, dict) or block.get("type") != "text" or block.get("text"):
                return None
            opened = True
        elif kind == "content_block_delta" and opened and data.get("index") == 0:
            delta = data.get("delta")
            text = delta.get("text") if isinstance(delta, dict) and delta.get("type") == "text_delta" else None
            if not isinstance(text, str):
                return None
            pieces.append(text)
        else:
            return None  # a second block, a block's end, the message's end, an error
    if start is None or not pieces:
        return None
    return start, pieces


def _chat_messages(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The chat messages vLLM's translation makes of a text-only Messages request; None when
    the request holds anything else (images, tools, thinking, inline system turns)."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        text = _system_text(system)
        if text is None:
            return None
        if text:
            out.append({"role": "system", "content": text})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            return None
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            return None
        parts = []
        for block in content:
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                return None
            if block["text"]:
                parts.append({"type": "text", "text": block["text"]})
        if not parts:
            if message["role"] == "user":
                continue  # vLLM drops a user message left without content
            return None
        out.append({"role": message["role"], "content": parts[0]["text"] if len(parts) == 1 else parts})
    return out or None


def _system_text(system: Any) -> str | None:
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        return None
    parts = []
    for block in system:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            return None
        if block["text"] and not block["text"].startswith(_BILLING_HEADER):
            parts.append(block["text"])
    return "".join(parts)
