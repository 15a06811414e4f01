"""What the gateway's allocator costs on the request path: ``fleetgate serve`` with
``PYTHONMALLOC=malloc`` (glibc's malloc for every object, docs/operations.md#memory) against
CPython's pymalloc (its default).

One command (needs `nginx`, `wrk` and `taskset`, as bench/overhead.py)::

    .venv/bin/python -m bench.allocator [--duration 4] [--rounds 4] [--streams 16]

Method: bench/shared_core.py's, on bench/overhead.py's setup, all in one run:
- core 0: four gateways, started once: `malloc`, `malloc2` (``PYTHONMALLOC=malloc``) and
  `pymalloc`, `pymalloc2` (``PYTHONMALLOC=pymalloc``), the same code and configuration;
- core 1: nginx (one worker) answering a fixed chat completion, the SSE upstream (200 events
  per stream), and the load generators;
- shared core, JSON: per round, each `malloc*` loaded at the same time as each `pymalloc*`,
  in both orders (8 runs), wrk POST /v1/chat/completions, 16 connections each, both
  saturating core 0; and the twins (`malloc` with `malloc2`, `pymalloc` with `pymalloc2`, in
  both orders) as the method's own error. Per round: the geometric mean over the pairings
  of the ratio of requests/s and of CPU time per request; reported: the median over rounds
  and the range;
- shared core, streams: the same pairings, each gateway relaying `--streams` (16) concurrent
  streams (bench/overhead.py's stream client): events relayed per second, CPU time per event.
  Here the load side (one Python upstream, two Python clients on core 1) cannot saturate two
  gateways: with 16 streams each neither core is full, with 48 core 1 is and core 0 still is
  not. So the events/s ratio follows the load side more than the gateways' cost, and the CPU
  time per event (which also moves with how many events each read brings) is the figure to
  read, against its twins. The report gives the time each core had to spare;
- sequential, c=1: per round each of the four gateways alone under wrk at concurrency 1 (the
  order reversed every other round), p50 latency; the ratio per round is the geometric mean of
  the two `malloc*` over that of the two `pymalloc*`. Cheap, and as noisy as any sequential
  figure on a shared machine.

Writes bench/results/allocator.md (and .json with every run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from bench.machine import cpu_model
from bench.overhead import PY, RESULTS, gateway_config, nginx_conf, post_script, process, wait_http, wrk
from bench.shared_core import Shared, geometric_ratios, pairings, shared_core, shared_streams
from replicas.launcher import free_port

# Each gateway's PYTHONMALLOC: two processes of each kind (bench/shared_core.py says why).
ALLOCATORS = {"malloc": "malloc", "malloc2": "malloc", "pymalloc": "pymalloc", "pymalloc2": "pymalloc"}
KINDS = (("malloc", "malloc2"), ("pymalloc", "pymalloc2"))
CONNECTIONS = 16  # wrk connections per gateway in a shared-core run
STREAMS = 16  # concurrent streams per gateway in a shared-core run
# The figures: (ons, offs) of each ratio; the twins are the control.
COMPARED = {"malloc/pymalloc": KINDS, "malloc/malloc2": (("malloc",), ("malloc2",))}
COMPARED["pymalloc/pymalloc2"] = (("pymalloc",), ("pymalloc2",))


def matches() -> list[tuple[str, str]]:
    """The shared-core runs of a round: every `malloc*` with every `pymalloc*`, then the twins,
    each in both orders."""
    return [m for ons, offs in COMPARED.values() for m in pairings(ons, offs)]


def spread(values: list[float]) -> tuple[float, float, float]:
    """Median, min and max."""
    return statistics.median(values), min(values), max(values)


def ratios(pairs: dict[str, list[Shared]]) -> dict[str, dict[str, list[float]]]:
    """Per figure of ``COMPARED``, the per-round ratios (``rate`` and ``cpu``)."""
    return {name: geometric_ratios(pairs, ons, offs) for name, (ons, offs) in COMPARED.items()}


def latency_ratios(p50_ms: dict[str, list[float]]) -> list[float]:
    """Per round, the geometric mean of the `malloc*` gateways' c=1 p50 over that of the
    `pymalloc*` ones."""

    def geomean(names: tuple[str, ...], i: int) -> float:
        return math.exp(statistics.fmean(math.log(p50_ms[n][i]) for n in names))

    return [geomean(KINDS[0], i) / geomean(KINDS[1], i) for i in range(len(p50_ms[KINDS[0][0]]))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=4, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--streams", type=int, default=STREAMS, help="concurrent streams per gateway, 0: no stream runs"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "allocator.md")
    args = parser.parse_args()
    for tool in ("nginx", "wrk", "taskset"):
        if shutil.which(tool) is None:
            print(f"needs `{tool}` (apt-get install nginx-light wrk)", file=sys.stderr)
            return 2
    started, load_before = time.time(), os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="fleetgate-alloc-"))
    (tmp / "body").mkdir()
    script = post_script(tmp)
    p_nginx, p_sse = free_port(), free_port()
    upstream, sse = f"http://127.0.0.1:{p_nginx}", f"http://127.0.0.1:{p_sse}"
    json_pairs: dict[str, list[Shared]] = {f"{a}/{b}": [] for a, b in matches()}
    stream_pairs: dict[str, list[Shared]] = {f"{a}/{b}": [] for a, b in matches()}
    p50_ms: dict[str, list[float]] = {name: [] for name in ALLOCATORS}
    with contextlib.ExitStack() as stack:
        stack.enter_context(process(["nginx", "-c", str(nginx_conf(tmp, p_nginx))], 1, tmp / "nginx.log"))
        stack.enter_context(
            process([PY, "bench/sse_upstream.py", "--port", str(p_sse), "--events", "200"], 1, tmp / "sse.log")
        )
        wait_http(f"{upstream}/health")
        wait_http(f"{sse}/health")
        urls, pids = {}, {}
        for name, allocator in ALLOCATORS.items():
            port = free_port()
            cfg = tmp / f"{name}.yaml"
            cfg.write_text(yaml.safe_dump(gateway_config(port, upstream, sse, sse)))
            argv = [PY, "-m", "gateway.cli", "serve", "--config", str(cfg), "--log-dir", str(tmp / f"logs-{name}")]
            env = {"PYTHONMALLOC": allocator}
            pids[name] = stack.enter_context(process(argv, 0, tmp / f"{name}.log", env)).pid
            urls[name] = f"http://127.0.0.1:{port}/v1/chat/completions"
        for url in urls.values():
            wait_http(url.replace("/v1/chat/completions", "/readyz"))
            wrk(url, 32, 2, script)  # warm-up
        time.sleep(1.0)
        for r in range(args.rounds):
            for a, b in matches():
                json_pairs[f"{a}/{b}"].append(
                    shared_core((urls[a], urls[b]), (pids[a], pids[b]), CONNECTIONS, args.duration, script)
                )
            if args.streams:
                for a, b in matches():
                    stream_pairs[f"{a}/{b}"].append(
                        shared_streams(
                            (urls[a], urls[b]), (pids[a], pids[b]), "bench-stream", args.streams, args.duration
                        )
                    )
            for name in list(ALLOCATORS)[:: 1 if r % 2 == 0 else -1]:
                p50_ms[name].append(wrk(urls[name], 1, args.duration, script).p50_ms)
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    measured = Measured(
        time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        (time.time() - started) / 60,
        args.duration,
        args.rounds,
        args.streams,
        f"{os.cpu_count()} cores ({cpu_model()})",
        load_before,
        os.getloadavg(),
        json_pairs,
        stream_pairs if args.streams else {},
        p50_ms,
    )
    results = {
        **asdict(measured),
        "json_ratios": ratios(measured.json_pairs),
        "stream_ratios": ratios(measured.stream_pairs) if measured.stream_pairs else {},
        "c1_p50_ratios": latency_ratios(p50_ms),
    }
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    args.out.write_text(report(measured, _history(args.out)))
    print(args.out.read_text())
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


@dataclass
class Measured:
    """One run's figures and what the machine did meanwhile."""

    when: str
    minutes: float
    duration_s: int
    rounds: int
    streams: int  # per gateway in the stream runs
    machine: str
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    json_pairs: dict[str, list[Shared]]  # "a/b": one run per round, `a` started first
    stream_pairs: dict[str, list[Shared]]  # empty with --streams 0
    p50_ms: dict[str, list[float]]  # c=1, sequential, per gateway one per round


