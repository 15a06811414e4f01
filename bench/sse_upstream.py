"""A streaming upstream for relay benchmarks: one SSE event per token, as fast as it can
(or at a fixed pace with --interval, for holding many streams open).

    python bench/sse_upstream.py --port 9002 --events 200 [--interval 1.0]
"""

from __future__ import annotations

import argparse
import asyncio

import orjson
import uvloop
from aiohttp import web


def build(events: int, interval: float) -> web.Application:
    chunk = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "bench",
        "choices": [{"index": 0, "delta": {"content": " tok"}, "logprobs": None, "finish_reason": None}],
    }
    event = b"data: " + orjson.dumps(chunk) + b"\n\n"
    usage = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "bench",
        "choices": [],
        "usage": {"prompt_tokens": 10, "completion_tokens": events, "total_tokens": events + 10},
    }
    tail = b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n"

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(events):
            await response.write(event)
            if interval:
                await asyncio.sleep(interval)
        await response.write(tail)
        await response.write_eof()
        return response

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--interval", type=float, default=0.0)
    args = parser.parse_args()
    web.run_app(
        build(args.events, args.interval),
        host="127.0.0.1",
        port=args.port,
        print=None,
        access_log=None,
        loop=uvloop.new_event_loop(),
    )


if __name__ == "__main__":
    main()
