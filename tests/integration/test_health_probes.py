"""Health probes against a real HTTP server in its own thread (so it answers while the
gateway's event loop is held up): a timeout the gateway saw late is no verdict on the
replica; a timeout seen on time still counts."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import aiohttp

from common.breaker import BreakerConfig, CircuitBreaker
from replicas.health import HealthChecker
from replicas.replica import Replica, ReplicaState

TIMEOUT_S = 0.3
ANSWER_S = 0.1  # well within the probe's timeout


@contextlib.contextmanager
def health_server(answer: bool) -> Iterator[str]:
    """Answers ``GET /health`` with 200 after ``ANSWER_S`` (``answer``), or reads it and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    held: list[socket.socket] = []

    def serve() -> None:
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(1.0)
            with contextlib.suppress(OSError):
                while b"\r\n\r\n" not in (data := conn.recv(65536)) and data:
                    pass
                if answer:
                    time.sleep(ANSWER_S)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                    conn.close()
                    continue
            held.append(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        listener.close()


def replica(url: str) -> Replica:
    r = Replica("r", url, "m", "t", "m", False, CircuitBreaker(BreakerConfig(3, 5.0)))
    r.state = ReplicaState.HEALTHY
    return r


async def probes(url: str, stall_s: float) -> Replica:
    """Three probes of a healthy replica (three failures take it down), the event loop held
    up for ``stall_s`` during each."""
    r = replica(url)
    async with aiohttp.ClientSession() as session:
        checker = HealthChecker(session, interval_s=1.0, timeout_s=TIMEOUT_S, failures_to_down=3)
        loop = asyncio.get_running_loop()
        for _ in range(3):
            if stall_s:
                loop.call_later(0.05, time.sleep, stall_s)  # a callback that blocks the loop
            await checker.probe(r)
    return r


async def test_a_probe_timeout_seen_late_because_the_loop_was_held_up_does_not_count() -> None:
    with health_server(answer=True) as url:
        r = await probes(url, stall_s=1.5)
    # The server answered in 0.1 s, while the loop was held up; the probe's timeout was
    # seen 1.2 s past its deadline: no verdict on the replica, three times.
    assert r.state is ReplicaState.HEALTHY
    assert r.excused_probe_timeouts == 3 and r.probe_failures == 0


async def test_a_probe_timeout_seen_on_time_counts() -> None:
    with health_server(answer=False) as url:
        r = await probes(url, stall_s=0.0)
    assert r.state is ReplicaState.DOWN
    assert r.probe_failures == 3 and r.excused_probe_timeouts == 0


async def test_an_answer_is_healthy_whatever_the_loop_did() -> None:
    with health_server(answer=True) as url:
        r = await probes(url, stall_s=0.0)
    assert r.state is ReplicaState.HEALTHY
    assert r.excused_probe_timeouts == 0 and r.probe_failures == 0
