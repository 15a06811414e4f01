"""A vLLM-compatible server backed by a simulated GPU (``engine: sim``, ``fleetgate sim``).

It serves what the gateway and its tests use of vLLM's OpenAI server, byte-compatible in
shape: ``/health``, ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions``
(streaming with ``stream_options.include_usage``, non-streaming with ``usage``),
``/v1/embeddings`` (deterministic vectors) and ``/metrics`` with vLLM's metric names.
*When* tokens come out is the engine's business (``sim.engine``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from sim.engine import FixedRateConfig, FixedRateEngine, SimEngine, SimRequest

# vLLM's default when a chat request sets no max_tokens is "the rest of the context";
# the simulator uses a bounded stand-in so a forgotten max_tokens cannot stream forever.
DEFAULT_MAX_TOKENS = 256
EMBEDDING_DIM = 64
ENGINE_KEY = web.AppKey("engine", SimEngine)
MODEL_KEY = web.AppKey("model", str)
BUSY_HEALTH_DELAY_KEY = web.AppKey("busy_health_delay_s", float)


def _error(status: int, message: str, type_: str = "BadRequestError") -> web.Response:
    # vLLM's error body (OpenAI's envelope, with vLLM's type names).
    body = {"error": {"message": message, "type": type_, "param": None, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _prompt_text(kind: str, body: dict[str, Any]) -> str | None:
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        parts = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                parts.append(f"<|{m.get('role')}|>{content}")
            elif isinstance(content, list):
                parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
        return "\n".join(parts) + "\n<|assistant|>"
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        return " ".join(str(p) for p in prompt)
    return None


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    served = request.app[MODEL_KEY]
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return _error(400, "Invalid JSON body")
    if not isinstance(body, dict):
        return _error(400, "Body must be a JSON object")
    if body.get("model") != served:
        return _error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
    prompt = _prompt_text(kind, body)
    if prompt is None:
        return _error(400, "messages or prompt missing")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or max_tokens < 1:
        return _error(400, "max_tokens must be a positive integer")
    seed = body.get("seed") if isinstance(body.get("seed"), int) else None
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    rid = f"{prefix}-{uuid.uuid4().hex}"
    try:
        stream = engine.submit(SimRequest(request_id=rid, prompt=prompt, max_tokens=max_tokens, seed=seed))
    except ValueError as exc:  # the prompt does not fit the context window
        return _error(400, str(exc))
    created = int(time.time())
    try:
        if body.get("stream"):
            options = body.get("stream_options") or {}
            return await _stream(request, kind, stream, rid, created, served, bool(options.get("include_usage")))
        pieces = [piece async for piece in stream]
    finally:
        stream.cancel()
    text = "".join(pieces)
    usage = _usage(stream.prompt_tokens, stream.completion_tokens)
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": stream.finish_reason,
            "stop_reason": None,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": stream.finish_reason,
            "stop_reason": None,
        }
        obj = "text_completion"
    payload = {"id": rid, "object": obj, "created": created, "model": served, "choices": [choice], "usage": usage}
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


async def _stream(
    request: web.Request, kind: str, stream: Any, rid: str, created: int, served: str, include_usage: bool
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    head = {"id": rid, "object": obj, "created": created, "model": served}

    def event(payload: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    def choice(text: str, finish: str | None) -> dict[str, Any]:
        if kind == "chat":
            return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}

    pending: str | None = None
    async for piece in stream:
        if pending is None and kind == "chat":
            # Like vLLM: the role-only delta goes out when the first token is ready.
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            await response.write(event({**head, "choices": [first]}))
        # Hold one piece back so the last one can carry finish_reason, as vLLM does.
        if pending is not None:
            await response.write(event({**head, "choices": [choice(pending, None)]}))
        pending = piece
    await response.write(event({**head, "choices": [choice(pending or "", stream.finish_reason)]}))
    if include_usage:
        usage = _usage(stream.prompt_tokens, stream.completion_tokens)
        await response.write(event({**head, "choices": [], "usage": usage}))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


async def chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def embeddings(request: web.Request) -> web.Response:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return _error(400, "Invalid JSON body")
    if not isinstance(body, dict) or body.get("model") != request.app[MODEL_KEY]:
        return _error(404, "The model does not exist.", "NotFoundError")
    inputs = body.get("input")
    texts = [inputs] if isinstance(inputs, str) else inputs
    if not isinstance(texts, list) or not texts:
        return _error(400, "input missing")
    data = [{"object": "embedding", "index": i, "embedding": _vector(str(t))} for i, t in enumerate(texts)]
    tokens = sum(max(1, len(str(t)) // 4) for t in texts)
    payload = {
        "object": "list",
        "data": data,
        "model": request.app[MODEL_KEY],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


def _vector(text: str) -> list[float]:
    digest = hashlib.sha512(text.encode()).digest()
    raw = [(digest[i % len(digest)] - 127.5) / 127.5 for i in range(EMBEDDING_DIM)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


async def models(request: web.Request) -> web.Response:
    served = request.app[MODEL_KEY]
    card = {"id": served, "object": "model", "created": 0, "owned_by": "fleetgate-sim", "root": served}
    return web.Response(body=orjson.dumps({"object": "list", "data": [card]}), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    # vLLM's API server answers /health late while its engine is busy; ``--busy-health-delay-ms``
    # reproduces that, for the gateway's health checks to be tested against it.
    delay = request.app[BUSY_HEALTH_DELAY_KEY]
    if delay and request.app[ENGINE_KEY].gauges().get("vllm:num_requests_running", 0.0) > 0:
        await asyncio.sleep(delay)
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    labels = f'{{engine="0",model_name="{request.app[MODEL_KEY]}"}}'
    lines = []
    for name, value in sorted(engine.gauges().items()):
        kind = "counter" if name.endswith("_total") else "gauge"
        lines.append(f"# TYPE {name} {kind}\n{name}{labels} {value}")
    cache = engine.cache_config()
    if cache is not None:
        info = ",".join(f'{k}="{v}"' for k, v in sorted(cache.items()))
        lines.append(f'# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{{info},engine="0"}} 1.0')
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's development endpoint (``VLLM_SERVER_DEV_MODE=1``): benchmarks start each run cold."""
    return web.json_response({"success": request.app[ENGINE_KEY].reset_prefix_cache()})


