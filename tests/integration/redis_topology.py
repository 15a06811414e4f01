"""Real Redis topologies for integration tests: a Redis Cluster and a Sentinel setup.

    with LocalCluster() as cluster:        # 3 masters + 3 replicas on free ports
        cluster.url                        # redis+cluster://127.0.0.1:p1,...
        cluster.kill_master_of(key)        # SIGKILL the master serving key's slot
        cluster.wait_promoted(port)        # until a replica owns that slot again

    with LocalSentinel() as setup:         # 1 master, 1 replica, 3 sentinels
        setup.url                          # redis+sentinel://127.0.0.1:s1,.../fg
        setup.kill_master()                # SIGKILL the current master
        setup.wait_promoted(old_port)      # until the sentinels name another master

Both offer ``url``, ``master_of(key)``, ``kill(port)`` and ``wait_promoted(port, key)``, so a
test can run unchanged on either.

Failure detection is set short (cluster-node-timeout and down-after-milliseconds of
``NODE_TIMEOUT_MS``) so a failover takes seconds, not the defaults' 15-30 s. Every
process is killed on exit, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import redis

from replicas.launcher import free_port
from tests.integration.redis_server import REDIS_BINARY, RedisServer

REDIS_CLI = os.environ.get("REDIS_CLI", str(Path(REDIS_BINARY).with_name("redis-cli")))
NODE_TIMEOUT_MS = 1000
SERVICE = "fg"
# Creating a cluster, or a promotion, is seconds locally; allow for a loaded machine.
SETTLE_TIMEOUT_S = 60.0


def _client(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, socket_connect_timeout=2)


def _until(what: str, check: object, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(redis.RedisError, OSError, LookupError):
            if check():  # type: ignore[operator]
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"redis topology: {what} not reached in {timeout_s:.0f} s")
        time.sleep(0.1)


class _Processes:
    """Started on entry, every process killed on exit (also when starting failed)."""

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class LocalCluster(_Processes):
    """Six cluster-enabled redis-servers joined by ``redis-cli --cluster create``."""

    def __init__(self, masters: int = 3) -> None:
        self.nodes = [
            RedisServer(
                extra_args=(
                    "--cluster-enabled", "yes",
                    "--cluster-port", str(free_port()),
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                    # A replica may take over however stale it thinks it is: there is no
                    # persistence here, and the test wants the failover, not a stalemate.
                    "--cluster-replica-validity-factor", "0",
                )
            )
            for _ in range(2 * masters)
        ]  # fmt: skip

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=SETTLE_TIMEOUT_S,
        )
        self.wait_healthy()

    def alive(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.running]

    def wait_healthy(self) -> None:
        """Every live node says the cluster is ok, and each agrees on three masters."""

        def ok() -> bool:
            for node in self.alive():
                with _client(node.port) as c:
                    info = c.execute_command("CLUSTER", "INFO").decode()
                    if "cluster_state:ok" not in info:
                        return False
            return len(self.masters()) == len(self.nodes) // 2

        _until("cluster ok", ok)

    def masters(self) -> dict[int, list[tuple[int, int]]]:
        """port -> slot ranges (first, last) of each live master, as a live node sees it."""
        with _client(self.alive()[0].port) as c:
            text = c.execute_command("CLUSTER", "NODES").decode()
        found: dict[int, list[tuple[int, int]]] = {}
        for line in text.splitlines():
            parts = line.split()
            if "master" not in parts[2] or "fail" in parts[2] or len(parts) < 9:
                continue
            port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
            ranges = [p.partition("-") for p in parts[8:] if not p.startswith("[")]
            found[port] = [(int(first), int(last or first)) for first, _, last in ranges]
        return found

    def master_of(self, key: str) -> int:
        """The port of the master serving ``key``'s slot."""
        with _client(self.alive()[0].port) as c:
            slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))
        for port, ranges in self.masters().items():
            if any(first <= slot <= last for first, last in ranges):
                return port
        raise LookupError(f"no master serves slot {slot}")

    def kill(self, port: int) -> None:
        next(n for n in self.nodes if n.port == port).kill()

    def begin_moving(self, key: str, to_port: int) -> int:
        """Start moving ``key``'s slot to the master on ``to_port`` and migrate its keys.

        Until ``finish_moving``, the old owner answers ``ASK`` for the keys it gave away
        (and ``TRYAGAIN`` for calls whose keys are split between the two); redis-cli
        --cluster reshard takes the same steps. Returns the slot.
        """
        from_port = self.master_of(key)
        with _client(from_port) as src, _client(to_port) as dst:
            slot = int(src.execute_command("CLUSTER", "KEYSLOT", key))
            src_id = src.execute_command("CLUSTER", "MYID").decode()
            dst_id = dst.execute_command("CLUSTER", "MYID").decode()
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
            if keys:
                src.execute_command("MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", *keys)
        return slot

    def finish_moving(self, slot: int, to_port: int) -> None:
        """Every master learns the slot's new owner (old clients then get ``MOVED``)."""
        with _client(to_port) as dst:
            dst_id = dst.execute_command("CLUSTER", "MYID").decode()
        for port in self.masters():
            with _client(port) as c:
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)

    def wait_promoted(self, dead_port: int, key: str) -> int:
        """Wait until a live master serves ``key`` again; returns its port."""
        promoted: list[int] = []

        def moved() -> bool:
            port = self.master_of(key)
            if port == dead_port:
                return False
            with _client(port) as c:
                if "cluster_state:ok" not in c.execute_command("CLUSTER", "INFO").decode():
                    return False
            promoted.append(port)
            return True

        _until(f"a new master for {key!r}", moved)
        return promoted[-1]

    def close(self) -> None:
        for node in self.nodes:
            node.close()


