"""``bench/routing.py`` end to end on a very reduced configuration: real gateways, simulated replicas.

Two replicas per fleet, one rate per workload, one seed, a few seconds per point. The figures
are not judged (the machine is shared and the points are tiny); the records are checked for
shape and sanity: every point measured, rates and shares within their ranges, the fleet's
counters read, the report and plots written.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from bench.routing import BenchConfig, Experiment, FairPlan, Timing, run_config, with_fair_from, write_outputs
from bench.routing_fleet import POLICIES, runnable_policies
from bench.routing_metrics import FleetReading, is_good, read_fleet, request_metrics
from capacity.stats import RequestSample

pytestmark = pytest.mark.timeout(120)


def tiny_config() -> BenchConfig:
    # Two policies where the gateway lets us choose (the default and a baseline), else its only one.
    policies = runnable_policies((POLICIES[0], "round_robin"))
    return BenchConfig(
        experiments=(
            Experiment("chat", "routing-chat", "(1) chat", rates=(1.0,), prewarm_s=1.0),
            Experiment(
                "short_long",
                "routing-short-long",
                "(4) short/long",
                rates=(2.0,),
                background="long",
                background_lead_s=1.0,
            ),
        ),
        fair=FairPlan("routing-no-reuse", rate_a=0.5, rate_b=1.0, capacity=2.0),
        seeds=(1,),
        timing=Timing(warmup_s=1.0, duration_s=2.0, time_scale=1.0),
        policies=policies,
        replicas=2,
        nice=0,
    )


async def test_a_reduced_run_writes_sane_records(tmp_path: Path) -> None:
    config = tiny_config()
    doc = await run_config(config, tmp_path / "work", lambda line: None)
    paths = write_outputs(doc, tmp_path, "routing-test")

    points = doc["points"]
    assert len(points) == 2 * len(config.policies)  # two workloads x one rate x one seed
    for p in points:
        m = p["metrics"]
        assert m["requests"] > 0, p
        assert 0 <= m["goodput"] <= m["throughput"] <= m["requests"] / p["window_s"] + 1e-9
        assert 0 <= m["attainment"] <= m["completion"] <= 1
        assert m["ttft_p50"] is not None and 0 < m["ttft_p50"] <= m["ttft_p99"]
        assert m["hit_rate"] is not None and 0 <= m["hit_rate"] <= 1
        assert m["imbalance"] is not None and m["imbalance"] >= 1
        assert 0 <= m["idle_while_queued"] <= 1
        assert len(p["replicas"]["generated"]) == config.replicas
    # Workload (4) samples only its short requests; the long ones ran as background load.
    short_long = [p for p in points if p["experiment"] == "short_long"]
    assert all(p["metrics"].get("ttft_p99.short") is not None for p in short_long)
    assert all("ttft_p99.long" not in p["metrics"] for p in short_long)
    # Every request of (4) opens with the same system prompt: the replicas found it cached.
    assert all(p["metrics"]["hit_rate"] > 0 for p in short_long)

    fair = {(r["policy"], r["phase"]) for r in doc["fair"]}
    assert fair == {(p, ph) for p in config.fair_policies if p in config.policies for ph in ("alone", "flood")}
    assert all(r["flood"]["sent"] > 0 for r in doc["fair"] if r["phase"] == "flood")
    assert doc["meta"]["wall_s"] > 0 and doc["meta"]["cpu_s"]["fleets"] > 0

    names = {p.name for p in paths}
    assert {"routing-test.json", "routing-test.md", "routing-test-goodput.png", "routing-test-fair.png"} <= names
    assert orjson.loads((tmp_path / "routing-test.json").read_bytes())["config"]["replicas"] == 2
    report = (tmp_path / "routing-test.md").read_text()
    assert "## The bars" in report and "## Method" in report

    # A later fair-queue-only run's section replaces this one's, and the method says so.
    fair_run = {**doc, "meta": {**doc["meta"], "git": "f00dfee"}, "fair_pooled": []}
    merged = with_fair_from(doc, fair_run)
    assert merged["fair_pooled"] == [] and merged["points"] == doc["points"]
    assert merged["meta"]["git"] == doc["meta"]["git"] and merged["meta"]["fair_run"]["git"] == "f00dfee"
    write_outputs(merged, tmp_path, "routing-merged")
    assert (
        "separate run** (`bench/routing.py --fair-only`, commit `f00dfee`"
        in (tmp_path / "routing-merged.md").read_text()
    )


def test_a_good_request_meets_both_slos_itself() -> None:
    fast = RequestSample(0, "c", 0, 0, 0.0, ttft_s=0.5, gaps=[0.02] * 40)
    slow_start = RequestSample(0, "c", 0, 0, 0.0, ttft_s=1.5, gaps=[0.02] * 40)
    # 3 of 40 gaps (7.5%) over 100 ms puts this request's own p95 over the line.
    stalled = RequestSample(0, "c", 0, 0, 0.0, ttft_s=0.5, gaps=[0.02] * 37 + [0.3] * 3)
    failed = RequestSample(0, "c", 0, 0, 0.0, ttft_s=0.5, gaps=[0.02] * 40, error="timeout")
    assert [is_good(s) for s in (fast, slow_start, stalled, failed)] == [True, False, False, False]
    # Each miss is counted once, under its first reason; the failed request under neither.
    metrics = request_metrics([fast, slow_start, stalled, failed], window_s=2.0)
    assert (metrics["goodput"], metrics["attainment"]) == (0.5, 0.25)
    assert (metrics["ttft_miss"], metrics["itl_miss"], metrics["completion"]) == (0.25, 0.25, 0.75)


def test_fleet_reading_deltas_balance_and_idle_while_queued() -> None:
    def reps(hits: float, running: tuple[float, float], waiting: tuple[float, float]) -> list[dict[str, float]]:
        return [
            {
                "vllm:prefix_cache_queries_total": 100.0 * hits,
                "vllm:prefix_cache_hits_total": 50.0 * hits,
                "vllm:num_requests_running": running[i],
                "vllm:num_requests_waiting": waiting[i],
                "vllm:generation_tokens_total": 10.0 * hits * (i + 1),
            }
            for i in range(2)
        ]

    samples = [
        (0.0, reps(1, (0, 0), (0, 0))),  # before the window: the counters' baseline
        (1.0, reps(2, (0, 4), (0, 2))),  # replica 0 idle while replica 1 queues
        (2.0, reps(3, (2, 2), (0, 0))),
        (3.0, reps(4, (0, 0), (0, 0))),  # after the window
    ]
    reading = read_fleet(samples, 0.5, 2.5)
    assert isinstance(reading, FleetReading)
    # Queries 2 x 100 x (4 - 1), hits half of them.
    assert reading.queries == 600 and reading.hit_rate == 0.5
    assert reading.generated == (30.0, 60.0)
    assert reading.idle_while_queued == 0.5  # one of the two samples inside the window
    # Mean load: replica 0 (0 + 2) / 2 = 1, replica 1 (6 + 2) / 2 = 4; fleet mean 2.5.
    assert reading.imbalance == 4 / 2.5
