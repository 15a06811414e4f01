"""What tracing costs: fleetgate before tracing existed, with it off (the default), and on.

One command (needs `nginx`, `wrk` and `taskset`)::

    .venv/bin/python bench/tracing_overhead.py [--duration 10] [--rounds 3]

Method (bench/overhead.py's setup, all in one run so the ratios hold on a noisy machine):
- core 0: three gateways, started once, only the one under load busy: `base` (this
  repository at `--base`, default where this branch left `main`: the code without
  traceparent and spans), `off`
  (this tree, no OTLP endpoint: the default), `on` (this tree, `OTEL_EXPORTER_OTLP_ENDPOINT`
  set: every request continues a sampled client trace and exports its spans);
- core 1: nginx (one worker) answering a fixed chat completion and, for `on`, accepting
  the OTLP/HTTP span exports; wrk, keep-alive, POST /v1/chat/completions with a small body
  and a sampled `traceparent`, at concurrency 1 and 32, `--duration` s per point;
- each point runs `--rounds` times, the three gateways alternating; ratios are taken per
  round and their medians reported.

Writes bench/results/tracing-overhead.md (and .json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import yaml

# Run as a script, this file's directory would shadow the top-level packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.overhead import BODY, WrkResult, gateway_config, nginx_conf, process, wait_http, wrk
from replicas.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PY = sys.executable
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
SYSTEMS = ("base", "off", "on")


def base_tree(ref: str, tmp: Path) -> Path:
    """The repository at ``ref``, unpacked (git archive: the repository is not touched)."""
    out = tmp / "base"
    out.mkdir()
    archive = tmp / "base.tar"
    subprocess.run(["git", "archive", "--format=tar", "-o", str(archive), ref], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    return out


def sink_conf(tmp: Path, port: int) -> Path:
    """bench/overhead.py's nginx, plus a sink for OTLP/HTTP span exports."""
    conf = nginx_conf(tmp, port)
    text = conf.read_text().replace(
        "    location = /health", "    location = /v1/traces { return 200 ''; }\n    location = /health"
    )
    conf.write_text(text)
    return conf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--base", default=None, help="git ref of the code before tracing (default: where this branch left main)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "tracing-overhead.md")
    args = parser.parse_args()
    for tool in ("nginx", "wrk", "taskset", "git"):
        if shutil.which(tool) is None:
            print(f"needs `{tool}` (apt-get install nginx-light wrk)", file=sys.stderr)
            return 2
    tmp = Path(tempfile.mkdtemp(prefix="fleetgate-tracing-bench-"))
    (tmp / "body").mkdir()
    script = tmp / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = '{json.dumps(BODY, separators=(',', ':'))}'\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        'wrk.headers["Authorization"] = "Bearer sk-bench"\n'
        f'wrk.headers["traceparent"] = "{TRACEPARENT}"\n'
    )
    if args.base is None:
        merge_base = ["git", "merge-base", "main", "HEAD"]
        args.base = subprocess.run(merge_base, cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    base = base_tree(args.base, tmp)
    p_nginx = free_port()
    upstream = f"http://127.0.0.1:{p_nginx}"
    runs: dict[str, dict[int, list[WrkResult]]] = {s: {1: [], 32: []} for s in SYSTEMS}
    with contextlib.ExitStack() as stack:
        stack.enter_context(process(["nginx", "-c", str(sink_conf(tmp, p_nginx))], 1, tmp / "nginx.log"))
        wait_http(f"{upstream}/health")
        urls = {}
        for name in SYSTEMS:
            port = free_port()
            cfg = tmp / f"{name}.yaml"
            cfg.write_text(yaml.safe_dump(gateway_config(port, upstream, upstream, upstream)))
            env = {"OTEL_EXPORTER_OTLP_ENDPOINT": upstream} if name == "on" else {}
            if name == "base":
                env["PYTHONPATH"] = str(base)
            argv = [PY, "-m", "gateway.cli", "serve", "--config", str(cfg), "--log-dir", str(tmp / f"logs-{name}")]
            cwd_argv = ["env", "-C", str(base if name == "base" else ROOT), *argv]
            stack.enter_context(process(cwd_argv, 0, tmp / f"{name}.log", env))
            urls[name] = f"http://127.0.0.1:{port}"
        for url in urls.values():
            wait_http(f"{url}/readyz")
            wrk(f"{url}/v1/chat/completions", 32, 2, script)  # warm-up
        time.sleep(1.0)
        for conc in (1, 32):
            for r in range(args.rounds):
                for name, url in urls.items():
                    runs[name][conc].append(wrk(f"{url}/v1/chat/completions", conc, args.duration, script))
                print(f"c={conc} round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        on_log = (tmp / "on.log").read_text()
    ratios = {
        f"{a}/{b} rps c={c}": statistics.median(x.rps / y.rps for x, y in zip(runs[a][c], runs[b][c], strict=True))
        for a, b in (("off", "base"), ("on", "off"))
        for c in (1, 32)
    }
    results = {
        "duration_s": args.duration,
        "rounds": args.rounds,
        "base": args.base,
        "runs": {s: {c: [vars(r) for r in rs] for c, rs in v.items()} for s, v in runs.items()},
        "ratios": ratios,
        "export_errors_logged": on_log.count("Failed to export"),
    }
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    args.out.write_text(report(args, runs, ratios, results["export_errors_logged"]))
    print(args.out.read_text())
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def report(
    args: argparse.Namespace, runs: dict[str, dict[int, list[WrkResult]]], ratios: dict[str, float], errors: object
) -> str:
    def med(name: str, conc: int, key: str) -> float:
        return float(statistics.median(getattr(r, key) for r in runs[name][conc]))

    lines = [
        "# Tracing overhead",
        "",
        f"Generated by `.venv/bin/python bench/tracing_overhead.py --duration {args.duration} --rounds {args.rounds}`"
        f" on {os.cpu_count()} shared cores. Method in the script's docstring: `base` is the code at"
        f" `{args.base}` (no traceparent, no spans), `off` this tree with tracing off (the default), `on` with"
        " `OTEL_EXPORTER_OTLP_ENDPOINT` set and every request in a sampled trace (7+ spans exported per request).",
        "",
        "| gateway | c=1 req/s | c=1 p50 ms | c=1 p99 ms | c=32 req/s | c=32 p50 ms | c=32 p99 ms | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in SYSTEMS:
        errs = sum(r.errors for c in (1, 32) for r in runs[name][c])
        lines.append(
            f"| {name} | {med(name, 1, 'rps'):,.0f} | {med(name, 1, 'p50_ms'):.2f} | {med(name, 1, 'p99_ms'):.2f} "
            f"| {med(name, 32, 'rps'):,.0f} | {med(name, 32, 'p50_ms'):.2f} | {med(name, 32, 'p99_ms'):.2f} | {errs} |"
        )
    lines += ["", "Medians of the per-round ratios of requests/s:", ""]
    lines += [f"- {k}: {v:.3f}" for k, v in ratios.items()]
    lines += ["", f"Span export failures logged by the `on` gateway: {errors}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
