"""Continuing OpenAI Responses streams.

vLLM continues a Responses request whose last input item is an assistant message with
``status: "incomplete"`` (or ``"in_progress"``): it renders it with
``continue_final_message`` (vllm 0.32, ``entrypoints/openai/responses/utils.py``,
``should_continue_final_message``). So the continuation is the same request with the
relayed text as such an item, and its events are rewritten into the client's stream: the
opening events dropped, the ids, ``created_at`` and ``sequence_number`` made the
original's, and the texts that sum the item up prefixed with the partial text.
"""

from __future__ import annotations

from typing import Any

from dialects.continuation.base import Continuation, counts, events, remaining, stop_may_straddle, typed_event

RESPONSES_PATH = "/v1/responses"
# The client already has these for the continued item (and the response).
_OPENING = frozenset(
    {"response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"}
)
# Events before the first text that the client may have been sent.
_BEFORE_TEXT = _OPENING
# The last event of a stream, with the whole response.
_FINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
# Reasoning, log probabilities, a previous response the replica cannot hold: not continued.
_REFUSED = ("reasoning", "top_logprobs", "previous_response_id")


def plan_responses(call_body: dict[str, Any], relayed: bytes, tokens: int | None = None) -> Continuation | None:
    """The continuation of a Responses stream cut inside its first message's text.

    ``call_body`` is the body as sent upstream (the gateway has expanded any
    ``previous_response_id`` into the input already). ``tokens``: the relayed text's tokens
    when the caller knows them; else each text delta counts one, a lower bound (vLLM merges
    a late reader's tokens into one delta and sends none for a token that ends inside a
    character), so the continuation may run past ``max_output_tokens`` by the difference.
    """
    if any(call_body.get(name) not in (None, [], {}, 0) for name in _REFUSED):
        return None
    if call_body.get("tools") and call_body.get("tool_choice") != "none":
        return None  # a call's parser would read the continuation's text alone, not the partial before it
    text = call_body.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict) and text["format"].get("type") != "text":
        return None  # structured output: its grammar would restart at the partial text's end
    include = call_body.get("include")
    if isinstance(include, list) and any("logprobs" in str(x) for x in include):
        return None
    value = call_body.get("input")
    if isinstance(value, str):
        items: list[Any] = [{"role": "user", "content": value}]
    elif isinstance(value, list) and value:
        items = list(value)
    else:
        return None
    seen = _read(relayed)
    if seen is None:
        return None
    response, item_id, last_sequence, pieces = seen
    partial = "".join(pieces)
    if not partial or stop_may_straddle(call_body.get("stop"), partial):
        return None
    tokens = len(pieces) if tokens is None else tokens
    body = dict(call_body)
    prefill = {
        "type": "message",
        "role": "assistant",
        "status": "incomplete",
        "content": [{"type": "output_text", "text": partial, "annotations": []}],
    }
    body["input"] = [*items, prefill]
    left = remaining(call_body.get("max_output_tokens"), tokens)
    if left is not None:
        body["max_output_tokens"] = left
    body["stream"] = True
    body["store"] = False
    splicer = ResponsesSplicer(response, item_id, last_sequence, partial, tokens, call_body.get("max_output_tokens"))
    return Continuation(RESPONSES_PATH, body, tokens, partial, splicer)


