"""Stalled engines on real vLLM: two CPU replicas sharing one core, streams through the gateway.

vLLM's CPU build binds its compute threads to core 0 unless ``VLLM_CPU_OMP_THREADS_BIND``
says otherwise, so two replicas started without it share that core, and their engines go
silent for seconds to over a minute at a time while the other runs (docs/operations.md,
"Stalled replicas"). Before the chunk-gap rule changed, the gateway cut streams there ("The
replica sent nothing for 30 s"), answers the replica would have finished.

This starts ``fleetgate serve`` with two ``engine: vllm`` replicas of the tiny test model
(``scripts/build_tiny_model.py``) through the gateway's own launcher, then runs a closed
loop of streamed chat requests for ``--duration`` seconds, once per core binding in
``--binds``: ``unset`` (the variable absent: whatever vLLM does by itself) and ``0`` (both
engines told to bind to core 0: the shared core made explicit). It reports, per binding:

- the stalls the gateway saw (``fleetgate_replica_stalled``, sampled each second, and the
  episodes it logged, with their lengths);
- every stream: finished whole, cut by the gateway (the access line's ``cut`` and
  ``fleetgate_stream_cuts_total``), or failed otherwise; its longest silence between two
  chunks, so the streams the old 30 s cut would have ended, and that finished, are counted;
- for each stream the gateway cut as silent: whether its replica sent anything on another
  stream afterwards (it resumed: the cut stream would have finished too).

Real vLLM runs share this machine with other work: wrap the run in the lock the other
benchmarks take::

    flock /tmp/vllm.lock .venv/bin/python bench/stall_vllm.py              # 2 x 180 s of load
    flock /tmp/vllm.lock .venv/bin/python bench/stall_vllm.py --binds 0 --duration 60 --no-write

Results go to ``bench/results/stall-vllm.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import orjson
import yaml

from bench.routing_vllm import VLLM_PYTHON, build_tiny_model
from bench.soak import cpu_name
from gateway.settings import hash_key
from replicas.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "stall-vllm.md"
MODEL = "tiny"
API_KEY = "sk-stall-bench"
ADMIN_KEY = "sk-stall-bench-admin"
# As the end-to-end tests run vLLM (--enforce-eager: no torch.compile warm-up on CPU).
VLLM_ARGS = ["--max-model-len", "2048", "--dtype", "bfloat16", "--enforce-eager"]
# The chunk gap the gateway cut at before (and still its default), for "would have been cut".
OLD_CHUNK_GAP_S = 30.0
READY_TIMEOUT_S = 300.0
# A stream's whole life, client side: past the gateway's stall_timeout_s (300 s), so the
# gateway's bound is the one that acts, never the client's.
CLIENT_TIMEOUT_S = 420.0
# After the load stops, the streams still open get this long to end before they are dropped.
DRAIN_S = 120.0
SAMPLE_S = 1.0
THREADS_AT_S = 20.0
WORDS = "the fleet serves tokens while a gateway routes each request to a warm replica".split()
_SERIES = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$")


@dataclass
class Stream:
    """One streamed request as the client saw it."""

    started: float
    replica: str = ""
    chunks: list[float] = field(default_factory=list)
    done: bool = False
    error: str | None = None  # the error event's code, or what failed

    @property
    def longest_silence(self) -> float:
        """The longest wait between two chunks (the first token's wait not counted)."""
        gaps = [b - a for a, b in itertools.pairwise(self.chunks)]
        return max(gaps, default=0.0)


@dataclass
class Run:
    bind: str = "unset"
    streams: list[Stream] = field(default_factory=list)
    # Per replica: seconds sampled as stalled; the sample times.
    stalled_s: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    episodes: dict[str, float] = field(default_factory=dict)
    cuts: dict[str, float] = field(default_factory=dict)
    access: list[dict[str, Any]] = field(default_factory=list)
    stall_lines: list[dict[str, Any]] = field(default_factory=list)
    threads: list[str] = field(default_factory=list)
    downs: int = 0


def gateway_config(port: int, model_dir: Path, bind: str) -> dict[str, Any]:
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if bind != "unset":  # "unset": the variable absent, vLLM's own choice
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    replica = {
        "engine": "vllm",
        "count": 2,
        "python": str(VLLM_PYTHON),
        "model_path": str(model_dir),
        "args": VLLM_ARGS,
        "env": env,
    }
    return {
        "server": {"port": port},
        "models": [{"name": MODEL, "replicas": [replica]}],
        "health": {"start_timeout_s": READY_TIMEOUT_S},
        "tenants": [{"id": "bench", "api_keys": [f"sha256:{hash_key(API_KEY)}"]}],
        "admin_api_keys": [f"sha256:{hash_key(ADMIN_KEY)}"],
    }


@contextlib.contextmanager
def gateway(workdir: Path, port: int, model_dir: Path, bind: str) -> Iterator[subprocess.Popen[bytes]]:
    config = workdir / "config.yaml"
    config.write_text(yaml.safe_dump(gateway_config(port, model_dir, bind)))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    with (workdir / "access.log").open("wb") as out, (workdir / "gateway.log").open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--log-dir", str(workdir)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def series(text: str, name: str) -> dict[str, float]:
    """The samples of one metric, keyed by their label text."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SERIES.match(line)
        if match and match.group(1) == name:
            out[match.group(2)] = float(match.group(3))
    return out


def label(labels: str, key: str) -> str:
    match = re.search(rf'{key}="([^"]*)"', labels)
    return match.group(1) if match else ""


async def metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
        return await resp.text()


async def wait_ready(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the gateway exited"
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            healthy = series(await metrics(session, url), "fleetgate_replica_healthy")
            if len(healthy) == 2 and all(v == 1.0 for v in healthy.values()):
                return
        await asyncio.sleep(1.0)
    raise RuntimeError("the two vLLM replicas did not become healthy")


async def one_stream(session: aiohttp.ClientSession, url: str, rng: random.Random, max_tokens: int) -> Stream:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200)))
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": rng.randint(max_tokens // 4, max_tokens),
        "stream": True,
        "ignore_eos": True,
    }
    stream = Stream(time.monotonic())
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    try:
        async with session.post(
            f"{url}/v1/chat/completions",
            data=orjson.dumps(body),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S),
        ) as resp:
            stream.replica = resp.headers.get("x-fleetgate-replica", "")
            if resp.status != 200:
                stream.error = f"http_{resp.status}"
                return stream
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    stream.done = True
                    break
                event = orjson.loads(data)
                if "error" in event:
                    stream.error = str(event["error"].get("code"))
                    break
                stream.chunks.append(time.monotonic())
            if not stream.done and stream.error is None:
                stream.error = "truncated"
    except (aiohttp.ClientError, TimeoutError) as exc:
        stream.error = type(exc).__name__
    return stream


async def load(url: str, run: Run, duration_s: float, concurrency: int, max_tokens: int) -> None:
    stop_at = time.monotonic() + duration_s
    async with aiohttp.ClientSession() as session:

        async def client(i: int) -> None:
            rng = random.Random(i)
            while time.monotonic() < stop_at:
                run.streams.append(await one_stream(session, url, rng, max_tokens))

        async def sample() -> None:
            while True:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    stalled = series(await metrics(session, url), "fleetgate_replica_stalled")
                    run.samples += 1
                    for labels, value in stalled.items():
                        replica = label(labels, "replica")
                        run.stalled_s[replica] = run.stalled_s.get(replica, 0.0) + value * SAMPLE_S
                await asyncio.sleep(SAMPLE_S)

        sampler = asyncio.create_task(sample())
        clients = [asyncio.create_task(client(i)) for i in range(concurrency)]
        # Where vLLM's compute threads may run, read under load (they exist by then).
        await asyncio.sleep(min(THREADS_AT_S, duration_s))
        with contextlib.suppress(aiohttp.ClientError, KeyError, TypeError):
            run.threads = thread_cores(await fleet_pids(url))
        await asyncio.sleep(max(0.0, duration_s - THREADS_AT_S))
        _, pending = await asyncio.wait(clients, timeout=DRAIN_S)
        for task in pending:  # still open past the drain: dropped (the client leaves)
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        text = await metrics(session, url)
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    run.episodes = {label(k, "replica"): v for k, v in series(text, "fleetgate_replica_stall_episodes_total").items()}
    run.cuts = {label(k, "reason"): v for k, v in series(text, "fleetgate_stream_cuts_total").items()}


def thread_cores(pids: list[int]) -> list[str]:
    """Which cores each vLLM process's threads may run on (what the missing bind left)."""
    out = []
    for pid in pids:
        with contextlib.suppress(OSError):
            for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
                cores: dict[str, int] = {}
                for task in Path(f"/proc/{child}/task").iterdir():
                    with contextlib.suppress(OSError):
                        allowed = ",".join(map(str, sorted(os.sched_getaffinity(int(task.name)))))
                        cores[allowed] = cores.get(allowed, 0) + 1
                out.append(f"pid {child}: " + ", ".join(f"{n} threads on {c}" for c, n in sorted(cores.items())))
    return out


async def fleet_pids(url: str) -> list[int]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{url}/admin/fleet", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp,
    ):
        fleet = await resp.json()
    replicas = fleet["replicas"] if isinstance(fleet, dict) else fleet
    return [r["pid"] for r in replicas if r.get("pid")]