class SentinelProcess:
    """One ``redis-server --sentinel`` with a config file of its own (sentinels rewrite it)."""

    def __init__(self, master_port: int, quorum: int) -> None:
        self.port = free_port()
        self._dir = tempfile.mkdtemp(prefix="fleetgate-sentinel-")
        self.config = Path(self._dir) / "sentinel.conf"
        self.config.write_text(
            f"port {self.port}\n"
            "bind 127.0.0.1\n"
            f"dir {self._dir}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} {quorum}\n"
            f"sentinel down-after-milliseconds {SERVICE} {NODE_TIMEOUT_MS}\n"
            f"sentinel failover-timeout {SERVICE} 10000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [REDIS_BINARY, str(self.config), "--sentinel", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        _until(f"sentinel on {self.port}", lambda: _client(self.port).ping(), 10.0)

    def master(self) -> int:
        with _client(self.port) as c:
            _, port = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return int(port)

    def state(self) -> dict[str, object]:
        with _client(self.port) as c:
            state: dict[str, object] = c.sentinel_master(SERVICE)
        return state

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        shutil.rmtree(self._dir, ignore_errors=True)


class LocalSentinel(_Processes):
    """A master, its replica, and three sentinels (quorum two) watching them as ``fg``."""

    def __init__(self) -> None:
        # No 5 s wait before the first full sync (the default for diskless replication).
        fast_sync = ("--repl-diskless-sync-delay", "0")
        self.master_server = RedisServer(extra_args=fast_sync)
        self.replica_server = RedisServer(
            extra_args=(*fast_sync, "--replicaof", "127.0.0.1", str(self.master_server.port))
        )
        self.sentinels = [SentinelProcess(self.master_server.port, quorum=2) for _ in range(3)]

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels) + f"/{SERVICE}"

    @property
    def servers(self) -> list[RedisServer]:
        return [self.master_server, self.replica_server]

    def start(self) -> None:
        self.master_server.start()
        self.replica_server.start()
        for s in self.sentinels:
            s.start()

        def ready() -> bool:
            with _client(self.replica_server.port) as c:
                if c.info("replication").get("master_link_status") != "up":
                    return False
            for s in self.sentinels:
                st = s.state()
                if st["num-other-sentinels"] != 2 or st["num-slaves"] != 1:
                    return False
            return True

        _until("sentinels see the replica and each other", ready)

    def master(self) -> int:
        return self.sentinels[0].master()

    def master_of(self, key: str) -> int:
        """The master's port: one master holds every key."""
        return self.master()

    def kill(self, port: int) -> None:
        next(s for s in self.servers if s.port == port).kill()

    def wait_promoted(self, dead_port: int, key: str = "") -> int:
        """Wait until every sentinel names a live master other than ``dead_port``."""

        def moved() -> bool:
            ports = {s.master() for s in self.sentinels}
            if len(ports) != 1 or dead_port in ports:
                return False
            with _client(ports.pop()) as c:
                return bool(c.info("replication").get("role") == "master")

        _until("a promoted master", moved)
        return self.master()

    def close(self) -> None:
        for s in self.sentinels:
            s.close()
        for server in self.servers:
            server.close()
