"""What the gateway's allocator costs: ``fleetgate serve`` with ``PYTHONMALLOC=malloc`` (glibc's
malloc for every object, docs/operations.md#memory) against CPython's pymalloc (its default), in one run.

One command (needs `nginx` and `wrk`, as bench/overhead.py)::

    .venv/bin/python -m bench.allocator [--duration 6] [--rounds 5]

Method: bench/overhead.py's setup and load (its functions), with two gateways instead of a
gateway and a bare proxy: both on core 0, one with PYTHONMALLOC=malloc,
one with PYTHONMALLOC=pymalloc; nginx, the SSE upstream and the load generators on core 1.
Each round measures both, alternating: JSON at concurrency 1 and 32 (wrk), and 16 concurrent
streams (events relayed per second and the gateway's CPU per event). Reported: medians, and
the median of the per-round ratios malloc / pymalloc. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.overhead import (
    API_KEY,
    BODY,
    PY,
    gateway_config,
    nginx_conf,
    process,
    stream_rate,
    wait_http,
    wrk,
)
from replicas.launcher import free_port

ALLOCATORS = {"malloc": {"PYTHONMALLOC": "malloc"}, "pymalloc": {"PYTHONMALLOC": "pymalloc"}}


def figure(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=6, help="seconds per load point")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fleetgate-alloc-"))
    (tmp / "body").mkdir()
    p_nginx, p_sse, p_slow = free_port(), free_port(), free_port()
    script = tmp / "post.lua"
    body = json.dumps(BODY, separators=(",", ":"))
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = '{body}'\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {API_KEY}"\n'
    )
    rows: dict[str, dict[str, list[float]]] = {
        a: {"c1_p50": [], "c32_rps": [], "sse_rate": [], "cpu_us": []} for a in ALLOCATORS
    }
    with contextlib.ExitStack() as stack:
        stack.enter_context(process(["nginx", "-c", str(nginx_conf(tmp, p_nginx))], 1, tmp / "nginx.log"))
        stack.enter_context(
            process([PY, "bench/sse_upstream.py", "--port", str(p_sse), "--events", "200"], 1, tmp / "sse.log")
        )
        stack.enter_context(
            process([PY, "bench/sse_upstream.py", "--port", str(p_slow), "--events", "2"], 1, tmp / "slow.log")
        )
        for port in (p_nginx, p_sse, p_slow):
            wait_http(f"http://127.0.0.1:{port}/health")
        gateways = {}
        for name, env in ALLOCATORS.items():
            port = free_port()
            cfg = tmp / f"gateway-{name}.yaml"
            upstreams = (f"http://127.0.0.1:{p}" for p in (p_nginx, p_sse, p_slow))
            cfg.write_text(yaml.safe_dump(gateway_config(port, *upstreams)))
            argv = [PY, "-m", "gateway.cli", "serve", "--config", str(cfg), "--log-dir", str(tmp / f"logs-{name}")]
            proc = stack.enter_context(process(argv, 0, tmp / f"gateway-{name}.log", env))
            gateways[name] = (f"http://127.0.0.1:{port}", proc.pid)
        for url, _ in gateways.values():
            wait_http(f"{url}/readyz")
            wrk(f"{url}/v1/chat/completions", 32, 2, script)  # warm-up
        for r in range(args.rounds):
            order = list(gateways.items()) if r % 2 == 0 else list(reversed(gateways.items()))
            for name, (url, pid) in order:
                rows[name]["c1_p50"].append(wrk(f"{url}/v1/chat/completions", 1, args.duration, script).p50_ms)
                rows[name]["c32_rps"].append(wrk(f"{url}/v1/chat/completions", 32, args.duration, script).rps)
                rate, cpu = stream_rate(f"{url}/v1/chat/completions", "bench-stream", 16, args.duration, pid)
                rows[name]["sse_rate"].append(rate)
                rows[name]["cpu_us"].append(cpu or 0.0)
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
            time.sleep(0.5)
    labels = {
        "c1_p50": "c=1 p50 ms",
        "c32_rps": "c=32 req/s",
        "sse_rate": "events/s relayed",
        "cpu_us": "CPU µs per event",
    }
    print(f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.rounds} rounds of {args.duration} s\n")
    print("| figure | malloc (median) | pymalloc (median) | malloc / pymalloc, per round | median ratio |")
    print("| --- | ---: | ---: | --- | ---: |")
    for key, label in labels.items():
        m, p = rows["malloc"][key], rows["pymalloc"][key]
        ratios = [a / b for a, b in zip(m, p, strict=True)]
        print(
            f"| {label} | {figure(statistics.median(m))} | {figure(statistics.median(p))} | "
            f"{', '.join(f'{x:.2f}' for x in ratios)} | {statistics.median(ratios):.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