def analyse(run: Run) -> dict[str, Any]:
    streams = run.streams
    silent_cuts = [a for a in run.access if a.get("cut") in ("chunk_gap", "replica_down", "stall_timeout")]
    resumed = 0
    for cut in silent_cuts:
        # The cut's time, client side: the stream's end is within a second of it.
        mine = [s for s in streams if s.error == "upstream_stream_error" and s.replica == cut.get("replica")]
        ended = max((s.chunks[-1] if s.chunks else s.started) for s in mine) if mine else 0.0
        later = [s for s in streams if s.replica == cut.get("replica") and s.chunks and s.chunks[-1] > ended + 1]
        resumed += bool(later)
    silences = sorted((s.longest_silence for s in streams), reverse=True)
    return {
        "requests": len(streams),
        "finished": sum(s.done for s in streams),
        "errors": {e: sum(s.error == e for s in streams) for e in sorted({s.error for s in streams if s.error})},
        "silent_and_finished": sum(s.done and s.longest_silence >= OLD_CHUNK_GAP_S for s in streams),
        "silences": silences[:10],
        "silent_cuts": len(silent_cuts),
        "silent_cuts_resumed": resumed,
    }


def report(runs: list[tuple[Run, dict[str, Any]]], args: argparse.Namespace, took_s: float) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    binds = ",".join(run.bind for run, _ in runs)
    lines = [
        "# Stalled engines on real vLLM: two CPU replicas sharing a core",
        "",
        f"`flock /tmp/vllm.lock .venv/bin/python bench/stall_vllm.py --binds {binds} --duration {args.duration:g} "
        f"--concurrency {args.concurrency} --max-tokens {args.max_tokens}` at {commit.stdout.strip()}, "
        f"{time.strftime('%Y-%m-%d')}, on {cpu_name()} ({os.cpu_count()} cores); {took_s:.0f} s in all.",
        "",
        "Method: `fleetgate serve` starts two `engine: vllm` replicas of the tiny test model through its "
        "own launcher (`--enforce-eager`, bfloat16), with `VLLM_CPU_OMP_THREADS_BIND` absent (`unset`) or "
        "set to the same core for both (`0`), gateway defaults otherwise (chunk gap 30 s, stall timeout "
        f"300 s, stall after 5 s). {args.concurrency} clients in a closed loop send streamed chats "
        f"(20-200 words, {args.max_tokens // 4}-{args.max_tokens} tokens, `ignore_eos`) for "
        f"{args.duration:g} s; the streams open then get {DRAIN_S:g} s to end. The client records each "
        "stream's chunks; the gateway's `/metrics` is sampled every second; its access lines say why "
        "each cut stream was cut. Other work ran on the machine meanwhile (other engineers' tests).",
        "",
    ]
    for run, _ in runs:
        lines.append(
            f"Threads of each engine, `{run.bind}` (cores they may run on, read under load): "
            + ("; ".join(run.threads) or "not read")
        )
        lines.append("")
    header = "| figure | " + " | ".join(f"`{run.bind}`" for run, _ in runs) + " |"
    lines += [header, "| --- |" + " ---: |" * len(runs)]

    def row(name: str, values: list[object]) -> None:
        lines.append(f"| {name} | " + " | ".join(str(v) for v in values) + " |")

    def lengths(run: Run) -> str:
        ended = [line for line in run.stall_lines if line.get("msg") == "replica no longer stalled"]
        return (
            ", ".join(f"{s:g}" for s in sorted((e.get("stalled_s", 0.0) for e in ended), reverse=True)[:10]) or "none"
        )

    row("streams", [f["requests"] for _, f in runs])
    row("finished whole", [f["finished"] for _, f in runs])
    row("ended otherwise (client side)", [f["errors"] or "none" for _, f in runs])
    row("cut by the gateway, by reason (`fleetgate_stream_cuts_total`)", [run.cuts or "none" for run, _ in runs])
    row("cut as silent (`chunk_gap`, `replica_down`, `stall_timeout`)", [f["silent_cuts"] for _, f in runs])
    row(
        "... whose replica sent on another stream afterwards (would have finished)",
        [f["silent_cuts_resumed"] for _, f in runs],
    )
    row(
        f"finished streams silent {OLD_CHUNK_GAP_S:g} s or more at once (the old rule cut these)",
        [f["silent_and_finished"] for _, f in runs],
    )
    row("longest silences within a stream (s)", [", ".join(f"{s:.1f}" for s in f["silences"]) for _, f in runs])
    row("stall episodes (`fleetgate_replica_stall_episodes_total`)", [run.episodes or "none" for run, _ in runs])
    row(
        "seconds sampled stalled (`fleetgate_replica_stalled`)",
        [{k: round(v) for k, v in run.stalled_s.items()} or "none" for run, _ in runs],
    )
    row("stall lengths logged, longest first (s)", [lengths(run) for run, _ in runs])
    row("replicas taken down by their probes", [run.downs for run, _ in runs])
    lines.append("")
    return "\n".join(lines)


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_bytes().splitlines():
        with contextlib.suppress(orjson.JSONDecodeError):
            value = orjson.loads(line)
            if isinstance(value, dict):
                out.append(value)
    return out


