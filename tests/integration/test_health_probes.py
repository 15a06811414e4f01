"""Health probes against a real HTTP server in its own thread (so it answers while the
gateway's event loop is held up): a timeout the gateway saw late is no verdict on the
replica; a timeout seen on time still counts. Then, through an in-process gateway: a url
replica without ``/health`` is probed with ``GET /v1/models`` instead, and the admin API and
the metrics say why a replica is down."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from common.breaker import BreakerConfig, CircuitBreaker
from gateway.app import Gateway, create_app
from gateway.settings import Settings, hash_key
from replicas.health import HealthChecker
from replicas.launcher import free_port
from replicas.replica import Replica, ReplicaState
from tests.integration.harness import API_KEY, in_process_gateway, openai_upstream, serve_app, tenants

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


# -- the probe a url replica needs, and why a replica is down ----------------------------

HOSTED_KEY = "sk-hosted-stand-in-7d1e"
KEY_VAR = "FLEETGATE_TEST_PROBE_KEY"
ADMIN_KEY = "sk-admin-probes"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
FAST_HEALTH = {"interval_s": 0.1, "timeout_s": 1.0}


async def fleet_view(http: aiohttp.ClientSession, url: str) -> dict[str, dict[str, object]]:
    async with http.get(f"{url}/admin/fleet", headers=ADMIN) as r:
        assert r.status == 200
        return {x["id"]: x for x in (await r.json())["replicas"]}


async def test_a_url_replica_without_health_falls_back_to_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A keyed server with no /health (404, as a hosted API answers) and no probe setting:
    healthy through GET /v1/models, sent with its key, and the log says so once, naming the
    replica's URL and the probe now in use."""
    caplog.set_level(logging.INFO, logger="fleetgate.health")
    monkeypatch.setenv(KEY_VAR, HOSTED_KEY)
    async with openai_upstream("hosted", health=False, metrics=False, api_key=HOSTED_KEY) as (upstream, seen):
        config = {
            "models": [{"name": "hosted", "replicas": [{"url": upstream, "api_key": f"env:{KEY_VAR}"}]}],
            "admin_api_keys": ["sha256:" + hash_key(ADMIN_KEY)],
            "health": FAST_HEALTH,
        }
        async with in_process_gateway(config, tmp_path) as (url, _, _), aiohttp.ClientSession() as http:
            await asyncio.sleep(0.5)  # a few more probe rounds: still one log line
            replica = (await fleet_view(http, url))["hosted-0"]
            assert replica["state"] == "healthy" and replica["probe"] == "models"
            assert replica["last_probe"] == {"path": "/v1/models", "status": 200, "error": None, "reason": "ok"}
            body = {"model": "hosted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            auth = {"Authorization": f"Bearer {API_KEY}"}
            async with http.post(f"{url}/v1/chat/completions", json=body, headers=auth) as r:
                assert r.status == 200
    fallbacks = [r for r in caplog.records if "/v1/models" in r.getMessage()]
    assert len(fallbacks) == 1
    assert (getattr(fallbacks[0], "url", None), getattr(fallbacks[0], "probe", None)) == (upstream, "models")
    probes = [path for method, path, _ in seen.requests if method == "GET" and path != "/metrics"]
    assert probes[0] == "/health" and probes.count("/health") == 1 and set(probes[1:]) == {"/v1/models"}
    assert all(auth == f"Bearer {HOSTED_KEY}" for _, _, auth in seen.requests)
    assert HOSTED_KEY not in caplog.text


async def test_the_admin_api_and_metrics_say_why_a_replica_is_down(tmp_path: Path) -> None:
    """A replica that refuses the gateway's key (401: no fallback, the path is there) and one
    where nothing listens: each one's last probe, in /admin/fleet and as a bounded label."""
    dead = f"http://127.0.0.1:{free_port()}"
    async with openai_upstream("keyed", health=False, api_key=HOSTED_KEY) as (keyed, _):
        settings = Settings(
            models=[
                {"name": "keyed", "replicas": [{"url": keyed}]},  # no key configured: 401
                {"name": "dead", "replicas": [{"url": dead}]},
            ],
            tenants=tenants(),
            admin_api_keys=["sha256:" + hash_key(ADMIN_KEY)],
            health=FAST_HEALTH,
        )
        gateway = Gateway(settings, log_dir=tmp_path / "logs")
        async with serve_app(create_app(gateway)) as url, aiohttp.ClientSession() as http:
            async with asyncio.timeout(30):
                while not all(r.probed for r in gateway.fleet.all()):  # noqa: ASYNC110 (set by the health loop)
                    await asyncio.sleep(0.05)
            view = await fleet_view(http, url)
            keyed_probe, dead_probe = view["keyed-0"]["last_probe"], view["dead-0"]["last_probe"]
            assert isinstance(keyed_probe, dict) and isinstance(dead_probe, dict)
            assert view["keyed-0"]["probe"] == "health"
            assert (keyed_probe["path"], keyed_probe["status"], keyed_probe["reason"]) == ("/health", 401, "http_401")
            assert dead_probe["status"] is None and dead_probe["reason"] == "error"
            assert "ClientConnectorError" in str(dead_probe["error"])
            async with http.get(f"{url}/metrics") as r:
                text = await r.text()
            assert 'fleetgate_replica_last_probe{reason="http_401",replica="keyed-0"} 1.0' in text
            assert 'fleetgate_replica_last_probe{reason="error",replica="dead-0"} 1.0' in text
