"""A rolling restart loses nothing: two gateways behind a balancer, one stopped under load.

The balancer plays a Service with kube-proxy: a TCP proxy that sends each new connection to
a backend whose /readyz answered 200 at its last probe (every 100 ms, as the endpoints
controller follows readiness), and never retries a connection the backend refused, as
kube-proxy does not. Two real ``fleetgate serve`` processes sit behind it, with one
simulator process as their shared replica. With 50 streams in flight on both and a steady
rate of requests, one gateway gets SIGTERM: it must turn unready, keep accepting for
``drain_delay_s`` (connections the balancer sent before it noticed), finish its streams
within ``shutdown_grace_s``, and exit 0. The bar: 0 failed requests, 0 cut streams.

Load requests open a connection each, so a failure can only be the gateway's (a refused or
reset connection, an error status); what keep-alive clients see is checked apart: while
draining, every response says ``Connection: close``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from replicas.launcher import free_port
from tests.integration.harness import API_KEY, ROOT, GatewayProcess

MODEL = "m"
STREAMS = 50
# Each stream: 60 tokens at 20 tokens/s, about 3 s: longer than the drain delay, far shorter than the grace.
STREAM_TOKENS, TOKENS_PER_S = 60, 20.0
LOAD_RATE_PER_S = 20.0
DRAIN_DELAY_S = 1.5
PROBE_EVERY_S = 0.1
AFTER_SIGTERM_S = 4.0


@dataclass
class Backend:
    port: int
    ready: bool = False
    connections: int = 0
    unready_at: float | None = None


@dataclass
class Balancer:
    """Round-robin over ready backends, new connections only, no retries."""

    backends: list[Backend]
    refused: int = 0
    _next: itertools.count[int] = field(default_factory=itertools.count)

    async def probe(self, http: aiohttp.ClientSession) -> None:
        while True:
            for b in self.backends:
                try:
                    async with http.get(f"http://127.0.0.1:{b.port}/readyz", timeout=aiohttp.ClientTimeout(1)) as r:
                        ready = r.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ready = False
                if b.ready and not ready:
                    b.unready_at = time.monotonic()
                b.ready = ready
            await asyncio.sleep(PROBE_EVERY_S)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ready = [b for b in self.backends if b.ready]
        if not ready:
            self.refused += 1
            writer.close()
            return
        backend = ready[next(self._next) % len(ready)]
        backend.connections += 1
        try:
            async with asyncio.timeout(5):
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", backend.port)
        except (OSError, TimeoutError):
            self.refused += 1  # kube-proxy would not retry either: the client sees a reset
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()


@contextlib.asynccontextmanager
async def balancer(backends: list[Backend]) -> AsyncIterator[tuple[str, Balancer]]:
    lb = Balancer(backends)
    port = free_port()
    server = await asyncio.start_server(lb.handle, "127.0.0.1", port)
    async with aiohttp.ClientSession() as http:
        prober = asyncio.create_task(lb.probe(http))
        try:
            yield f"http://127.0.0.1:{port}", lb
        finally:
            prober.cancel()
            server.close()


@contextlib.contextmanager
def simulator(port: int) -> AsyncIterator[None]:  # type: ignore[misc]
    argv = [sys.executable, "-m", "sim.server", "--port", str(port), "--model", MODEL]
    argv += ["--ttft-ms", "20", "--tokens-per-s", str(TOKENS_PER_S)]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield None
    finally:
        proc.terminate()
        proc.wait(10)


@dataclass
class Results:
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    streams_done: int = 0
    streams_started: asyncio.Event = field(default_factory=asyncio.Event)
    started: int = 0


HEADERS = {"Authorization": f"Bearer {API_KEY}"}


async def one_stream(http: aiohttp.ClientSession, url: str, results: Results) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": STREAM_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body, headers=HEADERS) as r:
            if r.status != 200:
                results.failures.append(f"stream: {r.status} {await r.text()}")
                return
            results.started += 1
            if results.started == STREAMS:
                results.streams_started.set()
            events = [line async for line in r.content if line.startswith(b"data: ")]
        usage = orjson.loads(events[-2][6:])["usage"]
        if events[-1].strip() != b"data: [DONE]" or usage["completion_tokens"] != STREAM_TOKENS:
            results.failures.append(f"stream cut: {events[-2:]!r}")
            return
        results.streams_done += 1
    except (aiohttp.ClientError, TimeoutError) as exc:
        results.failures.append(f"stream: {exc!r}")


async def one_request(http: aiohttp.ClientSession, url: str, results: Results) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body, headers=HEADERS) as r:
            await r.read()
            if r.status == 200:
                results.ok += 1
            else:
                results.failures.append(f"request: {r.status}")
    except (aiohttp.ClientError, TimeoutError) as exc:
        results.failures.append(f"request: {exc!r}")


async def steady(http: aiohttp.ClientSession, url: str, results: Results, stop: asyncio.Event) -> None:
    tasks = set()
    while not stop.is_set():
        task = asyncio.create_task(one_request(http, url, results))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1 / LOAD_RATE_PER_S)
    if tasks:
        await asyncio.gather(*tasks)


def gateway_config(upstream: str) -> dict[str, object]:
    return {
        "models": [{"name": MODEL, "replicas": [{"url": upstream}]}],
        "server": {"drain_delay_s": DRAIN_DELAY_S, "shutdown_grace_s": 30},
        "health": {"interval_s": 0.2, "timeout_s": 2.0},
        "cache": {"coalesce": False},
    }


async def test_sigterm_under_load_fails_no_request_and_cuts_no_stream(tmp_path: Path) -> None:
    sim_port = free_port()
    with simulator(sim_port):
        gateways = []
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            gateways.append(GatewayProcess(gateway_config(f"http://127.0.0.1:{sim_port}"), tmp_path / name))
        try:
            await asyncio.gather(*(asyncio.to_thread(gw.start) for gw in gateways))
            a, b = gateways
            backends = [Backend(a.port), Backend(b.port)]
            results = Results()
            # A connection per request: any failure is the gateway's, not a stale keep-alive.
            fresh = aiohttp.TCPConnector(force_close=True, limit=0)
            async with (
                balancer(backends) as (url, lb),
                aiohttp.ClientSession(connector=fresh, timeout=aiohttp.ClientTimeout(total=60)) as http,
            ):
                async with asyncio.timeout(10):
                    while not all(be.ready for be in backends):  # noqa: ASYNC110 (set by the prober's loop)
                        await asyncio.sleep(0.05)
                stop = asyncio.Event()
                load = asyncio.create_task(steady(http, url, results, stop))
                streams = [asyncio.create_task(one_stream(http, url, results)) for _ in range(STREAMS)]
                async with asyncio.timeout(30):
                    await results.streams_started.wait()  # all 50 streaming, on both gateways
                assert backends[0].connections >= STREAMS // 4
                ok_before = results.ok
                assert a.proc is not None
                a.proc.send_signal(signal.SIGTERM)
                sigterm_at = time.monotonic()
                # While draining: still answering, and telling keep-alive clients to go.
                async with aiohttp.ClientSession() as direct:
                    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
                    async with direct.post(f"{a.url}/v1/chat/completions", json=body, headers=HEADERS) as r:
                        assert r.status == 200 and r.headers["Connection"] == "close"
                    async with direct.get(f"{a.url}/readyz") as r:
                        assert r.status == 503
                await asyncio.sleep(AFTER_SIGTERM_S)
                stop.set()
                await load
                await asyncio.gather(*streams)
                exit_code = await asyncio.to_thread(a.proc.wait, 40)
        finally:
            for gw in gateways:
                if gw.proc is not None and gw.proc.poll() is None:
                    gw.stop()
    assert results.failures == [], Counter(f.split(":")[0] for f in results.failures)
    assert lb.refused == 0
    assert results.streams_done == STREAMS
    assert exit_code == 0
    unready_after = backends[0].unready_at - sigterm_at  # type: ignore[operator]
    assert unready_after < DRAIN_DELAY_S  # the balancer saw it before the listener closed
    assert results.ok - ok_before >= LOAD_RATE_PER_S * AFTER_SIGTERM_S / 2  # the load went on, to b
    log = [orjson.loads(line) for line in a.stderr_path.read_text().splitlines() if line.startswith("{")]
    events = {e["msg"]: e for e in log}
    assert "draining: not ready, still accepting" in events
    # Streams were still running on a when its listener closed, and all of them finished.
    assert events["listener closed: finishing in-flight requests"]["in_flight"] >= STREAMS // 4
