"""Benchmark of the limits package: cost of admit + settle, and Redis round trips per request.

    .venv/bin/python bench/limits.py [--n 20000] [--redis-n 4000] [--repeats 3] [--out FILE]

Measures, for a tenant with every limit kind configured (RPM, TPM, concurrency, daily and
monthly quotas) and limits high enough that every request is admitted:

- memory store: microseconds per admit + settle through the ``Limiter`` (one event loop,
  sequential), and the pure store calls alone;
- Redis store (a redis-server started here on a free port, no persistence): microseconds
  per admit + settle sequentially (latency-bound: two round trips) and with 32 requests in
  flight (throughput-bound), plus p50/p99 of the admit call;
- Redis commands per request, counted twice: on the client (every command the store sends)
  and on the server (``INFO commandstats`` deltas of EVALSHA). The target is 2: one to
  admit, one to settle.
- the same Redis figures on a local Redis Cluster (3 masters + 3 replicas, started here,
  ``redis+cluster://``), run alternately with the single node so both see the same load;
  the bar: the cluster's admit p99 within 1.5x the single node's.

Writes the figures to ``bench/results/limits.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

# Run as a script, this file's own directory comes first on sys.path and its name would
# shadow the `limits` package it measures.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from limits.config import TenantLimits  # noqa: E402
from limits.decision import Lease  # noqa: E402
from limits.limiter import Limiter, LimiterOptions  # noqa: E402
from limits.memory_store import MemoryStore  # noqa: E402
from limits.plan import Subject, build_plan  # noqa: E402
from limits.redis_store import RedisStore  # noqa: E402
from redisconn.target import RedisTarget  # noqa: E402

LIMITS = TenantLimits(
    requests_per_minute=10**9,
    tokens_per_minute=10**12,
    max_concurrent=10**6,
    tokens_per_day=10**15,
    tokens_per_month=10**15,
)
RPM_ONLY = TenantLimits(requests_per_minute=10**9)
SUBJECT = Subject("bench-tenant", key_id="key-1", model="model-a")
RESERVE, USED = 1500, 900
OPTIONS = LimiterOptions(background=False, redis_timeout_s=1.0)
# The bar: on the same machine, in one run.
CLUSTER_P99_BAR = 1.5
CLUSTER_MASTERS = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


@contextmanager
def redis_servers(count: int, *extra: str) -> Iterator[list[int]]:
    """``count`` throwaway redis-servers on free ports (no persistence); yields the ports."""
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    procs: list[subprocess.Popen[bytes]] = []
    dirs: list[str] = []
    try:
        ports = []
        for _ in range(count):
            port, workdir = _free_port(), tempfile.mkdtemp(prefix="fleetgate-bench-redis-")
            dirs.append(workdir)
            args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--dir", workdir, "--loglevel", "warning", *extra]  # fmt: skip
            if "--cluster-enabled" in extra:
                args += ["--cluster-port", str(_free_port())]
            procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL))
            _wait_port(port, procs[-1])
            ports.append(port)
        yield ports
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
        for workdir in dirs:
            shutil.rmtree(workdir, ignore_errors=True)


@contextmanager
def redis_server() -> Iterator[str]:
    """A throwaway single redis-server; yields its URL."""
    with redis_servers(1) as (port,):
        yield f"redis://127.0.0.1:{port}/0"


@contextmanager
def redis_cluster() -> Iterator[str]:
    """A throwaway Redis Cluster, 3 masters + 3 replicas; yields its redis+cluster:// URL."""
    with redis_servers(2 * CLUSTER_MASTERS, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf") as ports:
        cli = shutil.which("redis-cli") or "/usr/bin/redis-cli"
        nodes = [f"127.0.0.1:{p}" for p in ports]
        subprocess.run([cli, "--cluster", "create", *nodes, "--cluster-replicas", "1", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            info = subprocess.run([cli, "-p", str(ports[0]), "cluster", "info"], capture_output=True, timeout=10)
            if b"cluster_state:ok" in info.stdout:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the benchmark's cluster never became ok")
            time.sleep(0.1)
        yield "redis+cluster://" + ",".join(nodes)


def _node_urls(url: str) -> list[str]:
    """Every redis-server behind ``url`` (each cluster node), for INFO."""
    target = RedisTarget.parse(url)
    if target.kind == "cluster":
        return [f"redis://{host}:{port}/0" for host, port in target.nodes]
    return [url]


async def pair(limiter: Limiter, limits: TenantLimits) -> float:
    """One admit + settle; returns the admit's latency in seconds."""
    started = time.perf_counter()
    d = await limiter.admit(SUBJECT, limits, RESERVE)
    admitted = time.perf_counter()
    assert d.allowed, d.message
    await limiter.settle(d.lease, USED)
    return admitted - started


async def redis_cpu_s(url: str | None) -> float:
    """CPU seconds redis-server has used (user + system), from INFO cpu."""
    if url is None:
        return 0.0
    total = 0.0
    for node in _node_urls(url):  # a cluster: every node, replicas included
        c = aioredis.Redis.from_url(node)
        try:
            cpu = await c.info("cpu")
        finally:
            await c.aclose()
        total += float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    return total


async def sequential(
    limiter: Limiter, n: int, limits: TenantLimits = LIMITS, url: str | None = None
) -> dict[str, float]:
    for _ in range(min(n // 10, 500)):  # warm up: connections, scripts, caches
        await pair(limiter, limits)
    admits = []
    # CPU time is reported next to wall time: on a shared, overloaded machine wall time
    # mostly measures waiting for a core, CPU time what the work itself costs.
    redis_cpu = await redis_cpu_s(url)
    cpu, started = time.process_time(), time.perf_counter()
    for _ in range(n):
        admits.append(await pair(limiter, limits))
    total, cpu = time.perf_counter() - started, time.process_time() - cpu
    redis_cpu = await redis_cpu_s(url) - redis_cpu
    admits.sort()
    return {
        "us_per_pair": total / n * 1e6,
        "cpu_us_per_pair": cpu / n * 1e6,
        "redis_cpu_us_per_pair": redis_cpu / n * 1e6,
        "admit_p50_us": statistics.median(admits) * 1e6,
        "admit_p99_us": admits[int(0.99 * (n - 1))] * 1e6,
    }


async def interleaved(limiters: dict[str, Limiter], n: int, batch: int = 50) -> dict[str, dict[str, float]]:
    """Admit p50/p99 of each limiter, ``n`` requests each, taken in alternating batches.

    On a shared machine the tail is mostly other processes' work: batches of a few
    milliseconds, alternated (and the first one swapped each round), put both stores under
    the same load, so their ratio says something even when the absolute tail does not.
    """
    samples: dict[str, list[float]] = {name: [] for name in limiters}
    order = list(limiters.items())
    for _ in range(n // batch):
        for name, limiter in order:
            for _ in range(batch):
                samples[name].append(await pair(limiter, LIMITS))
        order.reverse()
    out = {}
    for name, admits in samples.items():
        admits.sort()
        out[name] = {"p50": statistics.median(admits) * 1e6, "p99": admits[int(0.99 * (len(admits) - 1))] * 1e6}
    return out


async def concurrent(limiter: Limiter, n: int, in_flight: int) -> float:
    """Microseconds per admit + settle with ``in_flight`` requests at a time."""
    per_worker = n // in_flight

    async def worker() -> None:
        for _ in range(per_worker):
            await pair(limiter, LIMITS)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return (time.perf_counter() - started) / (per_worker * in_flight) * 1e6


def pure_store(n: int) -> float:
    """Microseconds per admit_now + settle_now on the memory store, no limiter."""
    store = MemoryStore()
    plan = build_plan(SUBJECT, LIMITS, RESERVE)
    started = time.perf_counter()
    for i in range(n):
        lease_id = str(i)
        store.admit_now(plan, lease_id, 60.0)
        store.settle_now(Lease.from_plan(lease_id, plan, "store"), USED)
    return (time.perf_counter() - started) / n * 1e6


def timed(fn: Callable[[], Any], n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6


async def evalsha_stats(url: str) -> tuple[int, float]:
    """(calls, total µs inside Redis) of EVALSHA so far, from INFO commandstats (all nodes)."""
    calls, usec = 0, 0.0
    for node in _node_urls(url):
        c = aioredis.Redis.from_url(node)
        try:
            stats = await c.info("commandstats")
        finally:
            await c.aclose()
        entry = stats.get("cmdstat_evalsha", {})
        calls, usec = calls + int(entry.get("calls", 0)), usec + float(entry.get("usec", 0))
    return calls, usec


async def round_trips(url: str, n: int, limits: TenantLimits) -> tuple[float, float, float]:
    """Per admit + settle: client commands, server EVALSHA calls, µs spent inside Redis."""
    store = RedisStore.from_url(url, timeout_s=1.0)
    limiter = Limiter(store, options=OPTIONS)
    await pair(limiter, limits)  # scripts loaded before counting
    sent = 0
    client: Any = store._client
    original: Callable[..., Awaitable[Any]] = client.execute_command

    async def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal sent
        sent += 1
        return await original(*args, **kwargs)

    client.execute_command = counting
    calls0, usec0 = await evalsha_stats(url)
    for _ in range(n):
        await pair(limiter, limits)
    calls1, usec1 = await evalsha_stats(url)
    await limiter.close()
    return sent / n, (calls1 - calls0) / n, (usec1 - usec0) / n


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


async def run(n: int, redis_n: int, repeats: int) -> dict[str, Any]:
    results: dict[str, Any] = {"repeats": repeats}
    results["plan_us"] = statistics.median(
        timed(lambda: build_plan(SUBJECT, LIMITS, RESERVE), n) for _ in range(repeats)
    )
    results["pure_memory_us"] = statistics.median(pure_store(n) for _ in range(repeats))
    memory = Limiter(MemoryStore(), options=OPTIONS)
    results["memory"] = median_of([await sequential(memory, n) for _ in range(repeats)])
    await memory.close()
    with redis_server() as url, redis_cluster() as cluster_url:
        single = Limiter(RedisStore.from_url(url, timeout_s=1.0), options=OPTIONS)
        cluster = Limiter(RedisStore.from_url(cluster_url, timeout_s=1.0), options=OPTIONS)
        runs: dict[str, list[dict[str, float]]] = {"redis": [], "cluster": []}
        in_flight: dict[str, list[float]] = {"redis": [], "cluster": []}
        # Alternate the two, so that a change in the machine's load hits both alike.
        for _ in range(repeats):
            for name, limiter, where in (("redis", single, url), ("cluster", cluster, cluster_url)):
                runs[name].append(await sequential(limiter, redis_n, url=where))
                in_flight[name].append(await concurrent(limiter, redis_n * 2, 32))
        for name in runs:
            results[name] = median_of(runs[name])
            results[f"{name}_concurrent_us"] = statistics.median(in_flight[name])
        results["interleaved"] = await interleaved({"redis": single, "cluster": cluster}, redis_n * repeats)
        results["interleaved_n"] = redis_n * repeats
        await single.close()
        await cluster.close()
        results["trips_full"] = await round_trips(url, 500, LIMITS)
        results["trips_rpm_only"] = await round_trips(url, 500, RPM_ONLY)
        results["cluster_trips_full"] = await round_trips(cluster_url, 500, LIMITS)
        results["cluster_trips_rpm_only"] = await round_trips(cluster_url, 500, RPM_ONLY)
        results["cluster_client"] = type(cluster._store._client).__name__  # type: ignore[attr-defined]
    return results


def _row(store: str, how: str, m: dict[str, float]) -> str:
    redis_cpu = f"{m['redis_cpu_us_per_pair']:.1f}" if m["redis_cpu_us_per_pair"] else "-"
    return (
        f"| {store} | {how} | {m['us_per_pair']:.1f} | {m['cpu_us_per_pair']:.1f} | {redis_cpu} | "
        f"{m['admit_p50_us']:.1f} | {m['admit_p99_us']:.1f} |"
    )


def report(r: dict[str, Any], n: int, redis_n: int) -> str:
    load = os.getloadavg()
    full_client, full_server, full_usec = r["trips_full"]
    rpm_client, rpm_server, rpm_usec = r["trips_rpm_only"]
    memory_row = _row("memory", f"`Limiter`, sequential, n={n}", r["memory"])
    redis_row = _row("Redis", f"`Limiter`, sequential, n={redis_n}", r["redis"])
    concurrent_row = f"| Redis | `Limiter`, 32 in flight, n={redis_n * 2} | {r['redis_concurrent_us']:.1f} | | | | |"
    cluster_row = _row("Redis Cluster", f"`Limiter`, sequential, n={redis_n}", r["cluster"])
    cluster_concurrent = (
        f"| Redis Cluster | `Limiter`, 32 in flight, n={redis_n * 2} | {r['cluster_concurrent_us']:.1f} | | | | |"
    )
    c_full_client, c_full_server, c_full_usec = r["cluster_trips_full"]
    c_rpm_client, c_rpm_server, c_rpm_usec = r["cluster_trips_rpm_only"]
    both = r["interleaved"]
    p99_ratio = both["cluster"]["p99"] / both["redis"]["p99"]
    verdict = "met" if p99_ratio <= CLUSTER_P99_BAR else "NOT met"
    return f"""# limits: cost of admit + settle, and Redis round trips

Command: `.venv/bin/python bench/limits.py` (writes this file).

Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()},
redis-server on loopback; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end
(the machine is shared: compare ratios within one run, not absolute times across runs).
Each figure is the median of {r["repeats"]} runs.

Workload: one tenant with every limit kind (RPM, TPM, concurrency cap, daily and monthly
quotas) and a request subject with key and model; limits set high so every request is
admitted; reserve {RESERVE} tokens, settle {USED}. One asyncio event loop, one process.

## Time per request (admit + settle)

| store | how | wall µs per admit + settle | gateway CPU µs | Redis CPU µs | admit p50 µs | admit p99 µs |
| --- | --- | ---: | ---: | ---: | ---: | ---: |
{memory_row}
{redis_row}
{concurrent_row}
{cluster_row}
{cluster_concurrent}

**Cluster against one node, admit latency measured in alternating batches of 50 requests
(n={r["interleaved_n"]} each, so both see the same machine load):**

| store | admit p50 µs | admit p99 µs |
| --- | ---: | ---: |
| Redis, one node | {both["redis"]["p50"]:.1f} | {both["redis"]["p99"]:.1f} |
| Redis Cluster | {both["cluster"]["p50"]:.1f} | {both["cluster"]["p99"]:.1f} |

**p99 ratio cluster / one node: {p99_ratio:.2f} (bar: at most {CLUSTER_P99_BAR}; {verdict}).**
The p99 columns of the table above come from separate runs, each the median of its runs'
p99; on a shared machine they swing by several times from run to run, which is why the
bar is judged on the alternating measurement. The cluster is 3 masters and 3 replicas on
this same machine (`redis+cluster://`, redis-py's `{r["cluster_client"]}`). The tenant's
keys share one hash tag, so each call goes to the one master owning that slot: the
client's extra work is computing the slot (CRC16) and picking the node, and the master's
is feeding its replica. The cluster's Redis CPU column sums every node, replicas included.

Wall time is what a request waits; the CPU columns are the work done per request by the
gateway process and by redis-server (`INFO cpu` deltas), which a loaded machine inflates less.
Parts of the memory figure: resolving the plan (`build_plan`) {r["plan_us"]:.1f} µs;
`MemoryStore.admit_now` + `settle_now` without the limiter {r["pure_memory_us"]:.1f} µs.
Inside Redis, the two scripts of one request take {full_usec:.1f} µs together
(`INFO commandstats`); the rest of the Redis figure is the client library and the loopback
round trips.

## Redis round trips per request

| limits configured | commands sent by the client | EVALSHA calls seen by Redis | µs inside Redis |
| --- | ---: | ---: | ---: |
| all kinds (admit + settle) | {full_client:.2f} | {full_server:.2f} | {full_usec:.1f} |
| requests per minute only (nothing to settle) | {rpm_client:.2f} | {rpm_server:.2f} | {rpm_usec:.1f} |
| Redis Cluster, all kinds (admit + settle) | {c_full_client:.2f} | {c_full_server:.2f} | {c_full_usec:.1f} |
| Redis Cluster, requests per minute only | {c_rpm_client:.2f} | {c_rpm_server:.2f} | {c_rpm_usec:.1f} |

Counted over 500 requests after the scripts were loaded: on the client by wrapping the
store's `execute_command`, on the server from `INFO commandstats` (`cmdstat_evalsha`
deltas, summed over the cluster's nodes). Commands that the scripts run inside Redis are
not round trips and are not counted. A NOSCRIPT reply (after a Redis restart or SCRIPT FLUSH) costs one SCRIPT LOAD and
one repeated EVALSHA, once per script.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000, help="memory-store requests")
    parser.add_argument("--redis-n", type=int, default=4_000, help="Redis-store requests")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "limits.md")
    args = parser.parse_args()
    results = asyncio.run(run(args.n, args.redis_n, args.repeats))
    text = report(results, args.n, args.redis_n)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    for trips in ("trips_full", "cluster_trips_full"):
        if round(results[trips][0], 2) != 2.0 or round(results[trips][1], 2) != 2.0:
            raise SystemExit(f"{trips}: expected exactly 2 Redis round trips per request")


if __name__ == "__main__":
    main()
