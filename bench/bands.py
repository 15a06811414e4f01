"""Priority bands on real vLLM: an interactive client's TTFT while a batch-band flood runs.

``fleetgate serve`` starts two managed ``engine: vllm`` replicas of the tiny test model
(``scripts/build_tiny_model.py``) through its own launcher, each pinned to its own core
(``VLLM_CPU_OMP_THREADS_BIND`` 0 and 1), with ``--max-num-seqs`` equal to the gateway's
``capacity.max_requests`` so the pool saturates at the gateway, where the bands apply. Per
scheduling policy (``fcfs``: vLLM's default; ``priority``: ``scheduling_policy: priority``,
so the replicas start with ``--scheduling-policy priority`` and batch-band requests carry
their band's index as ``priority``), one gateway, phases of ``--duration`` seconds each:

- ``interactive alone``: one client sends a streamed chat request every ``1/--rate`` s
  (steady arrivals, open loop), ``--interactive-tokens`` tokens out (``ignore_eos``); the
  client measures TTFT (the first chunk that carries a choice).
- per batch band (``--shares``: one band per ``capacity_share``, ``batch-100``, ``batch-50``
  ...; all below ``interactive``, so one gateway measures them all):
  - ``batch-NN alone``: ``--batch-outstanding`` non-streamed requests always outstanding
    (``x-fleetgate-band: batch-NN``, standing in for a Batch API job's items), each
    ``--batch-tokens`` tokens out; the batch's throughput is its completion tokens per second.
  - ``interactive + batch-NN``: both at once; TTFT p50/p95 as a ratio of the alone phase,
    and the batch's throughput as a share of its batch-alone phase.
- ``interactive + unbanded flood`` (the control): the same flood sent without the band
  header, i.e. in the interactive band, as every request was before bands.

With ``--preempt`` (written to bench/results/bands-preempt.md) the flood is streamed and
each share has a second band, ``batch-NN-p``, the same but ``preemptible: true``: an
interactive request sent to a replica moves that band's streams running there to the other
replica (``routing.preemption``), so the two bands' rows compare preemption with a streamed
flood that is not preempted, in the same run. A streamed batch request counts when it ends
whole (``[DONE]``, no error event, its usage's ``completion_tokens`` what it asked for);
any other end is a batch error. ``preempted`` is how many batch streams the gateway moved in
the phase (``fleetgate_stream_continuations_total{reason="preempted"}``).

    FLEETGATE_VLLM_VENV=/work/main/.venv-vllm flock /tmp/vllm.lock .venv/bin/python bench/bands.py
    ... bench/bands.py --duration 20 --policies priority --no-write     # a quick look
    ... bench/bands.py --preempt --policies fcfs --shares 1,0.5 --duration 30 --no-control
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import orjson

from bench.continuation_failover import Gateway, serve
from bench.routing_vllm import VLLM_PYTHON, build_tiny_model
from bench.soak import cpu_name
from capacity.loadgen import StreamError, stream_chunks
from gateway.settings import hash_key
from replicas.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "bands.md"
RESULTS_PREEMPT = ROOT / "bench" / "results" / "bands-preempt.md"
MODEL = "tiny"
CHAT_KEY = "sk-bands-bench-chat"
BULK_KEY = "sk-bands-bench-bulk"
ADMIN_KEY = "sk-failover-bench-admin"  # continuation_failover.Gateway reads the fleet with it
READY_TIMEOUT_S = 400.0
WORDS = "the fleet serves tokens while a gateway routes each request to a warm replica of its pool".split()
ALONE = "interactive alone"
CONTROL = "interactive + unbanded flood"


def band_name(share: float, preemptible: bool = False) -> str:
    return f"batch-{round(share * 100)}" + ("-p" if preemptible else "")


def batch_bands(args: argparse.Namespace) -> list[str]:
    """The batch bands measured: one per share, and its preemptible twin with ``--preempt``."""
    return [band_name(s, p) for s in args.share_list for p in ((False, True) if args.preempt else (False,))]


@dataclass
class Phase:
    name: str
    # The band the flood is sent in (None: no flood, or the control's unbanded one).
    band: str | None = None
    interactive: bool = True
    flood: bool = False
    ttfts: list[float] = field(default_factory=list)
    interactive_errors: int = 0
    batch_done: int = 0
    batch_tokens: int = 0
    batch_refused: int = 0
    batch_errors: int = 0
    # Batch streams the gateway moved off a replica for interactive work during the phase.
    preempted: int = 0
    seconds: float = 0.0
    # From the gateway's access log: the interactive requests' wait in its queue (0 when
    # they went straight on) and the TTFT it saw from the replica.
    queued_ms: list[float] = field(default_factory=list)
    gateway_ttft_ms: list[float] = field(default_factory=list)

    def ttft(self, q: float) -> float | None:
        if len(self.ttfts) < 2:
            return None
        return statistics.quantiles(self.ttfts, n=100, method="inclusive")[round(q * 100) - 1]

    @property
    def batch_tokens_per_s(self) -> float:
        return self.batch_tokens / self.seconds if self.seconds else 0.0


def gateway_config(port: int, model_dir: Path, args: argparse.Namespace, policy: str) -> dict[str, Any]:
    def replica(core: int) -> dict[str, Any]:
        return {
            "engine": "vllm",
            "count": 1,
            "python": str(VLLM_PYTHON),
            "model_path": str(model_dir),
            "args": [
                "--max-model-len",
                "4096",
                "--enforce-eager",
                "--dtype",
                args.dtype,
                "--max-num-seqs",
                str(args.max_requests),
            ],
            "env": {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core)},
            **({"scheduling_policy": "priority"} if policy == "priority" else {}),
        }

    batches = [
        {"name": band_name(s, p), "max_wait_s": 600, "capacity_share": s, **({"preemptible": True} if p else {})}
        for s in args.share_list
        for p in ((False, True) if args.preempt else (False,))
    ]
    return {
        "server": {"port": port, "shutdown_grace_s": 5.0},
        "models": [
            {
                "name": MODEL,
                "replicas": [replica(0), replica(1)],
                "capacity": {"max_requests": args.max_requests},
            }
        ],
        "bands": ["interactive", "standard", *batches],
        "routing": {"queue": {"max_queue_length": 4096}},
        "upstream": {"connect_timeout_s": 5.0},
        "health": {"interval_s": 0.5, "timeout_s": 2.0, "start_timeout_s": READY_TIMEOUT_S},
        "tenants": [
            {"id": "chat", "api_keys": [f"sha256:{hash_key(CHAT_KEY)}"]},
            {"id": "bulk", "api_keys": [f"sha256:{hash_key(BULK_KEY)}"]},
        ],
        "admin_api_keys": [f"sha256:{hash_key(ADMIN_KEY)}"],
    }


def prompt(rng: random.Random, words: int) -> str:
    # A random prompt per request: no two share a prefix, so the prefix cache plays no part.
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def interactive_client(
    session: aiohttp.ClientSession, url: str, args: argparse.Namespace, phase: Phase, until: float
) -> None:
    rng = random.Random(1)
    tasks: list[asyncio.Task[None]] = []

    async def one() -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt(rng, args.interactive_words)}],
            "max_tokens": args.interactive_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        started = time.perf_counter()
        try:
            async with session.post(
                f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {CHAT_KEY}"}
            ) as resp:
                if resp.status != 200:
                    phase.interactive_errors += 1
                    return
                first = None
                async for chunk in stream_chunks(resp.content):
                    if first is None and chunk.get("choices"):
                        first = time.perf_counter() - started
                if first is not None:
                    phase.ttfts.append(first)
        except (aiohttp.ClientError, StreamError, TimeoutError):
            phase.interactive_errors += 1

    interval = 1 / args.rate
    next_at = time.perf_counter()
    while next_at < until:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        tasks.append(asyncio.create_task(one()))
        next_at += interval
    await asyncio.gather(*tasks)


async def batch_flood(
    session: aiohttp.ClientSession, url: str, args: argparse.Namespace, phase: Phase, until: float, band: str | None
) -> None:
    headers = {"Authorization": f"Bearer {BULK_KEY}"}
    if band is not None:
        headers["x-fleetgate-band"] = band

    async def worker(seed: int) -> None:
        rng = random.Random(1000 + seed)
        while time.perf_counter() < until:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt(rng, args.batch_words)}],
                "max_tokens": args.batch_tokens,
                "ignore_eos": True,
            }
            if args.preempt:
                await streamed_item(body)
                continue
            try:
                async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
                    raw = await resp.read()
                    if resp.status in (429, 503):
                        phase.batch_refused += 1
                        await asyncio.sleep(min(1.0, float(resp.headers.get("Retry-After", "1"))))
                        continue
                    if resp.status != 200:
                        phase.batch_errors += 1
                        continue
            except (aiohttp.ClientError, TimeoutError):
                phase.batch_errors += 1
                continue
            if time.perf_counter() <= until:  # only what finished inside the window counts
                phase.batch_done += 1
                phase.batch_tokens += int(orjson.loads(raw)["usage"]["completion_tokens"])

    async def streamed_item(body: dict[str, Any]) -> None:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        tokens = None
        try:
            async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
                if resp.status in (429, 503):
                    await resp.read()
                    phase.batch_refused += 1
                    await asyncio.sleep(min(1.0, float(resp.headers.get("Retry-After", "1"))))
                    return
                if resp.status != 200:
                    await resp.read()
                    phase.batch_errors += 1
                    return
                async for chunk in stream_chunks(resp.content):
                    if chunk.get("usage"):
                        tokens = int(chunk["usage"]["completion_tokens"])
        except (aiohttp.ClientError, StreamError, TimeoutError):
            phase.batch_errors += 1
            return
        if tokens is None or tokens != args.batch_tokens:  # not whole: lost or cut somewhere
            phase.batch_errors += 1
            return
        if time.perf_counter() <= until:  # only what finished inside the window counts
            phase.batch_done += 1
            phase.batch_tokens += tokens

    workers = [asyncio.create_task(worker(i)) for i in range(args.batch_outstanding)]
    await asyncio.sleep(max(0.0, until - time.perf_counter()))
    for w in workers:  # what is still in flight at the end is cut, not counted
        w.cancel()
    await asyncio.gather(*workers, return_exceptions=True)


def gateway_view(access_log: Path, since: float, phase: Phase) -> None:
    """The interactive requests' queue wait and TTFT as the gateway logged them (wall clock ``since``)."""
    for raw in access_log.read_bytes().splitlines():
        with contextlib.suppress(ValueError):
            line = orjson.loads(raw)
            if line.get("ts", 0) >= since and line.get("tenant") == "chat" and line.get("status") == 200:
                phase.queued_ms.append(float(line.get("queued_ms", 0.0)))
                if "ttft_ms" in line:
                    phase.gateway_ttft_ms.append(float(line["ttft_ms"]))


