"""Managed replicas as real processes: restart after a crash, crash-loop detection,
clean stop on SIGTERM, and no orphans when the gateway itself is SIGKILLed."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import httpx

from gateway.settings import hash_key
from tests.integration.harness import gateway_process

ADMIN_KEY = "sk-admin-launcher"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def config(**restart: float) -> dict[str, object]:
    return {
        "models": [{"name": "m", "replicas": [{"engine": "sim", "count": 2, "sim": {"ttft_ms": 1}}]}],
        "health": {"interval_s": 0.1, "failures_to_down": 1},
        "restart": {"backoff_initial_s": 0.2, "backoff_max_s": 1.0, **restart},
        "admin_api_keys": ["sha256:" + hash_key(ADMIN_KEY)],
    }


def fleet(url: str) -> dict[str, dict[str, object]]:
    return {r["id"]: r for r in httpx.get(f"{url}/admin/fleet", headers=ADMIN).json()["replicas"]}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "\nState:\tZ" not in status.read_text()


def wait_for(predicate, timeout: float = 15.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_crashed_replica_is_restarted_and_serves_again(tmp_path: Path) -> None:
    with gateway_process(config(), tmp_path) as gw:
        before = fleet(gw.url)["m-0"]
        os.kill(int(before["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        assert wait_for(lambda: fleet(gw.url)["m-0"]["restarts"] == 1)
        assert wait_for(lambda: fleet(gw.url)["m-0"]["state"] == "healthy")
        after = fleet(gw.url)["m-0"]
        assert after["pid"] != before["pid"]
        metrics = httpx.get(f"{gw.url}/metrics").text
        assert 'fleetgate_replica_restarts_total{replica="m-0"} 1.0' in metrics


def test_crash_loop_marks_replica_failed(tmp_path: Path) -> None:
    cfg = config(crash_loop_count=3, crash_loop_window_s=60)
    # The second model's replica exits at once, every time.
    cfg["models"] = [  # type: ignore[index]
        *cfg["models"],  # type: ignore[misc]
        {
            "name": "broken",
            "replicas": [{"engine": "vllm", "python": sys.executable, "model_path": "x", "args": ["--no-such-flag"]}],
        },
    ]
    with gateway_process(cfg, tmp_path, healthy=1) as gw:
        assert wait_for(lambda: fleet(gw.url)["broken-0"]["state"] == "failed", timeout=20)
        assert fleet(gw.url)["broken-0"]["restarts"] == 2
        assert fleet(gw.url)["m-0"]["state"] == "healthy"  # the rest of the fleet is unaffected
        assert (gw.log_dir / "broken-0.log").read_text()  # its output is kept for the operator
        # An operator's restart starts it afresh: a new crash loop, then failed again.
        assert httpx.post(f"{gw.url}/admin/replicas/broken-0/restart", headers=ADMIN).status_code == 202
        assert wait_for(lambda: fleet(gw.url)["broken-0"]["restarts"] == 4, timeout=20)
        assert wait_for(lambda: fleet(gw.url)["broken-0"]["state"] == "failed", timeout=20)


def test_sigterm_stops_replicas(tmp_path: Path) -> None:
    with gateway_process(config(), tmp_path) as gw:
        pids = [int(r["pid"]) for r in fleet(gw.url).values()]  # type: ignore[call-overload]
        assert all(alive(p) for p in pids)
        assert gw.stop(signal.SIGTERM) == 0
        assert wait_for(lambda: not any(alive(p) for p in pids), timeout=5)


def test_sigkilled_gateway_leaves_no_orphans(tmp_path: Path) -> None:
    with gateway_process(config(), tmp_path) as gw:
        pids = [int(r["pid"]) for r in fleet(gw.url).values()]  # type: ignore[call-overload]
        gw.stop(signal.SIGKILL)
        assert wait_for(lambda: not any(alive(p) for p in pids), timeout=5)


async def test_a_dead_replicas_leftover_processes_are_reaped_before_restart(tmp_path: Path) -> None:
    """Like vLLM's engine and worker after its server is killed: a child left behind in the
    replica's process group must not survive into the next start."""
    from common.breaker import BreakerConfig, CircuitBreaker
    from gateway.settings import RestartSettings
    from replicas.launcher import LaunchSpec, ManagedProcess
    from replicas.replica import Replica

    pids = tmp_path / "children"
    script = (
        "import subprocess, sys; "
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pids)!r}, 'a').write(f'{{p.pid}}\\n')"
    )  # the parent exits at once, its child stays in the group
    replica = Replica("r", "http://127.0.0.1:1", "m", "t", "m", True, CircuitBreaker(BreakerConfig(3, 1.0)))
    policy = RestartSettings(backoff_initial_s=0.2, crash_loop_count=2, crash_loop_window_s=60)
    proc = ManagedProcess(replica, LaunchSpec([sys.executable, "-c", script], {}, tmp_path / "r.log"), policy)
    proc.start()
    try:
        assert await asyncio.to_thread(wait_for, lambda: replica.state.value == "failed", 20.0)
        children = [int(p) for p in pids.read_text().split()]
        assert len(children) == 2  # started twice, then marked failed
        assert not any(alive(p) for p in children)
    finally:
        await proc.stop(grace_s=1.0)
