"""What standing between client and GPU costs: fleetgate vs a bare proxy vs no proxy.

One command (needs `nginx` and `wrk`: `apt-get install nginx-light wrk`)::

    .venv/bin/python bench/overhead.py [--duration 10] [--rounds 3] [--base REF]

Method (all in one run, so the ratios hold on a shared, noisy machine):
- core 0: the proxies under test (`taskset -c 0`), started once; only the one under load is busy.
- Each point runs `--rounds` times, bare proxy and fleetgate alternating; medians are reported.
- core 1: nginx (one worker) answering a fixed chat completion, the SSE upstream, and
  the load generators (wrk for JSON; a Python client for streams).
- JSON: wrk, keep-alive, POST /v1/chat/completions with a small body, `--duration` s per
  point at concurrency 1 and 32, against (a) nginx directly, (b) the bare aiohttp proxy
  (bench/bare_proxy.py), (c) fleetgate with auth, limits, routing, metrics and the
  access log on (every feature that is on by default, on its memory store).
- Streams: 16 concurrent streams of 200 SSE events each, events relayed per second
  through each proxy, plus the proxy's CPU time per relayed event (the rate alone is
  client-bound when the relay is not saturated).
- Memory: fleetgate's resident set idle (after start, before traffic) and with 1,000
  concurrent open streams (events paced at one per second), per stream.
- With ``--base REF``: the gateway's code at that git ref runs beside it on core 0 (same
  config, its own port) and takes its turn in every JSON and stream round, so a change's
  cost is read as a ratio against the old code in the same run (``new / base``).

Writes bench/results/overhead.md (and .json with the raw figures).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import yaml

from replicas.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PY = sys.executable
API_KEY = "sk-bench"
BODY = {"model": "bench", "messages": [{"role": "user", "content": "Hello, how are you today?"}], "max_tokens": 16}
COMPLETION = {
    "id": "chatcmpl-bench",
    "object": "chat.completion",
    "created": 0,
    "model": "bench",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "I am fine, thank you for asking!"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 14, "completion_tokens": 9, "total_tokens": 23},
}
METHOD = (
    "- core 0: the proxies under test (`taskset -c 0`), all started once; only the one under load is busy.",
    "- core 1: nginx (one worker) answering a fixed chat completion, the SSE upstream, and the load generators"
    " (wrk for JSON; a Python aiohttp client for streams).",
    "- JSON: wrk, keep-alive, POST /v1/chat/completions with a small body, at concurrency 1 and 32, against"
    " (a) nginx directly, (b) the bare aiohttp proxy (`bench/bare_proxy.py`: parse, re-serialise, forward),"
    " (c) fleetgate with auth, limits, routing, metrics and the access log on, limits on the memory store.",
    "- Streams: concurrent streams of 200 SSE events each (one event per token); events relayed per second"
    " through each proxy, and the proxy process's CPU time per relayed event (the rate alone is client-bound"
    " when the relay is not saturated).",
    "- Memory: fleetgate's resident set idle (after start, before traffic) and with concurrent open streams"
    " (events paced at one per second), per stream.",
)
# Bars from the gateway-core issue.
BAR_RPS_RATIO_C32 = 0.60
BAR_P50_RATIO_C1 = 1.5
BAR_SSE_RATIO = 0.70
BAR_IDLE_RSS_MB = 200
BAR_STREAM_KB = 100


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        time.sleep(0.1)
    raise TimeoutError(url)


@contextlib.contextmanager
def process(
    argv: list[str], cpu: int, log: Path, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["taskset", "-c", str(cpu), *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def base_tree(ref: str, tmp: Path) -> Path:
    """The repository at ``ref``, unpacked (git archive: the repository is not touched)."""
    out = tmp / "base"
    out.mkdir()
    archive = tmp / "base.tar"
    subprocess.run(["git", "archive", "--format=tar", "-o", str(archive), ref], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    return out


def nginx_conf(tmp: Path, port: int) -> Path:
    body = json.dumps(COMPLETION, separators=(",", ":"))
    conf = tmp / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  keepalive_requests 10000000;
  keepalive_timeout 300;
  client_body_temp_path {tmp}/body;
  server {{
    listen 127.0.0.1:{port};
    location = /v1/chat/completions {{ default_type application/json; return 200 '{body}'; }}
    location = /health {{ return 200 ''; }}
    location = /metrics {{ default_type text/plain; return 200 'vllm:num_requests_running 0\\n'; }}
  }}
}}
""")
    return conf


