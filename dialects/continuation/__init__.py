"""Finishing a stream on another replica when its own failed after the first byte.

``plan(api, call_body, relayed)`` reads the events already relayed to the client and
returns a ``Continuation`` (the request for the next replica, and the ``splice`` that
rewrites its stream into the client's) or None when the stream cannot be continued
exactly. One module per API:

    chat.py        chat completions (continue_final_message) and completions (prompt + text)
    messages.py    Anthropic Messages, continued through chat completions
    responses.py   Responses (a trailing assistant message with status "incomplete")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dialects.continuation.base import Continuation, Splicer
from dialects.continuation.chat import plan_chat, plan_completions
from dialects.continuation.messages import plan_messages
from dialects.continuation.responses import plan_responses

__all__ = [
    "PLANS",
    "Continuation",
    "Splicer",
    "plan",
    "plan_chat",
    "plan_completions",
    "plan_messages",
    "plan_responses",
]

# By dialect name (``Dialect.name``).
PLANS: dict[str, Callable[[dict[str, Any], bytes, int | None], Continuation | None]] = {
    "chat": plan_chat,
    "completions": plan_completions,
    "messages": plan_messages,
    "responses": plan_responses,
}


def plan(api: str, call_body: dict[str, Any], relayed: bytes, tokens: int | None = None) -> Continuation | None:
    """The continuation of ``api``'s stream cut after ``relayed`` (whole events, as sent to
    the client), or None: an API that is not continued, or a stream that cannot be exactly.

    ``tokens``: how many tokens the relayed text holds, when the caller knows (``/tokenize``
    of a first plan's ``partial_text`` on the next replica); else they are counted from the
    events, exactly when the stream carries token ids or continuous usage, otherwise as a
    lower bound (one per event), and the continuation may then exceed the token limit.
    """
    planner = PLANS.get(api)
    return planner(call_body, relayed, tokens) if planner is not None else None
