"""Run gateways and upstreams for integration tests, in-process or as real processes.

In-process gateways share the test's event loop, so a test can hold the ``Gateway`` and
look at its replicas; ``GatewayProcess`` runs the real ``fleetgate serve`` command.
``FaultyUpstream`` is a vLLM-shaped server that fails on cue (a 5xx, a dropped
connection, a stall): a real vLLM cannot be made to fail at a chosen moment, so this is
the one stand-in; healthy upstreams are the real simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml
from aiohttp import web

from gateway.app import Gateway, create_app
from gateway.settings import Settings, hash_key
from replicas.launcher import free_port
from sim.engine import FixedRateConfig, FixedRateEngine
from sim.server import create_app as create_sim_app

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-test-tenant"
OTHER_KEY = "sk-test-other"


def tenants() -> list[dict[str, Any]]:
    return [
        {"id": "t1", "api_keys": ["sha256:" + hash_key(API_KEY)]},
        {"id": "t2", "api_keys": ["sha256:" + hash_key(OTHER_KEY)]},
    ]


@contextlib.asynccontextmanager
async def serve_app(app: web.Application) -> AsyncIterator[str]:
    """Serve an aiohttp app on a free loopback port; yields its base URL."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def sim_upstream(model: str, ttft_ms: float = 5, tokens_per_s: float = 2000) -> AsyncIterator[str]:
    async with sim_upstream_engine(model, ttft_ms, tokens_per_s) as (url, _):
        yield url


@contextlib.asynccontextmanager
async def sim_upstream_engine(
    model: str, ttft_ms: float = 5, tokens_per_s: float = 2000
) -> AsyncIterator[tuple[str, FixedRateEngine]]:
    """The simulator in-process, with its engine (``engine.submitted`` counts upstream calls)."""
    engine = FixedRateEngine(FixedRateConfig(ttft_s=ttft_ms / 1000, tokens_per_s=tokens_per_s))
    async with serve_app(create_sim_app(engine, model)) as url:
        yield url, engine


@contextlib.asynccontextmanager
async def in_process_gateway(config: dict[str, Any], tmp_path: Path) -> AsyncIterator[tuple[str, Gateway, io.BytesIO]]:
    """A gateway on this loop; waits until every replica is healthy."""
    config = {"tenants": tenants(), **config}
    config.setdefault("health", {"interval_s": 0.1, "timeout_s": 1.0})
    settings = Settings(**config)
    access = io.BytesIO()
    gateway = Gateway(settings, log_dir=tmp_path / "logs", access_stream=access)
    async with serve_app(create_app(gateway)) as url:
        assert await gateway.fleet.wait_healthy(30, every=True), "replicas never became healthy"
        yield url, gateway, access


# The endpoints a test harness polls while it waits (readiness, metrics): their access
# lines are the harness's, not the test's.
PROBE_ENDPOINTS = frozenset({"healthz", "readyz", "metrics"})


def sse_events(raw: bytes) -> list[Any]:
    """A chat stream's events as the client read them: each ``data:`` payload parsed, ``[DONE]`` as is."""
    out: list[Any] = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[len(b"data: ") :]
            out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


async def until(check: Any, within_s: float = 5.0) -> None:
    """Poll a condition on the gateway's state (set by other tasks) until it holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not check():
        assert loop.time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def queued(gw: Gateway, model: str) -> int:
    """Requests waiting in ``model``'s admission queue."""
    return gw.router.pools[model].admission.queued


def access_lines(access: io.BytesIO) -> list[dict[str, Any]]:
    """The access-log lines of the requests a test sent (the harness's own probes left out)."""
    return request_lines(access.getvalue())


def request_lines(raw: bytes) -> list[dict[str, Any]]:
    lines = (orjson.loads(line) for line in raw.splitlines())
    return [line for line in lines if line.get("endpoint") not in PROBE_ENDPOINTS]


class _ScriptedUpstream:
    """A vLLM-shaped server with /health, /metrics and a chat endpoint of the subclass's making."""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\n")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError


