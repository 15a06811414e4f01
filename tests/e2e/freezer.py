"""SIGSTOP a replica's API server while the streams sent to it are still running.

``python -m tests.e2e.freezer URL ADMIN_KEY REPLICA PID ROUTED TIMEOUT_S``: polls the gateway
until it has made ``ROUTED`` routing decisions in all (the caller's streams are among them)
and ``REPLICA`` has no streamed request left waiting for its first token; then reads how many
requests vLLM itself still counts (``vllm:num_requests_running`` plus waiting, from the
replica's own ``/metrics``), stops ``PID`` at once, and prints the monotonic time it did
(``CLOCK_MONOTONIC``: the caller's clock too) and that count. A stream vLLM still counted has
not had its last chunk written, so the freeze falls inside it; one it no longer counted may
have been sent whole already (on a loaded machine vLLM's API server was seen to send a whole
stream at once). Exits 1, with what it last saw, when ``TIMEOUT_S`` passes first.

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
import urllib.request

POLL_S = 0.02
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
    while (made := metric_sum(get("/metrics").decode(), ROUTED)) < routed:
        if time.monotonic() > deadline:
            print(f"after {timeout_s:g} s: {made:g} of {routed:g} routing decisions", file=sys.stderr)
            return 1
        time.sleep(POLL_S)
    routed_at = time.monotonic()
    while True:
        state = {r["id"]: r for r in json.loads(get("/admin/fleet"))["replicas"]}[replica]
        if state["prefill_requests"] == 0:
            text = get_url(state["url"].rstrip("/") + "/metrics").decode()
            running = metric_sum(text, "vllm:num_requests_running") + metric_sum(text, "vllm:num_requests_waiting")
            os.kill(pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            print(frozen_at, int(running), flush=True)
            # When each step came, for the caller's log.
            print(
                f"routed after {routed_at - start:.2f} s, frozen {frozen_at - routed_at:.2f} s later", file=sys.stderr
            )
            return 0
        if time.monotonic() > deadline:
            waiting = state["prefill_requests"]
            print(f"after {timeout_s:g} s: {waiting} streams on {replica} before their first token", file=sys.stderr)
            return 1
        time.sleep(POLL_S)


if __name__ == "__main__":
    url, key, replica, pid, routed, timeout_s = sys.argv[1:]
    sys.exit(main(url, key, replica, int(pid), float(routed), float(timeout_s)))
