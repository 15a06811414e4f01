"""LoRA adapters on real CPU vLLM, through a real ``fleetgate serve``.

Two managed vLLM replicas of the tiny model, each pinned to its own core: ``tiny-0`` with
LoRA enabled and run-time loading allowed but no adapter, ``tiny-1`` started with the
adapter ``tiny-lora`` (``--lora-modules``). Requests for ``tiny-lora`` must all reach
``tiny-1``: the gateway's header says so, and ``tiny-0``'s own prompt-token counter must not
move while they run. ``tiny-lora-2``, configured with a path and served by nobody, is loaded
at run time on the least loaded replica (``tiny-0``, both idle: the first) and then served
there. The adapters are written by ``scripts/build_tiny_lora.py`` (PEFT's format, ~16 KiB).

Run alone, under the machine's vLLM lock: ``flock /tmp/vllm.lock .venv/bin/pytest -q tests/e2e/test_vllm_lora.py``.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import (
    FLEET_START_TIMEOUT_S,
    MODEL,
    ROOT,
    E2EGateway,
    gateway_config,
    record_timing,
    run_dir,
    start_gateway,
    stop_gateway,
    vllm_replica,
)
from tests.integration.harness import API_KEY

LORA = "tiny-lora"
RUNTIME_LORA = "tiny-lora-2"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# The adapters' rank is 8: vLLM reserves LoRA memory for --max-lora-rank (16 by default).
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "8"]


def build_adapter(vllm_python: Path, model: Path, name: str) -> Path:
    out = ROOT / ".cache" / name
    build = subprocess.run(
        [str(vllm_python), str(ROOT / "scripts" / "build_tiny_lora.py"), "--model", str(model), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    if build.returncode != 0:
        pytest.fail(f"scripts/build_tiny_lora.py failed:\n{build.stderr[-3000:]}", pytrace=False)
    return Path(build.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def lora_fleet(vllm_python: Path, tiny_model: Path) -> Iterator[E2EGateway]:
    start = time.monotonic()
    lora = build_adapter(vllm_python, tiny_model, LORA)
    runtime_lora = build_adapter(vllm_python, tiny_model, RUNTIME_LORA)
    record_timing("lora: two adapters built", time.monotonic() - start)
    loads = vllm_replica(tiny_model, core=0)
    loads["args"] = [*loads["args"], *LORA_ARGS]
    loads["env"] = {**loads["env"], "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    serves = vllm_replica(tiny_model, core=1)
    serves["args"] = [*serves["args"], *LORA_ARGS, "--lora-modules", f"{LORA}={lora}"]
    config = gateway_config([loads, serves])
    config["models"][0]["adapters"] = [{"name": LORA}, {"name": RUNTIME_LORA, "path": str(runtime_lora)}]
    config["health"]["adapters_interval_s"] = 1.0
    e2e, elapsed = start_gateway(config, run_dir("lora"), FLEET_START_TIMEOUT_S, every=True)
    record_timing("lora fleet start: two vLLM replicas with LoRA healthy", elapsed)
    try:
        yield e2e
    finally:
        stop_gateway(e2e, signal.SIGTERM)


async def chat(http: httpx.AsyncClient, model: str, stream: bool, i: int) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Question {i}: what is in the licence?"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
    }
    return await http.post("/v1/chat/completions", json=body, headers=AUTH)


def prompt_tokens(fleet: dict[str, dict[str, Any]], replica: str) -> float:
    return float(fleet[replica]["gauges"].get("vllm:prompt_tokens_total", 0.0))


async def test_lora_requests_reach_only_the_replica_with_the_adapter(lora_fleet: E2EGateway) -> None:
    e2e = lora_fleet
    await e2e.wait_fleet(lambda f: f["tiny-1"]["adapters"] == [LORA], 30, "tiny-1 to list its adapter")
    async with httpx.AsyncClient(base_url=e2e.url, timeout=120) as http:
        listing = (await http.get("/v1/models", headers=AUTH)).json()["data"]
        parents = {m["id"]: m.get("parent") for m in listing}
        assert parents[LORA] == MODEL and parents[MODEL] is None

        _, before = await e2e.wait_fleet(lambda f: "vllm:prompt_tokens_total" in f["tiny-0"]["gauges"], 30, "a scrape")
        idle_tokens = prompt_tokens(before, "tiny-0")
        started = time.monotonic()
        replies = await asyncio.gather(*(chat(http, LORA, i % 2 == 1, i) for i in range(16)))
        record_timing("lora: 16 adapter requests", time.monotonic() - started)
        assert [r.status_code for r in replies] == [200] * 16, [r.text[:200] for r in replies]
        assert {r.headers["x-fleetgate-replica"] for r in replies} == {"tiny-1"}
        assert all(r.json()["model"] == LORA for r in replies[::2])  # vLLM answered as the adapter
        # tiny-0's own count of prompt tokens did not move (two scrapes later): none reached it.
        await asyncio.sleep(2.5)
        after = await e2e.fleet()
        assert prompt_tokens(after, "tiny-0") == idle_tokens
        assert prompt_tokens(after, "tiny-1") > prompt_tokens(before, "tiny-1")

        # The base model still spreads over both replicas.
        plain = await asyncio.gather(*(chat(http, MODEL, False, i) for i in range(8)))
        assert {r.status_code for r in plain} == {200}
        assert {r.headers["x-fleetgate-replica"] for r in plain} == {"tiny-0", "tiny-1"}
        adapted, base = replies[0].json(), plain[0].json()
        print(
            f"same prompt, greedy: base {base['choices'][0]['message']['content']!r}, "
            f"{LORA} {adapted['choices'][0]['message']['content']!r}"
        )


async def test_an_adapter_no_replica_serves_is_loaded_at_run_time(lora_fleet: E2EGateway) -> None:
    e2e = lora_fleet
    # Both idle (as the last scrape saw them): the load goes to the first, tiny-0.
    await e2e.wait_fleet(
        lambda f: all(r["outstanding_requests"] == 0 and r["foreign_requests"] == 0 for r in f.values()),
        30,
        "an idle fleet",
    )
    async with httpx.AsyncClient(base_url=e2e.url, timeout=120) as http:
        started = time.monotonic()
        replies = await asyncio.gather(*(chat(http, RUNTIME_LORA, False, i) for i in range(4)))
        record_timing("lora: run-time load and first 4 requests", time.monotonic() - started)
        assert [r.status_code for r in replies] == [200] * 4, [r.text[:300] for r in replies]
        assert {r.headers["x-fleetgate-replica"] for r in replies} == {"tiny-0"}
        assert {r.json()["model"] for r in replies} == {RUNTIME_LORA}
        # vLLM lists it now, with its parent; the gateway's listing reads the same.
        await e2e.wait_fleet(lambda f: RUNTIME_LORA in f["tiny-0"]["adapters"], 30, "tiny-0 to list the loaded one")
        replica_url = (await e2e.fleet())["tiny-0"]["url"]
        listed = (await http.get(f"{replica_url}/v1/models")).json()["data"]
        assert {m["id"]: m["parent"] for m in listed}[RUNTIME_LORA] == MODEL
        loaded = [r for r in e2e.log_records() if r.get("msg") == "adapter loaded"]
        assert [(r["adapter"], r["replica"]) for r in loaded] == [(RUNTIME_LORA, "tiny-0")]
        record_timing("lora: vLLM's load_lora_adapter (as the gateway timed it)", float(loaded[0]["load_s"]))
