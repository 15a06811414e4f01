"""What tracing costs: fleetgate with it off (the default), on with every request sampled,
and on at a production sampling ratio.

One command (needs `nginx`, `wrk` and `taskset`)::

    .venv/bin/python bench/tracing_overhead.py [--duration 10] [--rounds 3] [--base REF]

Method (bench/overhead.py's setup and bench/shared_core.py's pairs, all in one run so the ratios
hold on a noisy machine):
- core 0: the gateways, started once: `off` (no OTLP endpoint: the default), `on`
  (`OTEL_EXPORTER_OTLP_ENDPOINT` set, the default sampler `parentbased_always_on`: every
  request is sampled and exports its spans, the worst case), `ratio` (the same with
  `OTEL_TRACES_SAMPLER=parentbased_traceidratio`, `OTEL_TRACES_SAMPLER_ARG=0.1`: a tenth of
  the requests), `stages` (every request sampled, `tracing.stage_spans: true`), `twin` (a
  second `off`), and with `--base REF` the code at that git ref without (`base`) and with
  (`base-on`) an OTLP endpoint;
- core 1: nginx (one worker) answering a fixed chat completion; a second nginx (one
  process) as the span sink, accepting the OTLP/HTTP exports, so its CPU time is its own;
  wrk, keep-alive, POST /v1/chat/completions with a small body and no `traceparent` (the
  gateway starts every trace, so the sampling decision is its own);
- sequential rounds: `off`, `on`, `ratio` (and `base`) each alone under load in turn, at
  concurrency 1 and 32, `--rounds` times; ratios against `off` of the same round, medians.
  Per run, besides wrk's figures: the gateway's CPU time per request, the sink's, and how
  idle core 1 was (the load generator's side must not be the bottleneck);
- shared core: each of `on`, `ratio`, `stages`, `twin` (and `base`, `base-on`) loaded at the
  same time as `off`, 16 connections each, `--rounds` times, in both orders: the first of a
  pair can gain a little, so each ratio is also given as the geometric mean of its two
  orders; and one process can run a few percent faster than another of the same code and
  configuration (`twin` against `off`: 1.05 in either order), so `on` is also measured as
  two processes (`on`, `on2`) against two (`off`, `twin`), every pairing in both orders,
  their geometric mean per round: the figure the bar is read on. Both saturate core 0 and the
  scheduler gives each an even share, so their requests/s differ as their CPU cost per
  request does, and other jobs on the machine slow both alike: on a shared machine the
  sequential rounds swing by more than the effect (one run slowed, the next not), the
  shared-core ratios do not (`twin` shows their own error); with `--base`, `on` and `base-on`
  are also loaded together, in both orders, which measures the change in tracing's own cost;
- the cost tracing off adds to every request, timed in this process: the trace context
  (`gateway.tracing.start_trace`) and the headers sent upstream, against the `off`
  gateway's CPU time per request.

Writes bench/results/tracing-overhead.md (and .json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import timeit
from dataclasses import dataclass
from pathlib import Path

import yaml

# Run as a script, this file's directory would shadow the top-level packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import core_busy_idle, cpu_model, spare_share
from bench.overhead import (
    WrkResult,
    base_tree,
    cpu_seconds,
    gateway_config,
    nginx_conf,
    post_script,
    process,
    wait_http,
    wrk,
)
from bench.shared_core import Shared, geometric_ratios, pairings, shared_core
from gateway.tracing import start_trace
from replicas.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PY = sys.executable
RATIO = 0.1
# Each gateway's tracing variables (None: no OTLP endpoint, tracing off); `base` and
# `base-on` run the code at `--base`.
TRACING: dict[str, dict[str, str] | None] = {
    "off": None,
    "on": {},
    "ratio": {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(RATIO)},
    "stages": {"FLEETGATE_TRACING__STAGE_SPANS": "true"},
    "twin": None,
    "on2": {},
    "base": None,
    "base-on": {},
}
CONCURRENCY = (1, 32)
# Measured in sequential rounds (with `base` when `--base` is given).
SEQUENTIAL = ("off", "on", "ratio")
# Gateways loaded at the same time as `off`, sharing core 0; `twin` is a second `off`, the
# control: its ratio shows the method's own error.
PAIRS = ("on", "ratio", "stages", "twin")
# Two processes of each kind, every `on` against every `off` in both orders: one process can
# run a few percent faster than another of the same code and configuration (`twin` against
# `off`, in either order), more than the bar's margin; the geometric mean over the pairings
# averages the processes of each kind.
BALANCED = (("on", "on2"), ("off", "twin"))
# `geometric_ratios`' keys as this report names them.
SHARED_LABELS = {"rate": "req/s", "cpu": "CPU/request"}


@dataclass
class Run:
    """One wrk run against one gateway, and what it cost the processes on each core."""

    wrk: WrkResult
    requests: int
    gateway_cpu_us: float  # per request
    sink_cpu_us: float  # per request
    core1_idle: float  # share of the run


def sink_conf(tmp: Path, port: int) -> Path:
    """An nginx of its own (one process, so its CPU time is one pid's) that accepts OTLP/HTTP
    span exports: bench/overhead.py's configuration plus ``/v1/traces``."""
    home = tmp / "sink"
    (home / "body").mkdir(parents=True)
    conf = nginx_conf(home, port)
    text = conf.read_text().replace("worker_processes 1;", "master_process off;")
    text = text.replace(
        "    location = /health", "    location = /v1/traces { return 200 ''; }\n    location = /health"
    )
    conf.write_text(text)
    return conf


def measure(url: str, conc: int, duration: int, script: Path, gateway_pid: int, sink_pid: int) -> Run:
    cpu0, sink0, load0 = cpu_seconds(gateway_pid), cpu_seconds(sink_pid), core_busy_idle(1)
    result = wrk(url, conc, duration, script)
    cpu1, sink1, load1 = cpu_seconds(gateway_pid), cpu_seconds(sink_pid), core_busy_idle(1)
    requests = max(1, round(result.rps * duration))
    idle = spare_share(load0, load1)
    return Run(result, requests, (cpu1 - cpu0) / requests * 1e6, (sink1 - sink0) / requests * 1e6, idle)


def off_path_us() -> float:
    """What tracing off adds to each request: a new trace context and its upstream headers."""
    rng = random.Random()

    def one() -> None:
        headers = {"Content-Type": "application/json"}
        headers.update(start_trace(None, None, rng, None).upstream_headers())

    n = 20_000
    return min(timeit.repeat(one, number=n, repeat=5)) / n * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--base", default=None, help="git ref of a gateway to compare `off` with (optional)")
    parser.add_argument("--out", type=Path, default=RESULTS / "tracing-overhead.md")
    args = parser.parse_args()
    for tool in ("nginx", "wrk", "taskset", "git"):
        if shutil.which(tool) is None:
            print(f"needs `{tool}` (apt-get install nginx-light wrk)", file=sys.stderr)
            return 2
    tmp = Path(tempfile.mkdtemp(prefix="fleetgate-tracing-bench-"))
    (tmp / "body").mkdir()
    script = post_script(tmp)
    systems = (["base"] if args.base else []) + list(SEQUENTIAL)
    paired = [*PAIRS, *(("base", "base-on") if args.base else ())]
    # Gateways loaded together on core 0, each pair in both orders (the first of a pair gets a
    # few percent more): each of `paired` beside `off`; with `--base`, also `on` beside `base-on`.
    matches = [m for name in paired for m in pairings((name,), ("off",))]
    matches += [m for m in pairings(*BALANCED) if m not in matches]
    matches += pairings(("on",), ("base-on",)) if args.base else []
    gateways = list(dict.fromkeys([*systems, *paired, *BALANCED[0], *BALANCED[1]]))
    base = base_tree(args.base, tmp) if args.base else None
    p_nginx, p_sink = free_port(), free_port()
    upstream, sink = f"http://127.0.0.1:{p_nginx}", f"http://127.0.0.1:{p_sink}"
    runs: dict[str, dict[int, list[Run]]] = {s: {c: [] for c in CONCURRENCY} for s in systems}
    with contextlib.ExitStack() as stack:
        stack.enter_context(process(["nginx", "-c", str(nginx_conf(tmp, p_nginx))], 1, tmp / "nginx.log"))
        sink_proc = stack.enter_context(process(["nginx", "-c", str(sink_conf(tmp, p_sink))], 1, tmp / "sink.log"))
        wait_http(f"{upstream}/health")
        wait_http(f"{sink}/health")
        urls, pids = {}, {}
        for name in gateways:
            port = free_port()
            cfg = tmp / f"{name}.yaml"
            cfg.write_text(yaml.safe_dump(gateway_config(port, upstream, upstream, upstream)))
            tracing = TRACING[name]
            env = {} if tracing is None else {"OTEL_EXPORTER_OTLP_ENDPOINT": sink, **tracing}
            if base is not None and name.startswith("base"):
                env["PYTHONPATH"] = str(base)
            argv = [PY, "-m", "gateway.cli", "serve", "--config", str(cfg), "--log-dir", str(tmp / f"logs-{name}")]
            cwd_argv = ["env", "-C", str(base if base is not None and name.startswith("base") else ROOT), *argv]
            pids[name] = stack.enter_context(process(cwd_argv, 0, tmp / f"{name}.log", env)).pid
            urls[name] = f"http://127.0.0.1:{port}/v1/chat/completions"
        pairs: dict[str, list[Shared]] = {f"{a}/{b}": [] for a, b in matches}
        for url in urls.values():
            wait_http(url.replace("/v1/chat/completions", "/readyz"))
            wrk(url, 32, 2, script)  # warm-up
        time.sleep(1.0)
        for conc in CONCURRENCY:
            for r in range(args.rounds):
                for name in systems:
                    runs[name][conc].append(measure(urls[name], conc, args.duration, script, pids[name], sink_proc.pid))
                print(f"c={conc} round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for r in range(args.rounds):
            for a, b in matches:
                pairs[f"{a}/{b}"].append(shared_core((urls[a], urls[b]), (pids[a], pids[b]), 16, args.duration, script))
            print(f"shared core round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    # Read after the gateways stopped: the exporter reports dropped spans at shutdown.
    dropped = {name: (tmp / f"{name}.log").read_text().count("spans dropped") for name in ("on", "ratio", "stages")}
    compared = [("on", "off"), ("ratio", "off")] + ([("off", "base")] if base is not None else [])
    ratios = {
        f"{a}/{b} {what} c={c}": statistics.median(get(x) / get(y) for x, y in zip(runs[a][c], runs[b][c], strict=True))
        for a, b in compared
        for c in CONCURRENCY
        for what, get in (("req/s", _rps), ("CPU/request", _cpu))
    }
    shared_runs = {
        f"{key} {what} (shared core)": [values[0] / values[1] for values in series]
        for key, ps in pairs.items()
        for what, series in (("req/s", [p.rate for p in ps]), ("CPU/request", [p.cpu_us for p in ps]))
    }
    for name in paired:
        for what, values in geometric_ratios(pairs, (name,), ("off",)).items():
            shared_runs[f"{name}/off {SHARED_LABELS[what]} (shared core, both orders)"] = values
    for what, values in geometric_ratios(pairs, *BALANCED).items():
        shared_runs[f"on/off {SHARED_LABELS[what]} (shared core, two processes of each, both orders)"] = values
    shared = {k: (statistics.median(v), min(v), max(v)) for k, v in shared_runs.items()}
    off_us = off_path_us()
    results = {
        "duration_s": args.duration,
        "rounds": args.rounds,
        "base": args.base,
        "cpu": cpu_model(),
        "runs": {
            s: {
                c: [{**vars(r.wrk), **{k: v for k, v in vars(r).items() if k != "wrk"}} for r in rs]
                for c, rs in v.items()
            }
            for s, v in runs.items()
        },
        "ratios": ratios,
        "shared_core": {name: [vars(p) for p in ps] for name, ps in pairs.items()},
        "shared_core_ratios": shared_runs,
        "off_path_us": off_us,
        "exporter_dropped_spans_warnings": dropped,
    }
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    args.out.write_text(report(args, systems, runs, ratios, shared, off_us, dropped))
    print(args.out.read_text())
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _rps(run: Run) -> float:
    return run.wrk.rps


def _cpu(run: Run) -> float:
    return run.gateway_cpu_us


def report(
    args: argparse.Namespace,
    systems: list[str],
    runs: dict[str, dict[int, list[Run]]],
    ratios: dict[str, float],
    shared: dict[str, tuple[float, float, float]],
    off_us: float,
    dropped: dict[str, int],
) -> str:
    def med(name: str, conc: int, get: object) -> float:
        return float(statistics.median(get(r) for r in runs[name][conc]))  # type: ignore[operator]

    described = {
        "base": f"the gateway at `{args.base}`",
        "off": "no OTLP endpoint (the default)",
        "on": "every request sampled (default sampler): 2 spans each",
        "ratio": f"`parentbased_traceidratio` {RATIO}",
    }
    extra = f" --base {args.base}" if args.base else ""
    lines = [
        "# Tracing overhead",
        "",
        f"Generated by `.venv/bin/python bench/tracing_overhead.py --duration {args.duration} --rounds {args.rounds}"
        f"{extra}` on {os.cpu_count()} shared cores ({cpu_model()}). Method in the script's docstring:"
        " gateways on core 0; upstream nginx, span sink (its own nginx) and wrk on core 1; medians over rounds.",
        "",
        "| gateway | tracing | c=1 req/s | c=1 p50 ms | c=32 req/s | c=32 p50 ms | c=32 p99 ms"
        " | c=32 gateway CPU µs/req | c=32 sink CPU µs/req | c=32 core 1 idle | errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in systems:
        errs = sum(r.wrk.errors for c in CONCURRENCY for r in runs[name][c])
        lines.append(
            f"| {name} | {described[name]} | {med(name, 1, _rps):,.0f} | {med(name, 1, lambda r: r.wrk.p50_ms):.2f}"
            f" | {med(name, 32, _rps):,.0f} | {med(name, 32, lambda r: r.wrk.p50_ms):.2f}"
            f" | {med(name, 32, lambda r: r.wrk.p99_ms):.2f} | {med(name, 32, _cpu):.0f}"
            f" | {med(name, 32, lambda r: r.sink_cpu_us):.1f} | {med(name, 32, lambda r: r.core1_idle):.0%} | {errs} |"
        )
    lines += ["", "Sequential rounds, medians of the per-round ratios (against `off` in the same round):", ""]
    lines += [f"- {k}: {v:.3f}" for k, v in ratios.items()]
    lines += [
        "",
        "Shared core: each gateway and `off` loaded at the same time on core 0 (16 connections each), in"
        f" both orders, {args.rounds} runs of {args.duration} s, median (and range) of the ratios; `both orders`:"
        " per run the geometric mean of the two orders' ratios; `two processes of each`: `on` and"
        " `on2` against `off` and `twin`, every pairing in both orders, per run the geometric mean of the"
        " eight ratios. `stages`: every request"
        " sampled with `tracing.stage_spans: true`; `twin`: a second `off`, the control"
        + (
            f"; `base`, `base-on`: the code at `{args.base}` without and with an OTLP endpoint, and `on` beside"
            " `base-on` in both orders (the change in tracing's cost, measured directly):"
            if args.base
            else ":"
        ),
        "",
    ]
    lines += [f"- {k}: {m:.3f} ({lo:.3f}-{hi:.3f})" for k, (m, lo, hi) in shared.items()]
    lines += [
        "",
        f"What tracing off adds to every request, timed in-process (`start_trace` and the upstream headers):"
        f" {off_us:.2f} µs, {off_us / med('off', 32, _cpu):.2%} of the `off` gateway's CPU time per request.",
        "",
        f"Exporter warnings of dropped spans at shutdown: {dropped}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