# The results file's hand-written paragraph on why this bench exists starts so, and is kept.
HISTORY_START = "Why:"


def _history(out: Path) -> str:
    if not out.exists():
        return ""
    text = out.read_text()
    start = text.find(HISTORY_START)
    if start < 0:
        return ""
    end = text.find("\n\n", start)
    return text[start : end if end >= 0 else None].strip()


def report(m: Measured, history: str) -> str:
    """The Markdown results file."""

    def row(label: str, values: list[float]) -> str:
        med, lo, hi = spread(values)
        return f"| {label} | {med:.3f} | {lo:.3f}-{hi:.3f} | {', '.join(f'{v:.3f}' for v in values)} |"

    def spare(pairs: dict[str, list[Shared]]) -> str:
        def one(core: int) -> str:
            med, lo, hi = spread([p.spare[core] for v in pairs.values() for p in v])
            return f"core {core} {med:.0%} ({lo:.0%}-{hi:.0%})"

        return (
            f"Time each core had to spare (idle or running only niced work) during these runs, median and range:"
            f" {one(0)}, {one(1)}"
        )

    def load(values: tuple[float, float, float]) -> str:
        return ", ".join(f"{v:.2f}" for v in values)

    header = ["| ratio | median over rounds | range | per round |", "| --- | ---: | ---: | --- |"]
    lines = [
        "# The gateway's allocator: glibc malloc against CPython's pymalloc (bench/allocator.py)",
        "",
        *([history, ""] if history else []),
        f"Command: `flock /work/wt/bench.lock .venv/bin/python -m bench.allocator --duration {m.duration_s}"
        f" --rounds {m.rounds} --streams {m.streams}`  ",
        f"Measured {m.when}, {m.minutes:.1f} minutes, on {m.machine}, shared with other work; load average"
        f" (1, 5, 15 min) before {load(m.load_before)}, after {load(m.load_after)}.  ",
        "Method: the docstring of bench/allocator.py. Four gateways on core 0, `malloc` and `malloc2`"
        " (`PYTHONMALLOC=malloc`), `pymalloc` and `pymalloc2` (`PYTHONMALLOC=pymalloc`); nginx, the SSE"
        " upstream and the load generators on core 1. Shared core: two gateways saturated at once on core 0,"
        " every `malloc*` with every `pymalloc*` in both orders, per round the geometric mean of the 8 ratios"
        " (CPU: CPU time per request or event, so above 1 means malloc costs more); the twins (same"
        " allocator, two processes, both orders) show the method's own error.",
        "",
        f"## JSON requests, shared core (wrk, {CONNECTIONS} connections per gateway)",
        "",
        *header,
    ]
    for name, series in ratios(m.json_pairs).items():
        lines += [row(f"{name} req/s", series["rate"]), row(f"{name} CPU per request", series["cpu"])]
    errors = sum(p.errors for v in m.json_pairs.values() for p in v)
    lines += ["", f"{spare(m.json_pairs)}; failed requests: {errors}."]
    if m.stream_pairs:
        lines += [
            "",
            f"## Streams, shared core ({m.streams} concurrent streams of 200 events per gateway)",
            "",
            *header,
        ]
        for name, series in ratios(m.stream_pairs).items():
            lines += [row(f"{name} events/s relayed", series["rate"]), row(f"{name} CPU per event", series["cpu"])]
        lines += ["", f"{spare(m.stream_pairs)}."]
    lines += [
        "",
        "## Latency at concurrency 1, sequential (wrk, each gateway alone)",
        "",
        "| gateway | p50 ms, median over rounds | per round |",
        "| --- | ---: | --- |",
        *(
            f"| {name} | {statistics.median(v):.3f} | {', '.join(f'{x:.3f}' for x in v)} |"
            for name, v in m.p50_ms.items()
        ),
        "",
        *header,
        row("malloc/pymalloc p50 (two of each)", latency_ratios(m.p50_ms)),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