class FaultyUpstream(_ScriptedUpstream):
    """A vLLM-shaped upstream whose chat endpoint misbehaves as told.

    ``mode``: "500" (answers 500), "drop" (sends two token events, then cuts the
    connection), "stall_first" (waits ``delay`` before the first event), "stall_mid"
    (one event, then silence for ``delay``), "slow_stream" (an event every 50 ms until the
    client leaves; records the disconnect in ``disconnected``), "status:NNN" (answers NNN
    with vLLM's error body and ``Retry-After: 1``), "malformed" (a 200 whose body, or whose
    second event when streaming, is cut-off JSON), "endless_event" (one event, then an event
    that never ends: 64 KiB pieces without a blank line, up to 16 MiB), "huge" (a 200 of
    valid JSON, 1 MiB, sent as chunks of unknown length).
    """

    def __init__(self, model: str, mode: str, delay: float = 0.0) -> None:
        self.model, self.mode, self.delay = model, mode, delay
        self.hits = 0
        self.disconnected = asyncio.Event()

    def _event(self, text: str) -> bytes:
        chunk = {
            "id": "x",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": self.model,
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
        }
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        await request.read()
        if self.mode == "500":
            return web.json_response({"error": {"message": "engine dead"}}, status=500)
        if self.mode.startswith("status:"):
            status = int(self.mode.split(":", 1)[1])
            error = {"error": {"message": "busy", "type": "ServiceUnavailableError", "param": None, "code": status}}
            return web.json_response(error, status=status, headers={"Retry-After": "1"})
        body = orjson.loads(await request.read() or b"{}")
        if self.mode == "malformed" and not body.get("stream"):
            return web.Response(
                body=b'{"id": "x", "object": "chat.completion", "choices": [{"ind', content_type="application/json"
            )
        if self.mode == "huge" and not body.get("stream"):
            huge = web.StreamResponse(headers={"Content-Type": "application/json"})
            await huge.prepare(request)
            await huge.write(b'{"id": "x", "object": "chat.completion", "padding": "')
            for _ in range(16):
                await huge.write(b"x" * 65536)
            await huge.write(b'", "choices": []}')
            await huge.write_eof()
            return huge
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            if self.mode == "stall_first":
                await asyncio.sleep(self.delay)
            await response.write(self._event("one"))
            if self.mode == "malformed":
                await response.write(b'data: {"id": "x", "choices": [{"delta": {"cont\n\n')
            if self.mode == "drop":
                await response.write(self._event(" two"))
                assert request.transport is not None
                request.transport.close()
                return response
            if self.mode == "stall_mid":
                await asyncio.sleep(self.delay)
            if self.mode == "endless_event":
                await response.write(b"data: ")
                for _ in range(256):
                    await response.write(b"x" * 65536)
            if self.mode == "slow_stream":
                for _ in range(400):
                    await asyncio.sleep(0.05)
                    await response.write(self._event(" more"))
            await response.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionError):
            self.disconnected.set()
            raise
        return response


class SseUpstream(_ScriptedUpstream):
    """An OpenAI-compatible server whose stream is framed as other servers frame theirs:
    ``line_end`` ``b"\\r\\n"`` as sse-starlette does by default (llama-cpp-python's server is
    built on it; sse-starlette is not in this environment, so its framing is written out
    here), and without ``[DONE]`` (``send_done=False``) as llama.cpp's server did before
    September 2024 and some of its forks still do. It streams ``tokens`` words ``gap_s``
    apart, the last with ``finish_reason`` (unless ``finish=False``), then usage if asked;
    ``last_sent`` is set once the last word is out."""

    def __init__(
        self,
        model: str,
        tokens: int,
        gap_s: float,
        *,
        line_end: bytes = b"\n",
        send_done: bool = True,
        finish: bool = True,
    ) -> None:
        self.model, self.tokens, self.gap_s = model, tokens, gap_s
        self.line_end, self.send_done, self.finish = line_end, send_done, finish
        self.last_sent = asyncio.Event()

    def _event(self, payload: dict[str, Any] | str) -> bytes:
        data = payload.encode() if isinstance(payload, str) else orjson.dumps(payload)
        return b"data: " + data + self.line_end * 2

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        head = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": self.model}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        for i in range(self.tokens):
            last = i == self.tokens - 1
            finish = "stop" if last and self.finish else None
            delta = {"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": finish}
            await response.write(self._event({**head, "choices": [delta]}))
            if not last:
                await asyncio.sleep(self.gap_s)
        self.last_sent.set()
        if self.finish and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 3, "completion_tokens": self.tokens, "total_tokens": 3 + self.tokens}
            await response.write(self._event({**head, "choices": [], "usage": usage}))
        if self.send_done:
            await response.write(self._event("[DONE]"))
        await response.write_eof()
        return response


