"""A real ``redis-server`` process for integration tests, on a port of its own.

    with RedisServer() as server:          # starts on a free port, no persistence
        client = redis.Redis.from_url(server.url)
        server.stop()                      # or kill(): SIGKILL, like a crash
        server.start()                     # same port again, empty

The server runs with ``--save "" --appendonly no``: a restart comes back empty, as a
Redis without persistence does in production, which is also what makes the scripts'
NOSCRIPT path run. The fixtures in ``conftest.py`` wrap this class.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from types import TracebackType

from replicas.launcher import free_port

REDIS_BINARY = os.environ.get("REDIS_SERVER", shutil.which("redis-server") or "/usr/bin/redis-server")
# A local redis-server is up in a few milliseconds; allow for a loaded CI machine.
START_TIMEOUT_S = 10.0


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server child process; restartable on the same port."""

    def __init__(self, port: int | None = None, *, extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self._extra_args = extra_args
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="fleetgate-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start (or restart) the server and wait until it answers PING."""
        if self.running:
            return
        args = [
            REDIS_BINARY,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir,
            "--daemonize", "no",
            "--loglevel", "warning",
            *self._extra_args,
        ]  # fmt: skip
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                raise RuntimeError(f"redis-server exited at start on port {self.port}: {err}")
            if _answers_ping(self.port):
                return
            time.sleep(0.01)
        self.kill()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        """Stop gracefully (SIGTERM) and wait for the port to close."""
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        """Stop abruptly (SIGKILL), as a crash or an OOM kill would."""
        self._end(signal.SIGKILL)

    def restart(self) -> None:
        self.stop()
        self.start()

    def _end(self, sig: signal.Signals) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stderr is not None:
            proc.stderr.close()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
