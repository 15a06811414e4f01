"""The yardstick: the least a Python proxy on this stack can do.

aiohttp + uvloop + orjson, one pooled client session. JSON requests: parse the body,
re-serialise it, forward, return the upstream's bytes. Streams: forward the upstream's
bytes as they arrive. No auth, no limits, no routing, no metrics, no logs.

    python bench/bare_proxy.py --port 9001 --upstream http://127.0.0.1:9000
"""

from __future__ import annotations

import argparse

import aiohttp
import orjson
import uvloop
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)


async def forward(request: web.Request) -> web.StreamResponse:
    body = orjson.loads(await request.read())
    session = request.app[SESSION]
    async with session.post(
        request.app[UPSTREAM] + request.path,
        data=orjson.dumps(body),
        headers={"Content-Type": "application/json"},
    ) as upstream:
        if not body.get("stream"):
            return web.Response(status=upstream.status, body=await upstream.read(), content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    app = web.Application()
    app[UPSTREAM] = args.upstream.rstrip("/")

    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024))
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/chat/completions", forward)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