async def one_run(args: argparse.Namespace, model_dir: Path, bind: str) -> Run:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    run = Run(bind)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stall-vllm-") as tmp:
        workdir = Path(tmp)
        with gateway(workdir, port, model_dir, bind) as proc:
            async with aiohttp.ClientSession() as session:
                await wait_ready(session, url, proc)
            print(f"[stall] {bind}: both replicas healthy after {time.monotonic() - started:.0f} s", flush=True)
            await load(url, run, args.duration, args.concurrency, args.max_tokens)
        run.access = read_json_lines(workdir / "access.log")
        logged = read_json_lines(workdir / "gateway.log")
        run.stall_lines = [line for line in logged if "stalled" in str(line.get("msg"))]
        run.downs = sum(line.get("msg") == "replica down: probes failing" for line in logged)
    return run


async def main_async(args: argparse.Namespace) -> None:
    started = time.monotonic()
    model_dir = build_tiny_model()
    runs = []
    for bind in args.binds.split(","):
        run = await one_run(args, model_dir, bind)
        runs.append((run, analyse(run)))
    if args.raw:
        Path(args.raw).write_bytes(orjson.dumps([run for run, _ in runs]))  # noqa: ASYNC240 (once, after the runs)
    text = report(runs, args, time.monotonic() - started)
    print(text)
    if not args.no_write:
        RESULTS.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load, per binding")
    parser.add_argument("--binds", default="unset,0", help="VLLM_CPU_OMP_THREADS_BIND per run: unset, or a core list")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--no-write", action="store_true", help=f"print only; do not write {RESULTS.name}")
    parser.add_argument("--raw", default=None, help="also write what was recorded, as JSON, to this file")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
