"""``fleetgate bench``: how many concurrent users can this fleet serve within our SLO?

Drives any OpenAI-compatible endpoint (fleetgate, or a vLLM server directly) with a
workload profile, sweeps the load, records what users feel (TTFT, inter-token latency,
per-user and total tokens/s, errors) and what the fleet felt (KV-cache use, queues,
preemptions, prefix-cache hits), and answers with the largest load that meets the SLOs and
the SLO that breaks first. The gateway's ``fleetgate bench`` subcommand is wired to
``add_arguments`` and ``run``; ``python -m capacity.cli`` runs the same thing.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import secrets
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from capacity.fleet_probe import FLEET_METRICS, AdminFleetSource, FleetProbe, FleetSource, MetricsSource
from capacity.loadgen import LoadGenerator, Mode, PointPlan, Progress, Target
from capacity.planner import Slo, SloError, judge, next_level, parse_slo
from capacity.report import (
    MODE_UNITS,
    LiveView,
    PointRecord,
    SweepRecord,
    error_totals,
    from_json,
    point_row,
    write_all,
)
from capacity.stats import errors_by_kind, median_metrics, percentile, point_metrics
from capacity.workload import Workload, WorkloadError, load_workload, request_sizes

DEFAULT_TARGET = "http://127.0.0.1:8080"
DESCRIPTION = """\
How many concurrent users can this fleet serve within our SLO? Drives an OpenAI-compatible
endpoint (fleetgate, or a vLLM server directly) with a workload profile, sweeps the load,
records what users feel and what the fleet felt, and answers with the largest load that
meets the SLOs and the SLO that breaks first. Writes a Markdown report, JSON with every
sample and PNG plots."""
DRY_RUN_SESSIONS = 2000
LIVE_REFRESH_S = 0.25

EPILOG = """\
what a point measures (all durations in real-time-equivalent seconds, see --time-scale):
  ttft_p50/p95/p99     time to first token: request sent -> first text event
  itl_p50/p95/p99      inter-token latency: gaps between text events of a stream
  max_gap              the longest silence inside any stream (a preemption pause shows here)
  per_user_tps         mean decode rate per request: (tokens - 1) / (last token - first token)
  per_user_tps_p5      the decode rate 1 request in 20 gets or worse
  total_tps            tokens generated inside the window by anyone / window length
  error_rate, errors   failed requests (by kind in the report: http_429, context_length, timeout...)
  e2e_p50/p95, request_rate, ttft_cold_p50, ttft_warm_p50 (first turns opening with a shared
  prefix: cold = unique opening or first use, warm = a copy already prefilled)
  from the fleet (--metrics-url or --admin-url): kv_peak, kv_mean (0-1), waiting_peak,
  waiting_mean, running_peak, preemptions, prefix_hit_rate

SLOs: METRIC OP VALUE with OP one of <= >= == < >, times in s or ms, e.g.
  --slo "ttft_p95<=1.0" --slo "per_user_tps>=10" --slo "preemptions==0" --slo "itl_p95<=150ms"
The capacity is the last level of the unbroken run of passing points from the bottom of the
sweep; the report names the SLOs broken at the next level (where it breaks first) and, per SLO,
where its metric crossed the line (interpolated).

examples:
  # the published RTX 3060 sweep against a simulated card running 2x faster than real time
  python -m sim.server --port 8000 --model qwen --profile rtx3060-qwen2.5-7b-awq --time-scale 2 &
  fleetgate bench --target sim=http://127.0.0.1:8000 --model qwen --profile rtx3060-reproduction \\
      --concurrency 1,2,4,8,16,32,64,96 --start-together --time-scale 2 --reference \\
      --metrics-url http://127.0.0.1:8000 --slo "ttft_p95<=1.0" --slo "per_user_tps>=10" --out bench/results
  # the gateway's cost: the same points through fleetgate and straight to the replica
  fleetgate bench --target gateway=http://127.0.0.1:8080 --target direct=http://127.0.0.1:8000 \\
      --baseline direct --api-key "$FLEETGATE_KEY" --concurrency 1,4,16 --metrics-url http://127.0.0.1:8000
  # check a profile's request sizes without sending anything
  fleetgate bench --profile coding-assistant --dry-run
