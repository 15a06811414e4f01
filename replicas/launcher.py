"""Start, supervise and stop managed replica processes (vLLM or the simulator).

Each replica is its own process group (``start_new_session``) so stopping it reaches the
workers it spawned too: vLLM's API server starts an engine-core and a worker process, and
those outlive a SIGKILLed server (observed: still alive minutes later, holding ~2.4 GB).
The kernel sends the replica SIGTERM if the gateway dies (``PR_SET_PDEATHSIG``), even by
SIGKILL: SIGTERM, not SIGKILL, because vLLM's server takes its engine and workers down
with it on SIGTERM (within ~3 s), so no orphan keeps a GPU.

Restart policy: an exited replica is restarted after an exponential backoff; a replica
that crashed ``crash_loop_count`` times within ``crash_loop_window_s`` is marked failed
and left alone (an operator has to look; restarting it forever would only hide that).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from replicas.config import RestartSettings
from replicas.replica import Replica, ReplicaState

log = logging.getLogger("fleetgate.launcher")

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: the kernel sends SIGTERM to this process
    # when the gateway exits for any reason, SIGKILL included.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True)
class LaunchSpec:
    """How to start one replica."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path


class ManagedProcess:
    """One supervised replica process; its ``Replica`` state reflects the process's life."""

    def __init__(
        self,
        replica: Replica,
        spec: LaunchSpec,
        policy: RestartSettings,
    ) -> None:
        self.replica = replica
        self.spec = spec
        self.policy = policy
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        # Set by ``restart``: the next exit is the operator's, not a crash.
        self._restarting = False
        self._crashes: deque[float] = deque()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"supervise:{self.replica.id}")

    async def _spawn(self) -> None:
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Opening a local log file once per (re)start is not worth a thread.
        with open(self.spec.log_path, "ab") as logfile:  # noqa: ASYNC230
            self._proc = await asyncio.create_subprocess_exec(
                *self.spec.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=logfile,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **self.spec.env},
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.replica.state = ReplicaState.STARTING
        self.replica.pid = self._proc.pid
        log.info("replica started", extra={"replica": self.replica.id, "pid": self._proc.pid})

    async def _supervise(self) -> None:
        backoff = self.policy.backoff_initial_s
        while not self._stopping:
            await self._spawn()
            assert self._proc is not None
            started = time.monotonic()
            code = await self._proc.wait()
            if self._stopping:
                return
            if self._restarting:
                self._restarting = False
                await _reap_group(self._proc.pid)
                self.replica.restarts += 1
                log.info("replica restarted by operator", extra={"replica": self.replica.id, "exit_code": code})
                continue
            now = time.monotonic()
            self.replica.state = ReplicaState.DOWN
            self._crashes.append(now)
            while self._crashes and now - self._crashes[0] > self.policy.crash_loop_window_s:
                self._crashes.popleft()
            log.warning(
                "replica exited",
                extra={"replica": self.replica.id, "exit_code": code, "log": str(self.spec.log_path)},
            )
            # vLLM's engine and worker outlive a killed server (holding GPU memory the
            # replacement needs): take the old process group down before restarting.
            await _reap_group(self._proc.pid)
            if len(self._crashes) >= self.policy.crash_loop_count:
                self.replica.state = ReplicaState.FAILED
                log.error("replica crash-looping; not restarting", extra={"replica": self.replica.id})
                return
            # A replica that ran for a while before exiting starts its backoff afresh.
            if now - started > self.policy.crash_loop_window_s:
                backoff = self.policy.backoff_initial_s
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.policy.backoff_max_s)
            self.replica.restarts += 1

    async def restart(self) -> None:
        """Stop the process as ``stop`` does and start it again at once: no backoff, and not
        counted as a crash. A replica given up as crash-looping is started afresh."""
        if self._task is None or self._task.done():
            self._crashes.clear()
            self.start()
            return
        self._restarting = True
        await self._terminate(self.policy.stop_timeout_s)

    async def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM the process group, wait up to ``grace_s``, then SIGKILL."""
        self._stopping = True
        grace_s = self.policy.stop_timeout_s if grace_s is None else grace_s
        proc = await self._terminate(grace_s)
        # Workers the server spawned may outlive it; its group goes with it.
        if proc is not None:
            _signal_group(proc.pid, signal.SIGKILL)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _terminate(self, grace_s: float) -> asyncio.subprocess.Process | None:
        """SIGTERM the running process's group, SIGKILL it after ``grace_s``; the process."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except TimeoutError:
                log.warning("replica ignored SIGTERM; killing", extra={"replica": self.replica.id})
                _signal_group(proc.pid, signal.SIGKILL)
                await proc.wait()
        return proc


# How long a dead replica's leftover processes get to die after SIGKILL.
REAP_TIMEOUT_S = 10.0


class GroupMember(NamedTuple):
    """A process of a process group, as /proc shows it."""

    pid: int
    ppid: int
    state: str  # "Z": a zombie, waiting to be reaped
    name: str


def group_members(pgid: int) -> list[GroupMember]:
    """Every process in the process group ``pgid``, read from /proc (Linux)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid:
                members.append(GroupMember(int(entry.name), int(fields[1]), fields[0], comm))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return members


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group is still running (zombies waiting for init don't count)."""
    return any(member.state != "Z" for member in group_members(pgid))


async def _reap_group(pgid: int, timeout_s: float = REAP_TIMEOUT_S) -> None:
    """SIGKILL every process left in ``pgid`` and wait until none runs (bounded)."""
    _signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid):
        if time.monotonic() >= deadline:
            log.warning("processes of a dead replica survived SIGKILL", extra={"pgid": pgid})
            return
        await asyncio.sleep(0.05)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
