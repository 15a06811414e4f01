"""``fleetgate bench`` end to end against a real simulator process (the calibrated RTX 3060 profile).

The simulator runs 10x faster than real time so a sweep takes seconds; figures are only
checked for shape (the CPU is shared, absolute times are noisy), and the outputs (JSON with
every sample, the report, the plots) for content.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from capacity.cli import main
from capacity.loadgen import LoadGenerator, PointPlan, Target
from capacity.workload import load_workload
from replicas.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "qwen-sim"
TIME_SCALE = 10
READY_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def simulator() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sim.server",
            "--port",
            str(port),
            "--model",
            MODEL,
            "--profile",
            "rtx3060-qwen2.5-7b-awq",
            "--seed",
            "3",
            "--time-scale",
            str(TIME_SCALE),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"simulator did not start: {proc.stderr.read() if proc.stderr else b''!r}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_sweep_writes_the_answer_samples_report_and_plots(simulator: str, tmp_path: Path) -> None:
    status = main(
        [
            "--target",
            f"sim={simulator}",
            "--profile",
            "rtx3060-reproduction",
            "--concurrency",
            "1,8",
            "--rate",
            "2",
            "--warmup",
            "2",
            "--duration",
            "8",
            "--time-scale",
            str(TIME_SCALE),
            "--metrics-url",
            simulator,
            "--slo",
            "ttft_p95<=60",
            "--slo",
            "preemptions==0",
            "--slo",
            "per_user_tps>=1000",
            "--out",
            str(tmp_path),
            "--name",
            "sweep",
            "--no-live",
            "--reference",
        ]
    )
    assert status == 0
    doc = orjson.loads((tmp_path / "sweep.json").read_bytes())
    points = {(p["mode"], p["level"]): p for p in doc["points"]}
    assert set(points) == {("closed", 1.0), ("closed", 8.0), ("open", 2.0)}  # the model was detected
    one, eight = points[("closed", 1.0)], points[("closed", 8.0)]
    for p in doc["points"]:
        assert p["metrics"]["errors"] == 0, p["errors"]
        assert p["samples"], "every point has samples"
        assert all(s["completion_tokens"] == 200 for s in p["samples"])  # ignore_eos + max_tokens
        assert p["metrics"]["kv_peak"] is not None and p["metrics"]["preemptions"] == 0
    # Eight users share the card: several times the tokens in total, each at most one stream's
    # ~59 tok/s. (Loose bounds: at 10x a 0.1 s stall of a shared CPU reads as a 1 s one.)
    assert eight["metrics"]["total_tps"] > 2 * one["metrics"]["total_tps"]
    assert 0 < eight["metrics"]["per_user_tps"] < 80 and 0 < one["metrics"]["per_user_tps"] < 80
    # The shared system line is cached. Read on the second point: the first one starts on a
    # cold simulator, and on a slow start its short window can hold only cold requests
    # (it read 0.0 once, on a freshly installed checkout).
    assert eight["metrics"]["prefix_hit_rate"] > 0
    # 1,000 tok/s per user is out of reach: nothing meets every SLO, and that SLO is named.
    plan = doc["plans"]["sim/closed"]
    assert plan["capacity"] is None and plan["first_failure"] == 1.0
    assert [b["slo"] for b in plan["broken_first"]] == ["per_user_tps>=1000"]
    report = (tmp_path / "sweep.md").read_text()
    assert "it breaks first on `per_user_tps`" in report
    assert "published vs measured" in report
    for name in ("sweep-latency.png", "sweep-throughput.png", "sweep-fleet.png", "sweep-open-latency.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
    # The same run judged again without the unreachable SLO: nothing is sent, both levels pass.
    again = ["--from-json", str(tmp_path / "sweep.json"), "--slo", "ttft_p95<=60", "--out", str(tmp_path)]
    assert main([*again, "--name", "again", "--note", "re-rendered"]) == 0
    redone = orjson.loads((tmp_path / "again.json").read_bytes())
    assert redone["plans"]["sim/closed"]["capacity"] == 8.0
    assert len(redone["points"]) == 3 and "re-rendered" in (tmp_path / "again.md").read_text()


async def test_errors_are_counted_by_kind(simulator: str) -> None:
    workload = load_workload("rtx3060-reproduction")
    plan = PointPlan("closed", 2, warmup_s=0.0, duration_s=2.0, time_scale=TIME_SCALE)
    async with LoadGenerator(workload) as gen:
        wrong_model = await gen.run_point(Target("sim", simulator, "no-such-model"), plan)
        closed_port = await gen.run_point(Target("gone", f"http://127.0.0.1:{free_port()}", MODEL), plan)
    assert wrong_model.samples and {s.error for s in wrong_model.samples} == {"http_404"}
    assert closed_port.samples and {s.error for s in closed_port.samples} == {"connect"}


def test_bad_profile_and_slo_exit_with_a_clear_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nclasses:\n  - {name: a, share: 1, prompt_tokens: 5, output_tokens: 5, turnz: 2}\n")
    assert main(["--profile", str(bad), "--concurrency", "1"]) == 2
    assert "classes[0].turnz: Extra inputs are not permitted" in capsys.readouterr().err
    assert main(["--profile", "chat-assistant", "--concurrency", "1", "--slo", "ttft<=1"]) == 2
    assert "unknown metric 'ttft'" in capsys.readouterr().err
    assert main(["--profile", "chat-assistant", "--concurrency", "1", "--slo", "kv_peak<=0.9"]) == 2
    assert "needs --metrics-url or --admin-url" in capsys.readouterr().err