@dataclass
class WrkResult:
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int


_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    if not m:
        raise ValueError(text)
    return float(m.group(1)) * _UNITS[m.group(2)]


def wrk(url: str, conc: int, duration: int, script: Path) -> WrkResult:
    out = subprocess.run(
        ["taskset", "-c", "1", "wrk", "-t1", f"-c{conc}", f"-d{duration}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    # Anchored: a thread-stats column such as "89.99%" must not pass for the 99th percentile.
    p50 = _ms(re.search(r"^\s*50%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"^\s*99%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    errors = 0
    for pattern in (
        r"Non-2xx or 3xx responses: (\d+)",
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
    ):
        m = re.search(pattern, out)
        if m:
            errors += sum(int(g) for g in m.groups())
    return WrkResult(rps, p50, p99, errors)


def post_script(tmp: Path) -> Path:
    """wrk's script for the benches' request: POST /v1/chat/completions with ``BODY``."""
    script = tmp / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = '{json.dumps(BODY, separators=(',', ':'))}'\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {API_KEY}"\n'
    )
    return script


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def child_pid(proc: subprocess.Popen[bytes]) -> int:
    """The pid behind `taskset` (taskset execs, so it is the same pid)."""
    return proc.pid


STREAM_CLIENT = r"""
import asyncio, sys, time, aiohttp, orjson
url, model, conc, duration, key = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "stream please"}], "stream": True})
async def worker(session, stop, counts):
    while time.monotonic() < stop:
        async with session.post(url, data=body, headers={"Authorization": "Bearer " + key,
                                                          "Content-Type": "application/json"}) as r:
            assert r.status == 200, r.status
            async for chunk in r.content.iter_any():
                counts[0] += chunk.count(b"data: {")
async def main():
    counts = [0]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        start = time.monotonic()
        await asyncio.gather(*(worker(s, start + duration, counts) for _ in range(conc)))
        print(counts[0] / (time.monotonic() - start))
asyncio.run(main())
"""

HOLD_CLIENT = r"""
import asyncio, sys, aiohttp, orjson
url, model, n, key, hold = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hold"}], "stream": True})
async def one(session, ready):
    async with session.post(url, data=body, headers={"Authorization": "Bearer " + key,
                                                      "Content-Type": "application/json"}) as r:
        await r.content.readuntil(b"\n\n")
        ready.append(1)
        await asyncio.sleep(hold)
async def main():
    ready = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        tasks = [asyncio.create_task(one(s, ready)) for _ in range(n)]
        while len(ready) < n:
            await asyncio.sleep(0.1)
        print("READY", flush=True)
        await asyncio.gather(*tasks, return_exceptions=True)
asyncio.run(main())
"""


def stream_rate(url: str, model: str, conc: int, duration: float, server_pid: int | None) -> tuple[float, float | None]:
    before = cpu_seconds(server_pid) if server_pid else 0.0
    out = subprocess.run(
        ["taskset", "-c", "1", PY, "-c", STREAM_CLIENT, url, model, str(conc), str(duration), API_KEY],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rate = float(out.strip())
    if server_pid is None:
        return rate, None
    used = cpu_seconds(server_pid) - before
    return rate, used / (rate * duration) * 1e6


def open_streams_rss(url: str, model: str, n: int, pid: int) -> tuple[float, float]:
    before = rss_mb(pid)
    client = subprocess.Popen(
        ["taskset", "-c", "1", PY, "-c", HOLD_CLIENT, url, model, str(n), API_KEY, "30"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdout is not None
    line = client.stdout.readline()
    if "READY" not in line:
        raise RuntimeError(f"hold client failed: {line!r}")
    time.sleep(1.0)
    during = rss_mb(pid)
    client.terminate()
    client.wait()
    return before, during


def gateway_config(port: int, json_url: str, sse_url: str, slow_url: str) -> dict[str, object]:
    return {
        "server": {"port": port, "log_level": "warning"},
        "upstream": {"pool_size": 2048},
        "models": [
            {"name": "bench", "replicas": [{"url": json_url}]},
            {"name": "bench-stream", "replicas": [{"url": sse_url}]},
            {"name": "bench-slow", "replicas": [{"url": slow_url}]},
        ],
        "tenants": [
            {
                "id": "bench",
                "api_keys": ["sha256:" + hashlib.sha256(API_KEY.encode()).hexdigest()],
                # Limits on, set high enough never to reject: the bench measures their cost.
                "limits": {"requests_per_minute": 10**9, "tokens_per_minute": 10**12, "max_concurrent": 100_000},
            }
        ],
    }


def median_by(results: list[WrkResult], key: str) -> float:
    return float(statistics.median(getattr(r, key) for r in results))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=10, help="seconds per load point")
    parser.add_argument("--rounds", type=int, default=3, help="alternating bare/fleetgate rounds per point")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--open-streams", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=RESULTS / "overhead.md")
    parser.add_argument("--base", default=None, help="git ref of a gateway to measure beside this one (optional)")
    args = parser.parse_args()
    for tool in ("nginx", "wrk", "taskset"):
        if shutil.which(tool) is None:
            print(f"bench/overhead.py needs `{tool}`: apt-get install nginx-light wrk", file=sys.stderr)
            return 2
    if (os.cpu_count() or 1) < 2:
        print("needs two cores (proxy on one, load on the other)", file=sys.stderr)
        return 2

    tmp = Path(tempfile.mkdtemp(prefix="fleetgate-bench-"))
    (tmp / "body").mkdir()
    p_nginx, p_sse, p_slow, p_bare, p_bare_sse, p_gw, p_base = (free_port() for _ in range(7))
    base_name = f"fleetgate at {args.base}"
    script = post_script(tmp)
    # Per point and system, one result per round; bare and fleetgate alternate within a round.
    json_runs: dict[str, dict[int, list[WrkResult]]] = {
        "bare aiohttp proxy": {1: [], 32: []},
        "fleetgate": {1: [], 32: []},
        **({base_name: {1: [], 32: []}} if args.base else {}),
    }
    sse_runs: dict[str, list[tuple[float, float | None]]] = {"bare aiohttp relay": [], "fleetgate": []}
    if args.base:
        sse_runs[base_name] = []
    total_points = 2 + 2 * args.rounds + args.rounds + 1
    done = 0

    def progress(label: str) -> None:
        nonlocal done
        done += 1
        print(f"[{done}/{total_points}] {label}", file=sys.stderr, flush=True)

    with contextlib.ExitStack() as stack:
        stack.enter_context(process(["nginx", "-c", str(nginx_conf(tmp, p_nginx))], 1, tmp / "nginx.log"))
        stack.enter_context(
            process([PY, "bench/sse_upstream.py", "--port", str(p_sse), "--events", "200"], 1, tmp / "sse.log")
        )
        stack.enter_context(
            process(
                [PY, "bench/sse_upstream.py", "--port", str(p_slow), "--events", "120", "--interval", "1.0"],
                1,
                tmp / "slow.log",
            )
        )
        for port in (p_nginx, p_sse, p_slow):
            wait_http(f"http://127.0.0.1:{port}/health")
        direct_url = f"http://127.0.0.1:{p_nginx}/v1/chat/completions"
        direct = {c: wrk(direct_url, c, args.duration, script) for c in (1, 32)}
        sse_direct = stream_rate(
            f"http://127.0.0.1:{p_sse}/v1/chat/completions", "bench", args.streams, args.duration, None
        )
        progress("upstream direct")

        cfg = tmp / "gateway.yaml"
        cfg.write_text(
            yaml.safe_dump(
                gateway_config(
                    p_gw, f"http://127.0.0.1:{p_nginx}", f"http://127.0.0.1:{p_sse}", f"http://127.0.0.1:{p_slow}"
                )
            )
        )
        # Both proxies live on core 0 for the whole run; only the one under load uses it.
        stack.enter_context(
            process(
                [PY, "bench/bare_proxy.py", "--port", str(p_bare), "--upstream", f"http://127.0.0.1:{p_nginx}"],
                0,
                tmp / "bare.log",
            )
        )
        bare_sse = stack.enter_context(
            process(
                [PY, "bench/bare_proxy.py", "--port", str(p_bare_sse), "--upstream", f"http://127.0.0.1:{p_sse}"],
                0,
                tmp / "bare-sse.log",
            )
        )
        gw = stack.enter_context(
            process(
                [PY, "-m", "gateway.cli", "serve", "--config", str(cfg), "--log-dir", str(tmp / "logs")],
                0,
                tmp / "gateway.log",
            )
        )
        base_gw = None
        if args.base:
            tree = base_tree(args.base, tmp)
            base_cfg = tmp / "base.yaml"
            base_cfg.write_text(cfg.read_text().replace(f"port: {p_gw}", f"port: {p_base}"))
            base_gw = stack.enter_context(
                process(
                    [PY, "-m", "gateway.cli", "serve", "--config", str(base_cfg), "--log-dir", str(tmp / "base-logs")],
                    0,
                    tmp / "base.log",
                    env={"PYTHONPATH": str(tree)},
                    cwd=tree,
                )
            )
        wait_http(f"http://127.0.0.1:{p_bare}/health")
        wait_http(f"http://127.0.0.1:{p_bare_sse}/health")
        wait_http(f"http://127.0.0.1:{p_gw}/readyz")
        if args.base:
            wait_http(f"http://127.0.0.1:{p_base}/readyz")
        time.sleep(2.0)
        idle_rss = rss_mb(child_pid(gw))
        urls = {
            "bare aiohttp proxy": f"http://127.0.0.1:{p_bare}/v1/chat/completions",
            "fleetgate": f"http://127.0.0.1:{p_gw}/v1/chat/completions",
        }
        if args.base:
            urls[base_name] = f"http://127.0.0.1:{p_base}/v1/chat/completions"
        for url in urls.values():
            wrk(url, 32, 2, script)  # warm-up
        progress("warm-up")
        for c in (1, 32):
            for r in range(args.rounds):
                for name, url in urls.items():
                    json_runs[name][c].append(wrk(url, c, args.duration, script))
                progress(f"JSON c={c} round {r + 1}")

        for r in range(args.rounds):
            sse_runs["bare aiohttp relay"].append(
                stream_rate(
                    f"http://127.0.0.1:{p_bare_sse}/v1/chat/completions",
                    "bench",
                    args.streams,
                    args.duration,
                    child_pid(bare_sse),
                )
            )
            sse_runs["fleetgate"].append(
                stream_rate(urls["fleetgate"], "bench-stream", args.streams, args.duration, child_pid(gw))
            )
            if base_gw is not None:
                sse_runs[base_name].append(
                    stream_rate(urls[base_name], "bench-stream", args.streams, args.duration, child_pid(base_gw))
                )
            progress(f"streams round {r + 1}")

        before, during = open_streams_rss(urls["fleetgate"], "bench-slow", args.open_streams, child_pid(gw))
        progress("open streams")
        per_stream_kb = (during - before) * 1024 / args.open_streams
        after_rss = rss_mb(child_pid(gw))

    bare, fg = json_runs["bare aiohttp proxy"], json_runs["fleetgate"]
    bare_sse_runs, fg_sse_runs = sse_runs["bare aiohttp relay"], sse_runs["fleetgate"]
    per_round = {
        "rps_c32_vs_bare": [f.rps / b.rps for b, f in zip(bare[32], fg[32], strict=True)],
        "p50_c1_vs_bare": [f.p50_ms / b.p50_ms for b, f in zip(bare[1], fg[1], strict=True)],
        "sse_vs_bare": [f[0] / b[0] for b, f in zip(bare_sse_runs, fg_sse_runs, strict=True)],
    }
    if args.base:
        old, old_sse = json_runs[base_name], sse_runs[base_name]
        per_round["rps_c32_vs_base"] = [f.rps / o.rps for o, f in zip(old[32], fg[32], strict=True)]
        per_round["rps_c1_vs_base"] = [f.rps / o.rps for o, f in zip(old[1], fg[1], strict=True)]
        per_round["sse_vs_base"] = [f[0] / o[0] for o, f in zip(old_sse, fg_sse_runs, strict=True)]
    ratios = {k: statistics.median(v) for k, v in per_round.items()}
    results: dict[str, object] = {}
    results.update(
        {
            "duration_s": args.duration,
            "rounds": args.rounds,
            "json_direct": {c: vars(r) for c, r in direct.items()},
            "json": {k: {c: [vars(r) for r in runs] for c, runs in v.items()} for k, v in json_runs.items()},
            "sse_direct_events_per_s": sse_direct[0],
            "sse": {k: [{"events_per_s": r, "proxy_cpu_us_per_event": c} for r, c in v] for k, v in sse_runs.items()},
            "memory": {
                "idle_rss_mb": idle_rss,
                "rss_before_streams_mb": before,
                "rss_with_streams_mb": during,
                "open_streams": args.open_streams,
                "kb_per_stream": per_stream_kb,
                "rss_after_mb": after_rss,
            },
            "ratios_per_round": per_round,
            "ratios": ratios,
        }
    )
    write_report(
        args, direct, sse_direct, json_runs, sse_runs, per_round, ratios, idle_rss, before, during, per_stream_kb
    )
    args.out.with_suffix(".json").write_bytes(
        orjson.dumps(results, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)
    )
    print(args.out.read_text())
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def write_report(
    args: argparse.Namespace,
    direct: dict[int, WrkResult],
    sse_direct: tuple[float, float | None],
    json_runs: dict[str, dict[int, list[WrkResult]]],
    sse_runs: dict[str, list[tuple[float, float | None]]],
    per_round: dict[str, list[float]],
    ratios: dict[str, float],
    idle: float,
    before: float,
    during: float,
    per_stream_kb: float,
) -> None:
    def verdict(ok: bool) -> str:
        return "pass" if ok else "**FAIL**"

    def row(name: str, a: WrkResult, b: WrkResult, errors: int) -> str:
        return (
            f"| {name} | {a.rps:,.0f} | {a.p50_ms:.3f} | {a.p99_ms:.3f} | {b.rps:,.0f} | {b.p50_ms:.3f} "
            f"| {b.p99_ms:.3f} | {errors} |"
        )

    def med(runs: list[WrkResult]) -> WrkResult:
        return WrkResult(
            median_by(runs, "rps"), median_by(runs, "p50_ms"), median_by(runs, "p99_ms"), sum(r.errors for r in runs)
        )

    def listing(values: list[float], fmt: str) -> str:
        return ", ".join(format(v, fmt) for v in values)

    lines = [
        "# Gateway overhead",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with `.venv/bin/python bench/overhead.py"
        f" --duration {args.duration} --rounds {args.rounds}{f' --base {args.base}' if args.base else ''}`"
        f" on this machine ({os.cpu_count()} cores, shared;"
        f" load average at the end {os.getloadavg()[0]:.1f}).",
        "",
        "## Method (all in one run, so the ratios hold on a shared, noisy machine)",
        "",
        *METHOD,
        "",
        f"Each point is measured {args.rounds} times, the bare proxy and fleetgate alternating within a round, so"
        " that a burst of load from elsewhere hits both alike. Tables give the median over rounds; each bar is"
        " judged on the median of the per-round ratios (listed below the bars).",
        "",
        "## JSON requests (wrk, keep-alive; medians over rounds)",
        "",
        "| system | c=1 req/s | c=1 p50 ms | c=1 p99 ms | c=32 req/s | c=32 p50 ms | c=32 p99 ms | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        row("upstream direct (nginx)", direct[1], direct[32], direct[1].errors + direct[32].errors),
    ]
    for name, runs in json_runs.items():
        a, b = med(runs[1]), med(runs[32])
        lines.append(row(name, a, b, a.errors + b.errors))
    lines += [
        "",
        f"## Streams ({args.streams} concurrent, 200 events each; medians over rounds)",
        "",
        "| system | events/s relayed | proxy CPU µs per event |",
        "| --- | ---: | ---: |",
        f"| upstream direct | {sse_direct[0]:,.0f} | - |",
    ]
    for name, sse in sse_runs.items():
        rate = statistics.median(r for r, _ in sse)
        cpus = [c for _, c in sse if c is not None]
        lines.append(
            f"| {name} | {rate:,.0f} | {statistics.median(cpus):.1f} |" if cpus else f"| {name} | {rate:,.0f} | - |"
        )
    lines += [
        "",
        "## Memory (fleetgate process)",
        "",
        f"- idle, after start: {idle:.1f} MB resident",
        f"- with {args.open_streams} open streams: {during:.1f} MB (from {before:.1f} MB): "
        f"{per_stream_kb:.1f} KB per stream",
        "",
        "## Against the bars",
        "",
        "| bar | measured | verdict |",
        "| --- | ---: | --- |",
        f"| req/s at c=32 >= {BAR_RPS_RATIO_C32:.0%} of bare | {ratios['rps_c32_vs_bare']:.0%} "
        f"| {verdict(ratios['rps_c32_vs_bare'] >= BAR_RPS_RATIO_C32)} |",
        f"| p50 at c=1 <= {BAR_P50_RATIO_C1}x bare | {ratios['p50_c1_vs_bare']:.2f}x "
        f"| {verdict(ratios['p50_c1_vs_bare'] <= BAR_P50_RATIO_C1)} |",
        f"| SSE relay >= {BAR_SSE_RATIO:.0%} of bare | {ratios['sse_vs_bare']:.0%} "
        f"| {verdict(ratios['sse_vs_bare'] >= BAR_SSE_RATIO)} |",
        f"| idle RSS < {BAR_IDLE_RSS_MB} MB | {idle:.0f} MB | {verdict(idle < BAR_IDLE_RSS_MB)} |",
        f"| < {BAR_STREAM_KB} KB per open stream | {per_stream_kb:.0f} KB | {verdict(per_stream_kb < BAR_STREAM_KB)} |",
        "",
        "Per-round ratios (fleetgate / bare):",
        "",
        f"- req/s at c=32: {listing(per_round['rps_c32_vs_bare'], '.2f')}",
        f"- p50 at c=1: {listing(per_round['p50_c1_vs_bare'], '.2f')}",
        f"- SSE events/s: {listing(per_round['sse_vs_bare'], '.2f')}",
        "",
    ]
    if args.base:
        lines += [
            f"Against the code at `{args.base}` in the same rounds (fleetgate / base; medians, then per round):",
            "",
            f"- req/s at c=32: {ratios['rps_c32_vs_base']:.3f} ({listing(per_round['rps_c32_vs_base'], '.3f')})",
            f"- req/s at c=1: {ratios['rps_c1_vs_base']:.3f} ({listing(per_round['rps_c1_vs_base'], '.3f')})",
            f"- SSE events/s: {ratios['sse_vs_base']:.3f} ({listing(per_round['sse_vs_base'], '.3f')})",
            "",
        ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