"""


_HELP = {
    "target": f"an OpenAI-compatible base URL; repeat to compare targets point by point (default {DEFAULT_TARGET})",
    "profile": "a shipped profile (chat-assistant, coding-assistant, short-long-mix, rtx3060-reproduction, "
    "prefix-gap) or a YAML file; see docs/capacity-planning.md",
    "reference": "print the profile's published figures beside the measured ones (when the target is that card)",
    "time_scale": "the endpoint runs X times faster than real time (a simulator's --time-scale): waits are "
    "divided by X and measured durations multiplied by X, so figures are real-time-equivalent",
    "refine": "after the sweep, up to N extra points bisecting between the capacity and the first failure",
    "start_together": "closed loop: all users send their first request at once (as most benchmark scripts do) "
    "instead of spreading the starts over the warm-up",
    "from_json": "send nothing: write the report again from a run's JSON, judged by the --slo given (if any) "
    "and with the --note lines added",
    "repeat": "run every point N times per target (target order alternating) and report each metric's "
    "median: steadier figures on a shared or noisy machine",
    "metrics_url": "a replica's base URL (or its /metrics); repeat for every replica",
}


def _levels(text: str) -> list[float]:
    try:
        levels = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not levels or levels[0] <= 0:
        raise argparse.ArgumentTypeError(f"levels must be positive, got {text!r}")
    return levels


def _target(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    return (name, url) if sep and not name.startswith("http") else ("fleet", text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``fleetgate bench``."""
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    g = parser.add_argument_group("what to load")
    g.add_argument("--target", action="append", type=_target, metavar="[NAME=]URL", help=_HELP["target"])
    g.add_argument("--model", help="the model name to send (default: the first of the target's /v1/models)")
    g.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (a fleetgate tenant key)")
    g.add_argument("--baseline", metavar="NAME", help="the target the others are compared with (the gateway's cost)")
    g = parser.add_argument_group("workload")
    g.add_argument("--profile", default="chat-assistant", help=_HELP["profile"])
    g.add_argument("--context-limit", type=int, metavar="TOKENS", help="override the profile's context_limit_tokens")
    g.add_argument("--dry-run", action="store_true", help="print the profile's request sizes per class and exit")
    g.add_argument("--reference", action="store_true", help=_HELP["reference"])
    g = parser.add_argument_group("load")
    g.add_argument("--concurrency", type=_levels, metavar="N,N,...", help="closed loop: concurrent users per point")
    g.add_argument("--rate", type=_levels, metavar="R,R,...", help="open loop: Poisson session arrivals per second")
    g.add_argument("--warmup", type=float, default=10.0, metavar="S", help="seconds before a point's window (10)")
    g.add_argument("--duration", type=float, default=60.0, metavar="S", help="a point's measurement window (60)")
    g.add_argument("--request-timeout", type=float, default=600.0, metavar="S", help="per request (600)")
    g.add_argument("--time-scale", type=float, default=1.0, metavar="X", help=_HELP["time_scale"])
    g.add_argument("--refine", type=int, default=0, metavar="N", help=_HELP["refine"])
    g.add_argument("--repeat", type=int, default=1, metavar="N", help=_HELP["repeat"])
    g.add_argument("--stop-on-break", action="store_true", help="skip a target's higher levels once one breaks an SLO")
    g.add_argument("--start-together", action="store_true", help=_HELP["start_together"])
    g.add_argument("--seed", type=int, default=0, help="seeds sizes, think times and arrivals")
    g = parser.add_argument_group("SLOs and the fleet")
    g.add_argument("--slo", action="append", default=[], metavar="EXPR", help="an objective, e.g. 'ttft_p95<=1.0'")
    g.add_argument("--metrics-url", action="append", default=[], metavar="URL", help=_HELP["metrics_url"])
    g.add_argument("--admin-url", metavar="URL", help="read the fleet from fleetgate's GET /admin/fleet instead")
    g.add_argument("--admin-key", help="the admin API key for --admin-url")
    g = parser.add_argument_group("output")
    g.add_argument("--out", default="bench-results", type=Path, help="directory for the report (bench-results)")
    g.add_argument("--name", help="file stem of the report (default capacity-<profile>)")
    g.add_argument("--note", action="append", default=[], help="a line for the report's notes; repeatable")
    g.add_argument("--no-live", action="store_true", help="one line per point instead of the live display")
    g.add_argument("--from-json", type=Path, metavar="FILE", help=_HELP["from_json"])


async def _run_once(
    gen: LoadGenerator, target: Target, plan: PointPlan, source: FleetSource | None, view: LiveView
) -> PointRecord:
    progress = Progress()
    view.current = (target, plan, progress)
    fleet: dict[str, float | None] = dict.fromkeys(FLEET_METRICS)
    if source is None:
        result = await gen.run_point(target, plan, progress)
    else:
        async with FleetProbe(source, gen.session, clock=gen.clock) as probe:
            result = await gen.run_point(target, plan, progress)
        fleet = probe.window.summary(result.window_start, result.finished_at)
    view.current = None
    metrics = {**point_metrics(result.samples, result.window_s, result.window_tokens), **fleet}
    return PointRecord(target.name, plan.mode, plan.level, metrics, errors_by_kind(result.samples), result.samples)


