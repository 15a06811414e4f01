"""The prompt text the engine sees for a conversation, whichever API it came through.

vLLM renders chat, Responses and Messages requests through the same chat template, so one
conversation costs the same prompt tokens on each; the simulator keeps that property with
one stand-in template: ``<|role|>text`` per turn, one turn a line, and ``<|assistant|>`` last
when the model is to answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

Turn = tuple[str, str]  # (role, text)

GENERATION_PROMPT = "<|assistant|>"


def render_chat(turns: Sequence[Turn], *, add_generation_prompt: bool = True) -> str:
    lines = [f"<|{role}|>{text}" for role, text in turns]
    if add_generation_prompt:
        lines.append(GENERATION_PROMPT)
    return "\n".join(lines)


def text_of(content: Any) -> str:
    """A message's text: a string as is, the text of a list of parts one part a line."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def chat_turns(messages: Iterable[Any]) -> list[Turn]:
    """OpenAI chat messages as turns; a message without content (a bare tool call) adds none."""
    return [
        (str(m.get("role")), text_of(m["content"]))
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), (str, list))
    ]
