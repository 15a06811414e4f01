"""One policy's fleet for the routing benchmark: a ``fleetgate serve`` process and its simulated replicas.

``gateway_config`` is the pure part: the YAML the gateway runs with, built from a
``FleetSpec``. ``PolicyFleet`` is the edge: an async context manager that writes the file,
starts the gateway as its own process (which starts and supervises the ``engine: sim``
replicas), waits until every replica is routable, and stops it all on exit.

The simulated GPUs run ``time_scale`` times as fast as real time (below 1: slower), so every
duration in the gateway's configuration that stands for real time (health interval,
timeouts, keep-alives) is divided by the same factor: a 120 s first-byte timeout stays 120
simulated seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import yaml

from gateway.settings import Settings, hash_key
from replicas.launcher import free_port
from sim.profiles import get_profile

ROOT = Path(__file__).resolve().parents[1]
# The selectable policies (the gateway's ``routing.policy``); the default first.
DEFAULT_POLICY = "prefix_affinity"
POLICIES = (DEFAULT_POLICY, "least_outstanding_tokens", "least_requests", "round_robin")
# The baselines stand for a plain load balancer: the policy alone, with no prefill bound
# holding requests back in the gateway (the fleetgate policies run with the defaults).
BASELINES = ("least_requests", "round_robin")
# What a gateway without the ``routing`` key does: least outstanding tokens, its only policy.
PRE_INTEGRATION_POLICY = "least_outstanding_tokens"
ADMIN_KEY = "sk-routing-bench-admin"
MODEL = "llama-3.1-8b"
PROFILE = "h100-llama-3.1-8b"
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 20.0
POLL_S = 0.25
# The gateway's real-time settings (gateway/settings.py defaults), scaled with the GPUs.
HEALTH_INTERVAL_S = 1.0
FIRST_BYTE_TIMEOUT_S = 120.0
CHUNK_GAP_TIMEOUT_S = 30.0
KEEPALIVE_INTERVAL_S = 10.0
REQUEST_TIMEOUT_S = 600.0
# Probe timeouts are wall time: generous, so a busy shared machine does not mark replicas down.
HEALTH_TIMEOUT_S = 5.0
# routing.queue.max_wait_s defaults (routing/config.py), real time.
QUEUE_MAX_WAIT_S = {"high": 30.0, "normal": 10.0, "low": 2.0}
# vLLM's --max-num-seqs default, which the H100 profile uses too.
MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class TenantSpec:
    """A tenant the benchmark sends as: its id and the plain API key the load generator uses."""

    id: str
    api_key: str


@dataclass(frozen=True)
class FleetSpec:
    """What one gateway process serves and how."""

    policy: str
    replicas: int = 8
    profile: str = PROFILE
    time_scale: float = 1.0
    seed: int = 0
    tenants: tuple[TenantSpec, ...] = (TenantSpec("bench", "sk-routing-bench"),)
    nice: int = 5
    extra: dict[str, Any] = field(default_factory=dict)  # merged into the top level of the config


def routing_supported() -> bool:
    """Whether this gateway takes the top-level ``routing`` key (the policy is selectable)."""
    return "routing" in Settings.model_fields


def runnable_policies(wanted: tuple[str, ...] = POLICIES) -> tuple[str, ...]:
    """The policies this gateway can run: all with the ``routing`` key, else its built-in one."""
    if routing_supported():
        return wanted
    return tuple(p for p in wanted if p == PRE_INTEGRATION_POLICY)


def gateway_config(spec: FleetSpec, port: int) -> dict[str, Any]:
    """The gateway's configuration for ``spec``, listening on ``port``."""
    scale = spec.time_scale
    config: dict[str, Any] = {
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "access_log": False,
            "log_level": "warning",
            "shutdown_grace_s": 1.0,
        },
        "health": {"interval_s": HEALTH_INTERVAL_S / scale, "timeout_s": max(HEALTH_TIMEOUT_S, 1.0 / scale)},
        "upstream": {
            "first_byte_timeout_s": FIRST_BYTE_TIMEOUT_S / scale,
            "chunk_gap_timeout_s": CHUNK_GAP_TIMEOUT_S / scale,
            "keepalive_interval_s": KEEPALIVE_INTERVAL_S / scale,
            "request_timeout_s": REQUEST_TIMEOUT_S / scale,
        },
        "models": [
            {
                "name": MODEL,
                "replicas": [
                    {
                        "engine": "sim",
                        "count": spec.replicas,
                        "sim": {"profile": spec.profile, "seed": spec.seed, "time_scale": scale},
                    }
                ],
            }
        ],
        "tenants": [
            # The response cache is off: every request of the benchmark must reach a replica.
            {"id": t.id, "api_keys": ["sha256:" + hash_key(t.api_key)], "cache": {"enabled": False}}
            for t in spec.tenants
        ],
        "admin_api_keys": ["sha256:" + hash_key(ADMIN_KEY)],
    }
    if routing_supported():
        config["routing"] = {
            "policy": spec.policy,
            "queue": {"max_wait_s": {k: v / scale for k, v in QUEUE_MAX_WAIT_S.items()}},
        }
        # A replica's capacity as docs/routing.md has operators set it: vLLM's max-num-seqs and
        # the KV cache size in tokens (what vLLM logs at start-up; here the profile's pool);
        # the prefill bound at its default, except for the baselines.
        capacity: dict[str, Any] = {
            "max_requests": MAX_NUM_SEQS,
            "max_outstanding_tokens": get_profile(spec.profile).kv_capacity_tokens,
        }
        if spec.policy in BASELINES:
            capacity["max_prefill_tokens"] = None
        config["models"][0]["capacity"] = capacity
    elif spec.policy != PRE_INTEGRATION_POLICY:
        raise ValueError(f"this gateway has no 'routing' key: only {PRE_INTEGRATION_POLICY} can run")
    for key, value in spec.extra.items():
        base = config.get(key)
        config[key] = {**base, **value} if isinstance(base, dict) and isinstance(value, dict) else value
    return config