def quantile(values: list[float], q: float) -> float | None:
    if len(values) < 2:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def preempted_total(metrics: str) -> int:
    """Streams the gateway has preempted so far, all models (its continuations metric)."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith("fleetgate_stream_continuations_total{") and 'reason="preempted"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


async def run_phase(session: aiohttp.ClientSession, gw: Gateway, args: argparse.Namespace, phase: Phase) -> Phase:
    url = gw.url
    before = preempted_total(await gw.metrics(session)) if args.preempt else 0
    wall = time.time()
    started = time.perf_counter()
    until = started + args.duration
    jobs = []
    if phase.interactive:
        jobs.append(interactive_client(session, url, args, phase, until))
    if phase.flood:
        jobs.append(batch_flood(session, url, args, phase, until, phase.band))
    await asyncio.gather(*jobs)
    phase.seconds = args.duration
    await asyncio.sleep(0.3)  # the access log is flushed every 0.1 s
    gateway_view(gw.workdir / "access.log", wall, phase)
    if args.preempt:
        phase.preempted = preempted_total(await gw.metrics(session)) - before
    return phase


async def run_policy(model_dir: Path, args: argparse.Namespace, policy: str) -> dict[str, Any]:
    port = free_port()
    config = gateway_config(port, model_dir, args, policy)
    with tempfile.TemporaryDirectory(prefix="bands-vllm-") as tmp, serve(Path(tmp), config) as gw:
        timeout = aiohttp.ClientTimeout(total=900)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            ready = await gw.wait_healthy(session)
            print(f"[{policy}] both replicas healthy after {ready:.0f} s", flush=True)
            # Warm-up: the engines' first requests are slower (allocations, first steps).
            warm = Phase("warm-up")
            await batch_flood(session, gw.url, args, warm, time.perf_counter() + 5, band_name(args.share_list[0]))
            plan = [Phase(ALONE)]
            for band in batch_bands(args):
                plan += [
                    Phase(f"{band} alone", band, interactive=False, flood=True),
                    Phase(f"interactive + {band}", band, flood=True),
                ]
            if not args.no_control:
                plan.append(Phase(CONTROL, None, flood=True))
            phases = []
            for phase in plan:
                await run_phase(session, gw, args, phase)
                print(f"[{policy}] {summary(phase)}", flush=True)
                phases.append(phase)
            metrics = await gw.metrics(session)
    shed = [line for line in metrics.splitlines() if line.startswith("fleetgate_shed_total{")]
    return {"policy": policy, "ready_s": ready, "phases": phases, "shed": shed}


def summary(p: Phase) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f} ms"

    return (
        f"{p.name}: ttft p50 {ms(p.ttft(0.5))} p95 {ms(p.ttft(0.95))} (n={len(p.ttfts)}, err {p.interactive_errors}); "
        f"batch {p.batch_done} done, {p.batch_tokens_per_s:.0f} tok/s, "
        f"refused {p.batch_refused}, err {p.batch_errors}, preempted {p.preempted}; "
        f"gateway: queued p50 {ms_or_dash(quantile(p.queued_ms, 0.5))} p95 {ms_or_dash(quantile(p.queued_ms, 0.95))}, "
        f"ttft p50 {ms_or_dash(quantile(p.gateway_ttft_ms, 0.5))}"
    )


def ms_or_dash(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


def report(results: list[dict[str, Any]], args: argparse.Namespace, took_s: float) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or not b else f"{a / b:.2f}x"

    shares = ", ".join(
        f"{{name: {band_name(s, p)}, max_wait_s: 600, capacity_share: {s:g}{', preemptible: true' if p else ''}}}"
        for s in args.share_list
        for p in ((False, True) if args.preempt else (False,))
    )
    flags = (" --preempt" if args.preempt else "") + (" --no-control" if args.no_control else "")
    title = (
        "# Preemption on real vLLM (CPU): interactive TTFT under a streamed batch-band flood"
        if args.preempt
        else "# Priority bands on real vLLM (CPU): interactive TTFT under a batch-band flood"
    )
    flood = (
        "streamed requests outstanding (each counted when it ends whole: `[DONE]`, no error event, "
        "all its tokens; any other end is a batch error)"
        if args.preempt
        else "non-streamed requests outstanding"
    )
    twins = (
        "Each `batch-NN-p` band is its `batch-NN` twin with `preemptible: true`: an interactive request sent to "
        "a replica moves that band's streams running there to the other replica, where each is continued "
        "(`preempted`: streams moved during the phase). "
        if args.preempt
        else ""
    )
    lines = [
        title,
        "",
        f"Command: `FLEETGATE_VLLM_VENV=/work/main/.venv-vllm flock /tmp/vllm.lock .venv/bin/python bench/bands.py "
        f"--policies {args.policies} --shares {args.shares}{flags} --duration {args.duration:g} --rate {args.rate:g} "
        f"--batch-outstanding {args.batch_outstanding} --max-requests {args.max_requests} "
        f"--interactive-tokens {args.interactive_tokens} --batch-tokens {args.batch_tokens}` "
        f"({took_s / 60:.0f} min on {cpu_name()}, {os.cpu_count()} cores).",
        "",
        "Method: `fleetgate serve` starts two managed `engine: vllm` replicas of the tiny test model "
        "(`scripts/build_tiny_model.py`, ~0.8 M parameters) through its own launcher, one per core "
        f"(`VLLM_CPU_OMP_THREADS_BIND` 0 and 1, `--enforce-eager --dtype {args.dtype}`), each with "
        f"`--max-num-seqs {args.max_requests}` and the gateway's `capacity.max_requests: {args.max_requests}`, "
        "so the pool saturates at the gateway, where the bands apply; one gateway per vLLM scheduling "
        "policy (`priority`: `scheduling_policy: priority`, the replicas started with "
        "`--scheduling-policy priority`, batch-band requests carrying their band's index as `priority`). "
        f"Bands: `[interactive, standard, {shares}]`: one batch band per capacity share, so one gateway "
        "measures them all. "
        f"{twins}"
        f"The interactive client sends a streamed chat request every {1 / args.rate:g} s "
        f"(~{args.interactive_words} words in, {args.interactive_tokens} tokens out, `ignore_eos`) and measures "
        "TTFT at its first chunk with a choice. The batch flood keeps "
        f"{args.batch_outstanding} {flood} (~{args.batch_words} words in, "
        f"{args.batch_tokens} tokens out) with `x-fleetgate-band: batch-NN`"
        + (", streamed so that it can be preempted" if args.preempt else ", as the Batch API's items are sent")
        + "; its throughput is completion tokens per second of requests that finished inside the phase, "
        "and its share is against the same band's flood alone. "
        + (
            ""
            if args.no_control
            else "The control row sends the same flood without the header (the interactive band: every request "
            "before bands). "
        )
        + "Each phase lasts "
        f"{args.duration:g} s, after a 5 s warm-up; every prompt is random, so the prefix cache plays no part. "
        'The gateway, the client and the replicas share the machine\'s two cores. "gateway queued" is the '
        "interactive requests' wait in the gateway's queue, from its access log.",
        "",
        "| vLLM scheduling | phase | TTFT p50 ms | TTFT p95 ms | p50 / alone | p95 / alone | "
        "interactive n (errors) | gateway queued p95 ms | batch tok/s | batch share of alone | batch refused |"
        + (" batch errors | preempted |" if args.preempt else ""),
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        + (" ---: | ---: |" if args.preempt else ""),
    ]
    for r in results:
        phases: list[Phase] = r["phases"]
        alone = next((p for p in phases if p.name == ALONE), None)
        batch_alone = {p.band: p for p in phases if p.flood and not p.interactive}
        base50 = alone.ttft(0.5) if alone else None
        base95 = alone.ttft(0.95) if alone else None
        for p in phases:
            p50, p95 = p.ttft(0.5), p.ttft(0.95)
            reference = batch_alone.get(p.band) or batch_alone.get(band_name(args.share_list[0]))
            share = (
                f"{p.batch_tokens_per_s / reference.batch_tokens_per_s:.0%}"
                if p.flood and reference and reference.batch_tokens_per_s
                else "-"
            )
            queued = quantile(p.queued_ms, 0.95)
            cells = [
                r["policy"],
                p.name,
                ms(p50) if p.interactive else "-",
                ms(p95) if p.interactive else "-",
                ratio(p50, base50) if p.interactive else "-",
                ratio(p95, base95) if p.interactive else "-",
                f"{len(p.ttfts)} ({p.interactive_errors})" if p.interactive else "-",
                f"{queued:.0f}" if p.interactive and queued is not None else "-",
                f"{p.batch_tokens_per_s:.0f}" if p.flood else "-",
                share,
                str(p.batch_refused) if p.flood else "-",
            ]
            if args.preempt:
                cells += [str(p.batch_errors) if p.flood else "-", str(p.preempted) if p.flood else "-"]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for r in results:
        if r["shed"]:
            lines.append(f"Shed by the gateway ({r['policy']}): " + "; ".join(r["shed"]))
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    model_dir = build_tiny_model()
    return [await run_policy(model_dir, args, policy) for policy in args.policies.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="fcfs,priority", help="vLLM scheduling policies, one gateway each")
    parser.add_argument(
        "--shares", default="1,0.5,0.25", help="capacity shares of the batch bands, one band (and two phases) each"
    )
    parser.add_argument("--no-control", action="store_true", help="skip the unbanded flood")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per phase")
    parser.add_argument("--rate", type=float, default=2.0, help="interactive requests per second")
    parser.add_argument("--interactive-words", type=int, default=100)
    parser.add_argument("--interactive-tokens", type=int, default=32)
    parser.add_argument("--batch-outstanding", type=int, default=64, help="batch-band requests always in flight")
    parser.add_argument("--batch-words", type=int, default=200)
    parser.add_argument("--batch-tokens", type=int, default=128)
    parser.add_argument("--max-requests", type=int, default=8, help="per replica: vLLM's --max-num-seqs too")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--preempt",
        action="store_true",
        help="stream the flood, and measure each share's band again as preemptible (bench/results/bands-preempt.md)",
    )
    parser.add_argument("--no-write", action="store_true", help="print the report; do not write bench/results")
    args = parser.parse_args()
    args.share_list = [float(s) for s in args.shares.split(",")]
    started = time.monotonic()
    results = asyncio.run(main_async(args))
    text = report(results, args, time.monotonic() - started)
    print(text)
    if not args.no_write:
        (RESULTS_PREEMPT if args.preempt else RESULTS).write_text(text)


if __name__ == "__main__":
    main()