class GatewayProcess:
    """``fleetgate serve --config FILE`` as a real process (managed replicas and all)."""

    def __init__(self, config: dict[str, Any], tmp_path: Path, healthy: int | None = None) -> None:
        """``healthy``: how many replicas must be healthy before ``start`` returns (default:
        every replica the config lists)."""
        self.port = free_port()
        config = {"tenants": tenants(), **config, "server": {"port": self.port, **config.get("server", {})}}
        listed = sum(r.get("count", 1) for m in config.get("models", ()) for r in m.get("replicas", ()))
        self.healthy = healthy if healthy is not None else max(1, listed)
        self.config_path = tmp_path / "gateway.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.stdout_path = tmp_path / "gateway.stdout"
        self.stderr_path = tmp_path / "gateway.stderr"
        self.log_dir = tmp_path / "logs"
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_timeout: float = 60.0) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gateway.cli",
                    "serve",
                    "--config",
                    str(self.config_path),
                    "--log-dir",
                    str(self.log_dir),
                ],
                stdout=out,
                stderr=err,
                env=env,
                cwd=ROOT,
            )
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.stop(signal.SIGKILL)  # a gateway that never got ready must not outlive the test
            raise

    def _wait_ready(self, ready_timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.stderr_path.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                # /readyz: this process answers. Tests also want every replica of the config
                # to answer: ready means one is, and a test that stops or kills one must not
                # catch the other before its first probe has passed.
                r = httpx.get(f"{self.url}/readyz", timeout=1.0)
                if r.status_code == 200 and r.json()["healthy_replicas"] >= self.healthy:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"gateway not ready: {self.stderr_path.read_text()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def stdout(self) -> str:
        return self.stdout_path.read_text()


@contextlib.contextmanager
def unreachable_port() -> Iterator[int]:
    """A local port where connect() hangs: a listener with a backlog of 0 that is full, so
    the kernel drops every further SYN (as from a host that is gone)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        yield port
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


@contextlib.contextmanager
def gateway_process(config: dict[str, Any], tmp_path: Path, healthy: int | None = None) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(config, tmp_path, healthy)
    gw.start()
    try:
        yield gw
    finally:
        if gw.proc is not None and gw.proc.poll() is None:
            gw.stop()


class CountingUpstream(_ScriptedUpstream):
    """A vLLM-shaped upstream that records what reached it: requests, tokens, and the most
    requests in flight at once (the ground truth for limit tests). It answers a chat
    completion after ``delay`` seconds, with usage counted the way the simulator counts."""

    def __init__(self, model: str, delay: float = 0.0) -> None:
        self.model, self.delay = model, delay
        self.reset()

    def reset(self) -> None:
        self.requests = 0
        self.tokens = 0
        self.in_flight = 0
        self.max_in_flight = 0

    async def _chat(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in body["messages"]) + "<|assistant|>"
        prompt = -(-len(text) // 4)
        completion = int(body.get("max_tokens") or 16)
        self.tokens += prompt + completion
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        reply = {
            "id": "chatcmpl-count",
            "object": "chat.completion",
            "created": 0,
            "model": self.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
            "usage": usage,
        }
        return web.json_response(reply)


class UpstreamLog:
    """What reached an ``openai_upstream``: (method, path, Authorization header) per request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str | None]] = []
        self.headers: list[dict[str, str]] = []

    def paths(self, method: str = "POST") -> list[str]:
        return [p for m, p, _ in self.requests if m == method]


@contextlib.asynccontextmanager
async def openai_upstream(
    model: str,
    *,
    health: bool = True,
    metrics: bool = True,
    api_key: str | None = None,
    busy_health_delay_s: float = 0.0,
    tokens_per_s: float = 2000,
) -> AsyncIterator[tuple[str, UpstreamLog]]:
    """The simulator dressed as another OpenAI-compatible server: without ``/health`` or
    ``/metrics`` (404, as nginx, llama.cpp or a hosted API answer), and, with ``api_key``,
    refusing every request without that bearer token (401 in OpenAI's shape), the way a
    hosted API does. The generation behind it is the real simulator."""
    seen = UpstreamLog()
    hidden = {p for p, shown in (("/health", health), ("/metrics", metrics)) if not shown}

    @web.middleware
    async def dress(request: web.Request, handler: Any) -> web.StreamResponse:
        auth = request.headers.get("Authorization")
        seen.requests.append((request.method, request.path, auth))
        seen.headers.append(dict(request.headers))
        if api_key is not None and auth != f"Bearer {api_key}":
            error = {"message": "Incorrect API key.", "type": "invalid_request_error", "code": "invalid_api_key"}
            return web.json_response({"error": error}, status=401)
        if request.path in hidden:
            return web.json_response({"detail": "Not Found"}, status=404)
        response: web.StreamResponse = await handler(request)
        return response

    engine = FixedRateEngine(FixedRateConfig(ttft_s=0.005, tokens_per_s=tokens_per_s))
    app = create_sim_app(engine, model, busy_health_delay_s=busy_health_delay_s)
    app.middlewares.append(dress)
    async with serve_app(app) as url:
        yield url, seen
