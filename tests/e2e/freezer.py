"""SIGSTOP a replica's API server while the streams sent to it are still running.

``python -m tests.e2e.freezer URL ADMIN_KEY REPLICA PID ROUTED TIMEOUT_S``: prints ``polling``
once it reads the gateway (the caller sends its streams only then: a Python process takes
seconds to start on a loaded machine, and a whole 4,000-token stream of the tiny model was
seen to end within them), polls the gateway
until it has made ``ROUTED`` routing decisions in all (the caller's streams are among them)
and ``REPLICA`` has no streamed request left waiting for its first token; then stops ``PID``
at once and prints the monotonic time it did (``CLOCK_MONOTONIC``: the caller's clock too) and
how many requests the gateway still holds open on ``REPLICA`` once what the stopped server
had written has been read.

That count is judged from the gateway's side, not from vLLM's own gauges: a stopped server
writes nothing more, so a request the gateway still holds open after every byte the server
wrote was read (no data queued in either direction's socket, ``/proc/net/tcp``) and its
count held still for ``SETTLE_S`` is one the freeze falls inside. vLLM's
``num_requests_running`` was the first judge and proved wrong under load: it read 0 within
50 ms of the first tokens of 4,000-token streams, because a starved API server had the
engine's whole output in hand but had written little of it; those streams would have been
cut, yet the rounds were thrown away until the test gave up. Exits 1, with what it last
saw, when ``TIMEOUT_S`` passes first.

Its own process, not a thread of the test's: at the start of the streams the test's process
was seen to make no progress for 7.7 s, and vLLM generates a whole long stream of the tiny
model in less. Only the standard library, so it is polling within a few tens of
milliseconds of its start.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import urllib.parse
import urllib.request

POLL_S = 0.02
# How long the gateway's count of open requests must hold still, after the sockets drained.
SETTLE_S = 1.0
ROUTED = "fleetgate_routing_decisions_total"


def metric_sum(text: str, name: str) -> float:
    """Sum of a metric over its label sets in Prometheus text (0 when it has none)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


def get_url(url: str, headers: dict[str, str] | None = None) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as resp:
        body: bytes = resp.read()
        return body


def main(url: str, key: str, replica: str, pid: int, routed: float, timeout_s: float) -> int:
    headers = {"Authorization": f"Bearer {key}"}

    def get(path: str) -> bytes:
        return get_url(url + path, headers)

    start = time.monotonic()
    deadline = start + timeout_s
    made = metric_sum(get("/metrics").decode(), ROUTED)
    print("polling", flush=True)  # the caller sends its streams only now
    while made < routed:
        if time.monotonic() > deadline:
            print(f"after {timeout_s:g} s: {made:g} of {routed:g} routing decisions", file=sys.stderr)
            return 1
        time.sleep(POLL_S)
        made = metric_sum(get("/metrics").decode(), ROUTED)
    routed_at = time.monotonic()

    def target() -> dict[str, object]:
        replicas: list[dict[str, object]] = json.loads(get("/admin/fleet"))["replicas"]
        return next(r for r in replicas if r["id"] == replica)

    while True:
        state = target()
        if state["prefill_requests"] == 0:
            os.kill(pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            break
        if time.monotonic() > deadline:
            waiting = state["prefill_requests"]
            print(f"after {timeout_s:g} s: {waiting} streams on {replica} before their first token", file=sys.stderr)
            return 1
        time.sleep(POLL_S)
    port = urllib.parse.urlsplit(str(state["url"])).port
    assert port is not None, state["url"]
    while (queued := unread_bytes(port)) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    drained_at = time.monotonic()
    open_, still_since = target()["outstanding_requests"], drained_at
    while time.monotonic() - still_since < SETTLE_S and time.monotonic() < deadline:
        time.sleep(POLL_S)
        now_open = target()["outstanding_requests"]
        if now_open != open_:
            open_, still_since = now_open, time.monotonic()
    print(frozen_at, int(str(open_)), flush=True)
    # When each step came, for the caller's log.
    print(
        f"routed after {routed_at - start:.2f} s, frozen {frozen_at - routed_at:.2f} s later, "
        f"sockets drained {drained_at - frozen_at:.2f} s after ({queued} bytes still queued)",
        file=sys.stderr,
    )
    return 0


def unread_bytes(port: int) -> int:
    """Bytes a server on ``port`` wrote that its peers have not read yet (``/proc/net/tcp``, ``tcp6``).

    Its own sockets' send queues and the receive queues of the sockets connected to it; what
    peers sent it (a probe to a stopped server) is not counted.
    """
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, remote, queues = fields[1], fields[2], fields[4]
            tx, rx = (int(q, 16) for q in queues.split(":"))
            if int(local.rsplit(":", 1)[1], 16) == port:
                total += tx
            elif int(remote.rsplit(":", 1)[1], 16) == port:
                total += rx
    return total


if __name__ == "__main__":
    url, key, replica, pid, routed, timeout_s = sys.argv[1:]
    sys.exit(main(url, key, replica, int(pid), float(routed), float(timeout_s)))
