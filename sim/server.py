"""A vLLM-compatible server backed by a simulated GPU (``engine: sim``, ``fleetgate sim``).

It serves what the gateway and its tests use of vLLM's HTTP API, byte-compatible in shape:

    GET  /health, /v1/models, /metrics (vLLM's metric names); POST /reset_prefix_cache
    POST /v1/load_lora_adapter                    LoRA adapters as vLLM serves them (``sim.lora_api``)
    POST /sim/freeze                              not vLLM's: a stalled engine on cue (``sim.freeze``)
    GET  /sim/priorities                          not vLLM's: requests by their ``priority`` field, which
                                                  the simulator accepts but does not honour (FCFS)
    POST /v1/chat/completions, /v1/completions    streamed (``stream_options.include_usage``) or whole
    POST /v1/responses                            OpenAI's Responses API (``sim.responses_api``)
    POST /v1/messages, /v1/messages/count_tokens  Anthropic's Messages API (``sim.messages_api``)
    POST /v1/embeddings, /v1/score, /score, /v1/rerank, /rerank
                                                  deterministic vectors and scores (``sim.pooling_api``)
    POST /tokenize, /detokenize                   the engine's own tokens (``sim.tokenize_api``)

Every generation endpoint runs the same request path (``sim.generation``); *when* tokens
come out is the engine's business (``sim.engine``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from sim import messages_api, pooling_api, responses_api, tokenize_api
from sim.engine import FixedRateConfig, FixedRateEngine, SimEngine
from sim.freeze import FREEZE_KEY, Freeze, freeze_route
from sim.generation import (
    TOKEN_IDS_KEY,
    Call,
    Generation,
    ToolCall,
    forced_call,
    ignore_eos_of,
    max_tokens_of,
    seed_of,
    serve,
)
from sim.lora_api import LORA_KEY, LoraState, load_lora_adapter, model_cards, parse_modules, runtime_updating
from sim.prompts import chat_turns, render_chat
from sim.wire import ENGINE_KEY, MAX_MODEL_LEN_KEY, MODEL_KEY, PRIORITIES_KEY, Rejection, check_model, openai_error

if TYPE_CHECKING:
    from sim.kv_publisher import KvEventPublisher

BUSY_HEALTH_DELAY_KEY = web.AppKey("busy_health_delay_s", float)
KV_PUBLISHER_KEY: web.AppKey[KvEventPublisher] = web.AppKey("kv_publisher")
# /tokenize reports the context length; the fixed-rate engine has none, so it reports the
# native context of Llama 3.1, the model most profiles simulate.
DEFAULT_MAX_MODEL_LEN = 131_072


class OpenAIApi:
    """vLLM's ``/v1/chat/completions`` (``kind`` "chat") and ``/v1/completions`` ("completion").

    A chat request whose ``tool_choice`` forces a call ("required" or ``{"type": "function",
    "function": {"name": ...}}``) is answered with that one call: ``message.tool_calls``,
    ``content`` null, ``finish_reason`` "tool_calls"; streamed as ``tool_calls`` deltas at index 0,
    the first carrying the call's id, type and name.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def new_id(self) -> str:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        return f"{prefix}-{uuid.uuid4().hex}"

    def parse(self, body: dict[str, Any], served: str) -> Generation | Rejection:
        rejection = check_model(body, served)
        if rejection is not None:
            return rejection
        prompt = self._prompt(body)
        if prompt is None:
            return Rejection(400, "messages or prompt missing")
        max_tokens = max_tokens_of(body, "max_completion_tokens", "max_tokens")
        if isinstance(max_tokens, Rejection):
            return max_tokens
        tool_call = _tool_call_of(body) if self.kind == "chat" else None
        if isinstance(tool_call, Rejection):
            return tool_call
        stream, seed = bool(body.get("stream")), seed_of(body)
        ignore_eos = ignore_eos_of(body)
        return Generation(prompt, max_tokens, stream=stream, seed=seed, tool_call=tool_call, ignore_eos=ignore_eos)

    def _prompt(self, body: dict[str, Any]) -> str | None:
        if self.kind == "chat":
            messages = body.get("messages")
            return render_chat(chat_turns(messages)) if isinstance(messages, list) and messages else None
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt:
            return " ".join(str(p) for p in prompt)
        return None

    def error(self, rejection: Rejection) -> web.Response:
        return openai_error(rejection)

    def complete(self, call: Call, text: str) -> dict[str, Any]:
        tokens = call.tokens
        tool_call = call.generation.tool_call
        if tool_call is not None:
            function = {"name": tool_call.name, "arguments": text}
            calls = [{"id": _call_id(), "type": "function", "function": function}]
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": None, "tool_calls": calls},
                "logprobs": None,
                "finish_reason": tokens.finish_reason,
                "stop_reason": None,
            }
            obj = "chat.completion"
        elif self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": tokens.finish_reason,
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": tokens.finish_reason,
                "stop_reason": None,
            }
            obj = "text_completion"
        usage = _usage(tokens.prompt_tokens, tokens.completion_tokens)
        return {
            "id": call.id,
            "object": obj,
            "created": call.created,
            "model": call.model,
            "choices": [choice],
            "usage": usage,
        }

    async def stream(self, call: Call) -> AsyncIterator[bytes]:
        chat = self.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": call.id, "object": obj, "created": call.created, "model": call.model}

        def event(payload: dict[str, Any]) -> bytes:
            return b"data: " + orjson.dumps(payload) + b"\n\n"

        tool_call = call.generation.tool_call
        call_id = _call_id()
        sent = 0  # pieces sent so far: the first piece of a tool call also names the call

        def choice(text: str, finish: str | None) -> dict[str, Any]:
            if not chat:
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            if tool_call is not None and text:
                delta = _call_delta(tool_call, call_id, text, first=sent == 0)
            else:
                delta = {"content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

        pending: str | None = None
        async for piece in call.tokens:
            if pending is None and chat:
                # Like vLLM: the role-only delta goes out when the first token is ready.
                first = {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield event({**head, "choices": [first]})
            # Hold one piece back so the last one can carry finish_reason, as vLLM does.
            if pending is not None:
                yield event({**head, "choices": [choice(pending, None)]})
                sent += 1
            pending = piece
        yield event({**head, "choices": [choice(pending or "", call.tokens.finish_reason)]})
        options = call.body.get("stream_options") or {}
        if options.get("include_usage"):
            usage = _usage(call.tokens.prompt_tokens, call.tokens.completion_tokens)
            yield event({**head, "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"


def _tool_call_of(body: dict[str, Any]) -> ToolCall | Rejection | None:
    """The call a chat request's forcing ``tool_choice`` asks for; None for "auto", "none" or no choice."""
    choice = body.get("tool_choice")
    if choice == "required":
        name = None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
    else:
        return None
    tools = body.get("tools")
    functions = [
        (tool["function"]["name"], tool["function"].get("parameters"))
        for tool in (tools if isinstance(tools, list) else [])
        if isinstance(tool, dict)
        and isinstance(tool.get("function"), dict)
        and isinstance(tool["function"].get("name"), str)
    ]
    return forced_call(functions, name if isinstance(name, str) else None)


def _call_id() -> str:
    """vLLM's id for a chat tool call."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call_delta(tool_call: ToolCall, call_id: str, piece: str, *, first: bool) -> dict[str, Any]:
    """A streamed piece of a call's arguments; the first piece also names the call (vLLM's DeltaToolCall)."""
    if not first:
        return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
    function = {"name": tool_call.name, "arguments": piece}
    return {"tool_calls": [{"id": call_id, "type": "function", "index": 0, "function": function}]}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


CHAT = OpenAIApi("chat")
COMPLETIONS = OpenAIApi("completion")


async def chat(request: web.Request) -> web.StreamResponse:
    return await serve(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, COMPLETIONS)


async def models(request: web.Request) -> web.Response:
    served = request.app[MODEL_KEY]
    card = {"id": served, "object": "model", "created": 0, "owned_by": "fleetgate-sim", "root": served, "parent": None}
    cards = [card, *model_cards(request.app)]
    return web.Response(body=orjson.dumps({"object": "list", "data": cards}), content_type="application/json")


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
    gauges = engine.gauges()
    # Requests a freeze holds at the door are waiting, as a stalled vLLM's queue is.
    gauges["vllm:num_requests_waiting"] = gauges.get("vllm:num_requests_waiting", 0.0) + request.app[FREEZE_KEY].held
    lines = []
    for name, value in sorted(gauges.items()):
        kind = "counter" if name.endswith("_total") else "gauge"
        lines.append(f"# TYPE {name} {kind}\n{name}{labels} {value}")
    cache = engine.cache_config()
    if cache is not None:
        info = ",".join(f'{k}="{v}"' for k, v in sorted(cache.items()))
        lines.append(f'# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{{info},engine="0"}} 1.0')
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


async def priorities(request: web.Request) -> web.Response:
    """Generation requests received so far by their ``priority`` field (accepted, not honoured)."""
    counts = request.app[PRIORITIES_KEY]
    return web.json_response({str(p): n for p, n in sorted(counts.items())})


async def drop_kv_events(request: web.Request) -> web.Response:
    """Lose the next ``n`` KV event batches (kept for replay), as a publisher past its
    high-water mark does: how tests and benchmarks make a gap."""
    publisher = request.app.get(KV_PUBLISHER_KEY)
    if publisher is None:
        return web.json_response({"error": "KV events are off (--kv-events-port)"}, status=404)
    n = int(request.query.get("n", "1"))
    publisher.drop(n)
    return web.json_response({"dropping": n, "next_seq": publisher.seq})


def token_ids_with(directory: str) -> Callable[[Any, dict[str, Any]], list[int] | None]:
    """The prompt's ids as a gateway with this tokenizer counts them (chat and completions)."""
    from pathlib import Path

    from dialects.openai import CHAT as CHAT_DIALECT
    from dialects.openai import COMPLETIONS as COMPLETIONS_DIALECT
    from tokens.model_tokenizer import ModelTokenizer

    tokenizer = ModelTokenizer.load(Path(directory))

    def token_ids(api: Any, body: dict[str, Any]) -> list[int] | None:
        if api is CHAT:
            return tokenizer.token_ids(CHAT_DIALECT, body)
        if api is COMPLETIONS:
            return tokenizer.token_ids(COMPLETIONS_DIALECT, body)
        return None

    return token_ids


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
    ignore_eos: bool = False,
) -> SimEngine:
    """A fixed-rate engine, or the calibrated batching model when a profile is named.

    ``ignore_eos``: every answer runs to ``max_tokens``, as if each request set vLLM's field.
    """
    if profile is None:
        ttft_s, rate = ttft_ms / 1000 / time_scale, tokens_per_s * time_scale
        return FixedRateEngine(FixedRateConfig(ttft_s=ttft_s, tokens_per_s=rate, ignore_eos=ignore_eos))
    from sim.batched_engine import BatchedSimEngine

    return BatchedSimEngine.from_profile(
        profile, seed=seed, time_scale=time_scale, num_blocks=num_blocks, block_size=block_size, ignore_eos=ignore_eos
    )


def create_app(
    engine: SimEngine,
    served_model: str,
    *,
    busy_health_delay_s: float = 0.0,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    lora: LoraState | None = None,
    runtime_lora: bool = False,
    token_ids: Callable[[Any, dict[str, Any]], list[int] | None] | None = None,
    kv_publisher: KvEventPublisher | None = None,
) -> web.Application:
    """The server's routes, all registered here (``runtime_lora``: ``/v1/load_lora_adapter`` too)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[ENGINE_KEY] = engine
    app[MODEL_KEY] = served_model
    app[MAX_MODEL_LEN_KEY] = max_model_len
    app[BUSY_HEALTH_DELAY_KEY] = busy_health_delay_s
    app[LORA_KEY] = lora or LoraState()
    app[PRIORITIES_KEY] = {}
    app[tokenize_api.VOCABULARY_KEY] = tokenize_api.Vocabulary()
    if token_ids is not None:
        app[TOKEN_IDS_KEY] = token_ids
    if kv_publisher is not None:
        app[KV_PUBLISHER_KEY] = kv_publisher
    freeze = app[FREEZE_KEY] = Freeze()
    from sim.batched_engine import BatchedSimEngine

    if isinstance(engine, BatchedSimEngine):
        engine.freeze = freeze  # its step loop stops too: nothing is computed while frozen
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    if runtime_lora:
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/sim/freeze", freeze_route)
    app.router.add_get("/sim/priorities", priorities)
    app.router.add_post("/sim/kv-events/drop", drop_kv_events)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", responses_api.create_response)
    app.router.add_post("/v1/messages", messages_api.create_message)
    app.router.add_post("/v1/messages/count_tokens", messages_api.count_tokens)
    app.router.add_post("/v1/embeddings", pooling_api.embeddings)
    for prefix in ("", "/v1"):
        app.router.add_post(f"{prefix}/score", pooling_api.score)
        app.router.add_post(f"{prefix}/rerank", pooling_api.rerank)
    app.router.add_post("/tokenize", tokenize_api.tokenize)
    app.router.add_post("/detokenize", tokenize_api.detokenize)

    async def _start(app: web.Application) -> None:
        if kv_publisher is not None:
            kv_publisher.start()

    async def _close(app: web.Application) -> None:
        await app[ENGINE_KEY].close()
        if kv_publisher is not None:
            await kv_publisher.close()

    app.on_startup.append(_start)
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
        "--ignore-eos",
        action="store_true",
        help="no natural ends: every answer runs to max_tokens, as with vLLM's ignore_eos on each request",
    )
    parser.add_argument(
        "--busy-health-delay-ms", type=float, default=0.0, help="answer /health this late while generating"
    )
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (as vLLM's flag)")
    parser.add_argument(
        "--kv-events-port", type=int, default=None, help="publish KV-cache events as vLLM does (with --profile)"
    )
    parser.add_argument("--kv-events-replay-port", type=int, default=None, help="the events' replay socket")
    parser.add_argument(
        "--tokenizer", default=None, help="a model directory: prompts are its token ids (chat and completions)"
    )
    parser.add_argument(
        "--lora-modules", nargs="+", default=[], metavar="NAME=PATH", help="adapters served from the start"
    )
    parser.add_argument("--lora-load-ms", type=float, default=0.0, help="how long a run-time adapter load takes")
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
        ignore_eos=args.ignore_eos,
    )
    from sim.batched_engine import BatchedSimEngine

    # A profile's context window, as its engine was built (a KV-cache override may shrink it).
    max_model_len = engine.profile.max_model_len if isinstance(engine, BatchedSimEngine) else DEFAULT_MAX_MODEL_LEN
    if args.lora_modules and not args.enable_lora:
        raise SystemExit("--lora-modules needs --enable-lora")
    lora = LoraState(args.enable_lora, parse_modules(args.lora_modules), args.lora_load_ms / 1000)
    publisher = None
    if args.kv_events_port is not None:
        if not isinstance(engine, BatchedSimEngine):
            raise SystemExit("--kv-events-port needs --profile (the fixed-rate engine has no KV cache)")
        from sim.kv_publisher import KvEventPublisher

        replay = args.kv_events_replay_port
        publisher = KvEventPublisher(
            f"tcp://{args.host}:{args.kv_events_port}", f"tcp://{args.host}:{replay}" if replay else None
        )
        engine.publish_events(publisher)
    app = create_app(
        engine,
        args.model,
        busy_health_delay_s=args.busy_health_delay_ms / 1000,
        max_model_len=max_model_len,
        lora=lora,
        runtime_lora=runtime_updating(os.environ),
        token_ids=token_ids_with(args.tokenizer) if args.tokenizer else None,
        kv_publisher=publisher,
    )
    web.run_app(
        app,
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
