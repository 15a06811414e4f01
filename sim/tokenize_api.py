"""vLLM's ``/tokenize`` and ``/detokenize``, over the simulator's own tokenizer.

The tokens are the ones the engine counts and caches (``sim.model.prompt_token_ids``: one
per four characters, its id the chunk's CRC-32), and a conversation is rendered as the
generation endpoints render it (``sim.prompts``), so ``count`` equals the ``prompt_tokens``
of the same prompt sent to chat, Responses or Messages. A CRC cannot be reversed: the server
remembers the chunks behind the ids it has handed out, and detokenizes those.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from aiohttp import web

from sim.engine import CHARS_PER_TOKEN
from sim.model import prompt_token_ids
from sim.prompts import chat_turns, render_chat
from sim.wire import (
    MAX_MODEL_LEN_KEY,
    MODEL_KEY,
    Rejection,
    check_model,
    invalid,
    json_response,
    openai_error,
    read_body,
)

# Chunks remembered for /detokenize; the least recently tokenized go first past this.
VOCABULARY_SIZE = 1 << 20


class Vocabulary:
    """The text behind each token id the server has handed out, bounded, least recent out first."""

    def __init__(self, capacity: int = VOCABULARY_SIZE) -> None:
        self.capacity = capacity
        self._chunks: OrderedDict[int, str] = OrderedDict()

    def tokenize(self, text: str) -> tuple[list[int], list[str]]:
        """The engine's token ids for ``text`` and their chunks, remembered for ``detokenize``."""
        ids = prompt_token_ids(text)
        chunks = [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)] or [""]
        for token, chunk in zip(ids, chunks, strict=True):
            self._chunks[token] = chunk
            self._chunks.move_to_end(token)
        while len(self._chunks) > self.capacity:
            self._chunks.popitem(last=False)
        return ids, chunks

    def detokenize(self, ids: list[int]) -> str | int:
        """The text of ``ids``, or the first id this vocabulary does not know."""
        pieces = []
        for token in ids:
            chunk = self._chunks.get(token)
            if chunk is None:
                return token
            pieces.append(chunk)
        return "".join(pieces)


VOCABULARY_KEY = web.AppKey("vocabulary", Vocabulary)


def _prompt(body: dict[str, Any]) -> str | Rejection:
    """The text to tokenize: ``prompt`` as is, or ``messages`` rendered as a generation renders them."""
    if isinstance(body.get("prompt"), str):
        return str(body["prompt"])
    messages = body.get("messages")
    if not isinstance(messages, list):
        return invalid("prompt (a string) or messages (a list) is required")
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        return invalid("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    add_generation_prompt = body.get("add_generation_prompt", True) and not body.get("continue_final_message")
    return render_chat(chat_turns(messages), add_generation_prompt=bool(add_generation_prompt))


async def tokenize(request: web.Request) -> web.Response:
    body = await read_body(request)
    if isinstance(body, Rejection):
        return openai_error(body)
    prompt = _prompt(body)
    if isinstance(prompt, Rejection):
        return openai_error(prompt)
    rejection = check_model(body, request.app[MODEL_KEY], optional=True)
    if rejection is not None:
        return openai_error(rejection)
    ids, chunks = request.app[VOCABULARY_KEY].tokenize(prompt)
    payload = {
        "count": len(ids),
        "max_model_len": request.app[MAX_MODEL_LEN_KEY],
        "tokens": ids,
        "token_strs": chunks if body.get("return_token_strs") else None,
    }
    return json_response(payload)


async def detokenize(request: web.Request) -> web.Response:
    body = await read_body(request)
    if isinstance(body, Rejection):
        return openai_error(body)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        return openai_error(invalid("tokens must be a list of non-negative integers"))
    rejection = check_model(body, request.app[MODEL_KEY], optional=True)
    if rejection is not None:
        return openai_error(rejection)
    text = request.app[VOCABULARY_KEY].detokenize(ids)
    if isinstance(text, int):
        return openai_error(Rejection(400, f"Token id {text} is out of vocabulary", param="tokens"))
    return json_response({"prompt": text})
