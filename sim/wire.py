"""What every endpoint of the simulated server shares at the HTTP edge.

The app's state (the engine, the served model's name and context length), the JSON body,
the served-model check, and vLLM's error body. vLLM answers a body that fails its request
schema (pydantic) in OpenAI's envelope on every route, the Anthropic ones included; an API
with an envelope of its own uses it only for the errors its handler returns, which is why a
``Rejection`` says which of the two it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from sim.engine import SimEngine

ENGINE_KEY = web.AppKey("engine", SimEngine)
MODEL_KEY = web.AppKey("model", str)
MAX_MODEL_LEN_KEY = web.AppKey("max_model_len", int)
# Requests received by their ``priority`` field (vLLM's per-request priority, 0 when
# absent): the simulator accepts it and schedules first come first served all the same;
# ``GET /sim/priorities`` shows the counts, so a test can see what a gateway sent.
PRIORITIES_KEY = web.AppKey("priorities", dict[int, int])
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass(frozen=True)
class Rejection:
    """A request refused as vLLM refuses it: the status, the message and vLLM's error type."""

    status: int
    message: str
    type_: str = "BadRequestError"
    param: str | None = None
    # True: the body failed the request schema, which vLLM answers in OpenAI's envelope on any route.
    schema: bool = False


def invalid(message: str) -> Rejection:
    """A body that does not fit the endpoint's request schema (vLLM: a pydantic validation error)."""
    return Rejection(400, message, schema=True)


def openai_error(rejection: Rejection) -> web.Response:
    """vLLM's error body: OpenAI's envelope with vLLM's type names and the status as ``code``."""
    error = {"message": rejection.message, "type": rejection.type_, "param": rejection.param, "code": rejection.status}
    return web.Response(status=rejection.status, body=orjson.dumps({"error": error}), content_type="application/json")


def json_response(payload: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


async def read_body(request: web.Request) -> dict[str, Any] | Rejection:
    """The request's JSON object, or why it is not one."""
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return invalid("Invalid JSON body")
    if not isinstance(body, dict):
        return invalid("Body must be a JSON object")
    return body


def check_model(body: dict[str, Any], served: str, *, optional: bool = False) -> Rejection | None:
    """vLLM's 404 for a model it does not serve; ``optional``: a body without one means the served model."""
    model = body.get("model")
    if model == served or (optional and model is None):
        return None
    return Rejection(404, f"The model `{model}` does not exist.", "NotFoundError")


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