class FleetError(RuntimeError):
    """The gateway or its replicas did not come up."""


class PolicyFleet:
    """``fleetgate serve`` with ``spec``'s replicas, as an async context manager."""

    def __init__(self, spec: FleetSpec, work_dir: Path | None = None) -> None:
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir = work_dir
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self.replica_urls: tuple[str, ...] = ()
        self.replica_ids: tuple[str, ...] = ()
        self.replica_pids: tuple[int, ...] = ()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def __aenter__(self) -> PolicyFleet:
        if self._dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=f"routing-{self.spec.policy}-")
            self._dir = Path(self._tmp.name)
        work = self._dir / self.spec.policy
        work.mkdir(parents=True, exist_ok=True)
        config_path = work / "gateway.yaml"
        config_path.write_text(yaml.safe_dump(gateway_config(self.spec, self.port)))
        argv = [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--config",
            str(config_path),
            "--log-dir",
            str(work / "logs"),
        ]
        if self.spec.nice:
            argv = ["nice", "-n", str(self.spec.nice), *argv]
        with open(work / "gateway.log", "wb") as log:  # noqa: ASYNC230 - once, before anything runs
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        try:
            await self._wait_ready(work / "gateway.log")
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stop()

    async def fleet_state(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        """``GET /admin/fleet``: every replica's state, load and last scraped gauges."""
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with session.get(
            self.url + "/admin/fleet", headers=headers, timeout=aiohttp.ClientTimeout(total=10)
        ) as resp:
            resp.raise_for_status()
            body: dict[str, Any] = await resp.json()
            return body

    async def _wait_ready(self, log_path: Path) -> None:
        assert self._proc is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT_S
        async with aiohttp.ClientSession() as session:
            while loop.time() < deadline:
                if self._proc.returncode is not None:
                    raise FleetError(f"gateway exited ({self._proc.returncode}): {_tail(log_path)}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    state = await self.fleet_state(session)
                    replicas = state["replicas"]
                    if len(replicas) == self.spec.replicas and state["healthy"] == self.spec.replicas:
                        self.replica_ids = tuple(r["id"] for r in replicas)
                        self.replica_urls = tuple(r["url"] for r in replicas)
                        self.replica_pids = tuple(int(r["pid"]) for r in replicas if r.get("pid"))
                        return
                await asyncio.sleep(POLL_S)
        raise FleetError(f"{self.spec.policy}: replicas not healthy after {READY_TIMEOUT_S:.0f} s: {_tail(log_path)}")

    async def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            # The gateway stops its replicas on SIGTERM (and the kernel does if it dies).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
