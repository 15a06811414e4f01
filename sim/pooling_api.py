"""vLLM's pooling endpoints: ``/v1/embeddings``, ``/score`` and ``/rerank`` (also under ``/v1``).

No model runs: a text's vector is drawn from its hash, so equal texts get equal vectors and a
text scores 1.0 against itself. A pair's score is the cosine of the two vectors mapped onto
[0, 1], the range of a cross-encoder's sigmoid, which vLLM applies by default. Pooling takes
no GPU time here; only the answers' shapes and token counts are vLLM's
(``vllm/entrypoints/pooling/score/protocol.py``).
"""

from __future__ import annotations

import hashlib
import math
import time
import uuid
from typing import Any

from aiohttp import web

from sim.model import prompt_token_ids
from sim.wire import MODEL_KEY, Rejection, check_model, invalid, json_response, openai_error, read_body

EMBEDDING_DIM = 64
# ScoreRequest's spellings of its two sides, in the order vLLM's union tries them.
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


def vector(text: str) -> list[float]:
    """A unit vector of ``EMBEDDING_DIM`` floats that depends on nothing but the text."""
    digest = hashlib.sha512(text.encode()).digest()
    raw = [(digest[i % len(digest)] - 127.5) / 127.5 for i in range(EMBEDDING_DIM)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


def relevance(query: str, document: str) -> float:
    """The pair's score in [0, 1]: 1.0 for equal texts, deterministic for any other pair."""
    if query == document:
        return 1.0  # exactly, where the float dot product of a unit vector with itself may fall short
    cosine = sum(a * b for a, b in zip(vector(query), vector(document), strict=True))
    return min(1.0, max(0.0, (1.0 + cosine) / 2))


def pair_tokens(first: str, second: str) -> int:
    """A cross-encoder reads both texts as one prompt; its tokens are the engine's."""
    return len(prompt_token_ids(first)) + len(prompt_token_ids(second))


def pairs(first: list[str], second: list[str]) -> list[tuple[str, str]] | Rejection:
    """vLLM pairs one query with every text, or the two lists position by position."""
    if len(first) == 1:
        return [(first[0], text) for text in second]
    if len(first) == len(second):
        return list(zip(first, second, strict=True))
    return Rejection(400, "Input lengths must be either 1:1, 1:N or N:N")


def _texts(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    return None


async def embeddings(request: web.Request) -> web.Response:
    body = await read_body(request)
    if isinstance(body, Rejection):
        return openai_error(body)
    if body.get("model") != request.app[MODEL_KEY]:
        return openai_error(Rejection(404, "The model does not exist.", "NotFoundError"))
    inputs = body.get("input")
    texts = [inputs] if isinstance(inputs, str) else inputs
    if not isinstance(texts, list) or not texts:
        return openai_error(Rejection(400, "input missing"))
    data = [{"object": "embedding", "index": i, "embedding": vector(str(t))} for i, t in enumerate(texts)]
    tokens = sum(max(1, len(str(t)) // 4) for t in texts)
    payload = {
        "object": "list",
        "data": data,
        "model": request.app[MODEL_KEY],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }
    return json_response(payload)


async def score(request: web.Request) -> web.Response:
    """``{text_1, text_2}`` (or vLLM's other spellings) -> one score per pair, in input order."""
    body = await read_body(request)
    if isinstance(body, Rejection):
        return openai_error(body)
    sides = next(((body.get(a), body.get(b)) for a, b in SCORE_SIDES if a in body and b in body), None)
    first, second = (_texts(sides[0]), _texts(sides[1])) if sides else (None, None)
    if first is None or second is None:
        return openai_error(invalid("text_1 and text_2 must be strings or non-empty lists of strings"))
    served = request.app[MODEL_KEY]
    rejection = check_model(body, served, optional=True)
    if rejection is not None:
        return openai_error(rejection)
    scored = pairs(first, second)
    if isinstance(scored, Rejection):
        return openai_error(scored)
    data = [{"index": i, "object": "score", "score": relevance(a, b)} for i, (a, b) in enumerate(scored)]
    tokens = sum(pair_tokens(a, b) for a, b in scored)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}
    payload = {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": served,
        "data": data,
        "usage": usage,
    }
    return json_response(payload)


async def rerank(request: web.Request) -> web.Response:
    """``{query, documents, top_n?}`` -> the documents by falling relevance, the best ``top_n``."""
    body = await read_body(request)
    if isinstance(body, Rejection):
        return openai_error(body)
    query, documents, top_n = body.get("query"), _texts(body.get("documents")), body.get("top_n", 0)
    if not isinstance(query, str) or documents is None or not isinstance(top_n, int) or isinstance(top_n, bool):
        return openai_error(invalid("query must be a string, documents a non-empty list of strings, top_n an integer"))
    served = request.app[MODEL_KEY]
    rejection = check_model(body, served, optional=True)
    if rejection is not None:
        return openai_error(rejection)
    scores = [relevance(query, doc) for doc in documents]
    ranked = sorted(range(len(documents)), key=scores.__getitem__, reverse=True)  # stable: ties keep input order
    if 0 < top_n < len(documents):  # vLLM: top_n 0 (the default) keeps every document
        ranked = ranked[:top_n]
    results = [
        {"index": i, "document": {"text": documents[i], "multi_modal": None}, "relevance_score": scores[i]}
        for i in ranked
    ]
    tokens = sum(pair_tokens(query, doc) for doc in documents)
    payload = {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": served,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }
    return json_response(payload)
