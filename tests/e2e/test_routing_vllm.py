"""The real-vLLM routing benchmark (``bench/routing_vllm.py``), shortened: prefix affinity keeps more cached.

Two CPU vLLM replicas, started by the gateway's launcher with a KV cache of 60% of the
workload's system prompts, behind ``fleetgate serve``; vLLM's own prefix-cache counters
judge. The full benchmark (three prompt sets, 400 requests a row, every row) is its own
command; this runs one prompt set of a few dozen requests through the default policy and
round robin.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from bench.routing_vllm import BenchConfig, run_engine
from tests.e2e.conftest import record_timing

pytestmark = pytest.mark.e2e

SMOKE = BenchConfig(
    engine="vllm",
    prompts=12,
    prompt_tokens=700,
    requests=60,
    concurrency=4,
    seeds=(1,),
    rows=("prefix_affinity", "round_robin"),
)


def test_prefix_affinity_keeps_more_of_the_prompts_cached_than_round_robin(tiny_model: Path) -> None:
    start = time.monotonic()
    run = asyncio.run(run_engine(SMOKE, print))
    record_timing("routing benchmark on vLLM, shortened", time.monotonic() - start)
    rows = {r.row: r for r in run["_results"]}
    affinity, round_robin = rows["prefix_affinity"], rows["round_robin"]
    assert affinity.errors == 0 and round_robin.errors == 0
    assert len(affinity.ttft_s) == len(round_robin.ttft_s) == SMOKE.requests
    # vLLM publishes its cache's size; the gateway's prefix index reads it from there.
    assert run["kv_capacity_tokens_scraped"] == [run["blocks_per_replica"] * 128] * 2
    assert affinity.hit_rate > round_robin.hit_rate + 0.05, (affinity.hit_rate, round_robin.hit_rate)