def build_engine(
    *,
    ttft_ms: float,
    tokens_per_s: float,
    profile: str | None,
    seed: int,
    time_scale: float,
    num_blocks: int | None = None,
    block_size: int | None = None,
) -> SimEngine:
    """A fixed-rate engine, or the calibrated batching model when a profile is named."""
    if profile is None:
        return FixedRateEngine(
            FixedRateConfig(ttft_s=ttft_ms / 1000 / time_scale, tokens_per_s=tokens_per_s * time_scale)
        )
    from sim.batched_engine import BatchedSimEngine

    return BatchedSimEngine.from_profile(
        profile, seed=seed, time_scale=time_scale, num_blocks=num_blocks, block_size=block_size
    )


def create_app(engine: SimEngine, served_model: str, *, busy_health_delay_s: float = 0.0) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[ENGINE_KEY] = engine
    app[MODEL_KEY] = served_model
    app[BUSY_HEALTH_DELAY_KEY] = busy_health_delay_s
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)

    async def _close(app: web.Application) -> None:
        await app[ENGINE_KEY].close()

    app.on_cleanup.append(_close)
    return app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="fleetgate-sim", help="the model name to serve")
    parser.add_argument("--ttft-ms", type=float, default=50.0, help="fixed time to first token")
    parser.add_argument("--tokens-per-s", type=float, default=50.0, help="fixed decode speed per request")
    parser.add_argument("--profile", default=None, help="a calibrated GPU/model profile instead")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-scale", type=float, default=1.0, help=">1 runs faster than real time")
    parser.add_argument(
        "--num-gpu-blocks-override", type=int, default=None, help="KV cache blocks (as vLLM's flag; with --profile)"
    )
    parser.add_argument("--block-size", type=int, default=None, help="tokens per KV block (with --profile)")
    parser.add_argument(
        "--busy-health-delay-ms", type=float, default=0.0, help="answer /health this late while generating"
    )
    parser.add_argument(
        "--keepalive-timeout-s", type=float, default=75.0, help="an idle keep-alive connection is closed after this"
    )
    parser.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=2.0,
        help="on SIGTERM, requests in flight get this long, then are cut",
    )


def run(args: argparse.Namespace) -> None:
    import uvloop

    engine = build_engine(
        ttft_ms=args.ttft_ms,
        tokens_per_s=args.tokens_per_s,
        profile=args.profile,
        seed=args.seed,
        time_scale=args.time_scale,
        num_blocks=args.num_gpu_blocks_override,
        block_size=args.block_size,
    )
    web.run_app(
        create_app(engine, args.model, busy_health_delay_s=args.busy_health_delay_ms / 1000),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        # A client that leaves cancels its handler, which frees its slot in the engine
        # (vLLM aborts a request whose connection closed); without it a dropped
        # non-streaming request generated to its end, and SIGTERM waited for all of them.
        handler_cancellation=True,
        shutdown_timeout=args.shutdown_timeout_s,
        keepalive_timeout=args.keepalive_timeout_s,
        loop=uvloop.new_event_loop(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="fleetgate sim", description=__doc__)
    add_arguments(parser)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