class ResponsesSplicer:
    """Rewrites the continuation's typed events into the rest of the client's stream.

    Dropped: ``response.created``, ``response.in_progress``, and the first item's
    ``output_item.added`` and ``content_part.added``. Every other event gets the next
    ``sequence_number`` after the relayed ones, the original item id and response id (and
    ``created_at``, ``max_output_tokens``); ``output_text.done``, ``content_part.done``,
    ``output_item.done`` and the final response carry the whole text, partial text first.

    Usage: ``output_tokens`` = the planned relayed tokens + the continuation's;
    ``input_tokens`` = the continuation's minus the planned relayed tokens (the original's
    count would have come only with its final event): the original's when the count was
    given exactly (``/tokenize`` of the partial text) and re-tokenising kept its length.
    """

    __slots__ = (
        "_closed",
        "_created_at",
        "_id",
        "_item_id",
        "_max_output",
        "_partial",
        "_sequence",
        "_tokens",
        "_usage",
    )

    def __init__(
        self,
        response: dict[str, Any],
        item_id: str,
        last_sequence: int,
        partial: str,
        tokens: int,
        max_output: Any,
    ) -> None:
        self._id = response.get("id")
        self._created_at = response.get("created_at")
        self._item_id = item_id
        self._sequence = last_sequence
        self._partial = partial
        self._tokens = tokens
        self._max_output = max_output
        self._usage: dict[str, int] | None = None
        # The continued item's output_item.done went through.
        self._closed = False

    @property
    def usage(self) -> dict[str, int] | None:
        return self._usage

    def splice(self, block: bytes) -> bytes:
        out: list[bytes] = []
        for event in events(block):
            data = event.data
            if not isinstance(data, dict):
                out.append(event.raw)  # comments
                continue
            kind = event.kind
            if kind in _OPENING and data.get("output_index", 0) == 0 and data.get("content_index", 0) == 0:
                continue
            if kind in _FINAL and not self._closed:
                out.append(self._close())
            data = dict(data)
            self._sequence += 1
            if "sequence_number" in data:
                data["sequence_number"] = self._sequence
            first = data.get("output_index") == 0
            if first and "item_id" in data:
                data["item_id"] = self._item_id
            if kind == "response.output_text.done" and first and isinstance(data.get("text"), str):
                data["text"] = self._partial + data["text"]
            elif kind == "response.content_part.done" and first and isinstance(data.get("part"), dict):
                data["part"] = self._prefixed(data["part"])
            elif kind == "response.output_item.done" and first and isinstance(data.get("item"), dict):
                data["item"] = self._item(data["item"])
                self._closed = True
            elif isinstance(data.get("response"), dict):
                data["response"] = self._response(data["response"])
            out.append(typed_event(kind, data))
        return b"".join(out)

    def _close(self) -> bytes:
        """The continued item's closing events, when the continuation sent none: it generated
        no text (a token ending inside a character, then the limit), so vLLM opened no item."""
        self._closed = True
        where = {"content_index": 0, "item_id": self._item_id, "output_index": 0}
        closing = [
            ("response.output_text.done", {**where, "logprobs": [], "text": self._partial}),
            ("response.content_part.done", {**where, "part": self._part()}),
            ("response.output_item.done", {"item": self._message(), "output_index": 0}),
        ]
        out = []
        for kind, data in closing:
            self._sequence += 1
            out.append(typed_event(kind, {**data, "sequence_number": self._sequence, "type": kind}))
        return b"".join(out)

    def _part(self) -> dict[str, Any]:
        return {"annotations": [], "text": self._partial, "type": "output_text", "logprobs": None}

    def _message(self) -> dict[str, Any]:
        return {
            "id": self._item_id,
            "content": [self._part()],
            "role": "assistant",
            "status": "completed",
            "type": "message",
        }

    def _prefixed(self, part: dict[str, Any]) -> dict[str, Any]:
        if part.get("type") == "output_text" and isinstance(part.get("text"), str):
            return {**part, "text": self._partial + part["text"]}
        return part

    def _item(self, item: dict[str, Any]) -> dict[str, Any]:
        item = {**item, "id": self._item_id}
        content = item.get("content")
        if isinstance(content, list) and content and isinstance(content[0], dict):
            item["content"] = [self._prefixed(content[0]), *content[1:]]
        return item

    def _response(self, response: dict[str, Any]) -> dict[str, Any]:
        response = {**response, "id": self._id, "created_at": self._created_at}
        if "max_output_tokens" in response:
            response["max_output_tokens"] = self._max_output
        output = response.get("output")
        if isinstance(output, list) and output and isinstance(output[0], dict) and output[0].get("type") == "message":
            response["output"] = [self._item(output[0]), *output[1:]]
        elif isinstance(output, list):
            response["output"] = [self._message(), *output]
        usage = response.get("usage")
        if isinstance(usage, dict):
            given, made = usage.get("input_tokens"), usage.get("output_tokens")
            if isinstance(given, int) and isinstance(made, int):
                mine = counts(max(0, given - self._tokens), made + self._tokens)
                self._usage = mine
                response["usage"] = {
                    **usage,
                    "input_tokens": mine["prompt_tokens"],
                    "output_tokens": mine["completion_tokens"],
                    "total_tokens": mine["total_tokens"],
                }
        return response


def _read(relayed: bytes) -> tuple[dict[str, Any], str, int, list[str]] | None:
    """The relayed response (from ``response.created``), its first item's id, the last
    ``sequence_number`` and the texts of its first message's first part, while that part
    is still being written; None for anything else (reasoning, a call, a second item or
    part, a refusal, any ``*.done``, the end, an error)."""
    response: dict[str, Any] | None = None
    item_id: str | None = None
    sequence = -1
    pieces: list[str] = []
    for event in events(relayed):
        data = event.data
        if data is None and not event.kind:
            continue  # a comment
        if not isinstance(data, dict):
            return None
        kind = event.kind
        number = data.get("sequence_number")
        if isinstance(number, int):
            sequence = number
        if kind == "response.created" and isinstance(data.get("response"), dict):
            response = data["response"]
        elif kind in _BEFORE_TEXT and data.get("output_index", 0) == 0 and data.get("content_index", 0) == 0:
            item = data.get("item")
            if kind == "response.output_item.added":
                if not isinstance(item, dict) or item.get("type") != "message" or not isinstance(item.get("id"), str):
                    return None
                item_id = item["id"]
            part = data.get("part")
            text_part = isinstance(part, dict) and part.get("type") == "output_text"
            if kind == "response.content_part.added" and not text_part:
                return None
        elif kind == "response.output_text.delta" and item_id is not None and _first(data):
            if not isinstance(data.get("delta"), str):
                return None
            pieces.append(data["delta"])
        else:
            return None
    if response is None or item_id is None or not pieces:
        return None
    return response, item_id, sequence, pieces


def _first(data: dict[str, Any]) -> bool:
    return data.get("output_index") == 0 and data.get("content_index") == 0