def _merge(runs: list[PointRecord]) -> PointRecord:
    """Repeats of one point as one: the metrics' medians, every sample, errors added up."""
    if len(runs) == 1:
        return runs[0]
    first, errors = runs[0], error_totals(runs)
    samples = [s for run in runs for s in run.samples]
    metrics = median_metrics([r.metrics for r in runs])
    return PointRecord(first.target, first.mode, first.level, metrics, errors, samples, [r.metrics for r in runs])


async def _detect_model(target: Target) -> str:
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    async with aiohttp.ClientSession() as session:
        async with session.get(target.base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
            resp.raise_for_status()
            body = await resp.json()
    return str(body["data"][0]["id"])


async def _sweep(
    args: argparse.Namespace, sweep: SweepRecord, targets: list[Target], source: FleetSource | None
) -> None:
    from rich.console import Console
    from rich.live import Live

    console = Console(stderr=True)
    gen = LoadGenerator(sweep.workload, run_id=sweep.meta["run_id"])
    view = LiveView(sweep, console, gen.clock, args.time_scale)
    # Refreshed from the event loop, not rich's own thread: the counters it reads change on the loop.
    live = Live(view, console=console, auto_refresh=False) if not args.no_live else None

    async def refresh() -> None:
        while live is not None:
            live.refresh()
            await asyncio.sleep(LIVE_REFRESH_S)

    async def measure(chosen: list[Target], mode: Mode, level: float, turn: int) -> set[str]:
        """One level on every chosen target, ``--repeat`` times; returns the names that broke an SLO."""
        timing = (args.warmup, args.duration, args.time_scale, args.request_timeout, args.seed)
        plan = PointPlan(mode, level, *timing, ramp=not args.start_together)
        runs: dict[str, list[PointRecord]] = {t.name: [] for t in chosen}
        for repeat in range(args.repeat):
            # Alternate the order of the targets, so a machine whose load drifts (other work
            # starting or stopping) does not favour the one that always runs first.
            for target in chosen if (turn + repeat) % 2 == 0 else chosen[::-1]:
                runs[target.name].append(await _run_once(gen, target, plan, source, view))
        failed: set[str] = set()
        for name, records in runs.items():
            point = _merge(records)
            sweep.points.append(point)
            if live is None:
                console.print(" | ".join(point_row(point, sweep.slos)))
            if not judge(level, point.metrics, sweep.slos).passed:
                failed.add(name)
        return failed

    async with gen:
        refresher = None
        if live is not None:
            live.start()
            refresher = asyncio.create_task(refresh())
        try:
            sweeps: list[tuple[Mode, list[float] | None]] = [("closed", args.concurrency), ("open", args.rate)]
            for mode, levels in sweeps:
                broken: set[str] = set()
                for turn, level in enumerate(levels or ()):
                    failed = await measure([t for t in targets if t.name not in broken], mode, level, turn)
                    broken |= failed if args.stop_on_break else set()
                for _ in range(args.refine if levels else 0):
                    for target in targets:
                        extra = next_level(sweep.plan(target.name, mode), integer=mode == "closed")
                        if extra is not None:
                            await measure([target], mode, extra, 0)
        finally:
            if refresher is not None and live is not None:
                refresher.cancel()
                live.refresh()
                live.stop()


def _dry_run(workload: Workload, seed: int) -> int:
    from rich.console import Console
    from rich.table import Table

    sizes = request_sizes(workload, DRY_RUN_SESSIONS, random.Random(seed))
    table = Table(title=f"{workload.name}: prompt tokens per request ({DRY_RUN_SESSIONS} sampled sessions)")
    for col in ("class", "share", "requests", "min", "p5", "p50", "p95", "max"):
        table.add_column(col, justify="left" if col == "class" else "right")
    for c in workload.classes:
        v = sizes[c.name]
        cells = [f"{min(v):,}", *(f"{percentile(v, q):,.0f}" for q in (5, 50, 95)), f"{max(v):,}"] if v else ["-"] * 5
        table.add_row(c.name, f"{c.share:.0%}", str(len(v)), *cells)
    Console().print(table)
    return 0


_TIME_NOTE = (
    "the endpoint ran {x:g}x faster than real time (a simulator's --time-scale); measured durations were "
    "multiplied by {x:g}, so every figure is real-time-equivalent"
)


def _summary(args: argparse.Namespace, targets: list[Target], source: FleetSource | None) -> dict[str, str]:
    argv = sys.argv[sys.argv.index("bench") + 1 :] if "bench" in sys.argv else sys.argv[1:]
    mode = " and ".join(
        f"{kind} at {', '.join(f'{x:g}' for x in levels)} {MODE_UNITS[unit]}"
        for kind, unit, levels in (("closed loop", "closed", args.concurrency), ("open loop", "open", args.rate))
        if levels
    )
    start = "users start together" if args.start_together else "user starts spread over it"
    return {
        "Command": f"`fleetgate bench {shlex.join(argv)}`",
        "Targets": ", ".join(f"{t.name} = {t.base_url}" for t in targets) + f" (model `{targets[0].model}`)",
        "Load": f"{mode}; per point {args.warmup:g} s warm-up ({start}), then a {args.duration:g} s window: "
        "requests sent in the window are the samples, and the load stays on until they have finished",
        "Time": "real time" if args.time_scale == 1 else _TIME_NOTE.format(x=args.time_scale),
        "Fleet metrics": source.describe() if source else "none (no --metrics-url or --admin-url)",
        "SLOs": ", ".join(f"`{s}`" for s in args.slo) or "none",
    }


def _render(args: argparse.Namespace, slos: list[Slo]) -> int:
    sweep = from_json(args.from_json.read_bytes())
    sweep.slos = slos or sweep.slos
    sweep.meta["notes"] = [*sweep.meta.get("notes", []), *args.note]
    sweep.meta["show_reference"] = sweep.meta.get("show_reference") or args.reference
    paths = write_all(sweep, args.out, args.name or args.from_json.stem)
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``fleetgate bench``; returns the exit status (2 for bad arguments or profile)."""
    try:
        slos = [parse_slo(s) for s in args.slo]
        if args.from_json:
            return _render(args, slos)
        workload = load_workload(args.profile)
        if args.context_limit is not None:
            workload = workload.model_copy(update={"context_limit_tokens": args.context_limit})
    except (WorkloadError, SloError, OSError) as exc:
        print(f"fleetgate bench: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        return _dry_run(workload, args.seed)
    if not args.concurrency and not args.rate:
        print("fleetgate bench: give --concurrency and/or --rate (or --dry-run)", file=sys.stderr)
        return 2
    source: FleetSource | None = None
    if args.admin_url:
        if not args.admin_key:
            print("fleetgate bench: --admin-url needs --admin-key", file=sys.stderr)
            return 2
        source = AdminFleetSource(args.admin_url, args.admin_key)
    elif args.metrics_url:
        source = MetricsSource(tuple(args.metrics_url))
    if source is None and any(s.metric in FLEET_METRICS for s in slos):
        print("fleetgate bench: an SLO on fleet metrics needs --metrics-url or --admin-url", file=sys.stderr)
        return 2
    pairs = args.target or [("fleet", DEFAULT_TARGET)]
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names) or (args.baseline and args.baseline not in names):
        print(f"fleetgate bench: target names must be unique, --baseline one of them: {names}", file=sys.stderr)
        return 2
    import uvloop

    return uvloop.run(_main(args, workload, slos, pairs, source))


async def _main(
    args: argparse.Namespace,
    workload: Workload,
    slos: list[Slo],
    pairs: list[tuple[str, str]],
    source: FleetSource | None,
) -> int:
    model = args.model
    if model is None:
        try:
            model = await _detect_model(Target(pairs[0][0], pairs[0][1], "", args.api_key))
        except (aiohttp.ClientError, KeyError, IndexError, ValueError) as exc:
            print(f"fleetgate bench: cannot list the models of {pairs[0][1]} ({exc}); pass --model", file=sys.stderr)
            return 2
    targets = [Target(name, url, model, args.api_key) for name, url in pairs]
    run_id = secrets.token_hex(4)
    meta: dict[str, Any] = {
        "run_id": run_id,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "time_scale": args.time_scale,
        "seed": args.seed,
        "warmup_s": args.warmup,
        "duration_s": args.duration,
        "baseline": args.baseline,
        "repeat": args.repeat,
        "show_reference": args.reference,
        "summary": _summary(args, targets, source),
        "notes": list(args.note),
    }
    sweep = SweepRecord(meta, workload, slos, {t.name: t.base_url for t in targets})
    started = time.monotonic()
    try:
        await _sweep(args, sweep, targets, source)
    finally:
        # Whatever was measured is written, even when the run is interrupted.
        meta["wall_seconds"] = round(time.monotonic() - started, 1)
        if sweep.points:
            paths = write_all(sweep, args.out, args.name or f"capacity-{workload.name}")
            print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleetgate bench")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
