"""The asyncio driver of the batching model, run much faster than real time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from sim.batched_engine import BatchedSimEngine
from sim.engine import SimRequest, SimStream, count_tokens

QWEN = "rtx3060-qwen2.5-7b-awq"
FAST = 1000.0  # a 17 ms step takes 17 us


async def collect(stream: SimStream) -> list[str]:
    return [piece async for piece in stream]


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``condition`` every millisecond (the engine has no event for it)."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.001)


async def test_tokens_arrive_with_usage_and_finish_reason() -> None:
    engine = BatchedSimEngine.from_profile(QWEN, seed=1, time_scale=FAST)
    prompt = "Explain continuous batching. " * 4
    stream = engine.submit(SimRequest("a", prompt, max_tokens=20))
    pieces = await collect(stream)
    assert len(pieces) == 20 and not pieces[0].startswith(" ") and pieces[1].startswith(" ")
    assert stream.prompt_tokens == count_tokens(prompt)
    assert (stream.completion_tokens, stream.finish_reason) == (20, "length")
    gauges = engine.gauges()
    assert gauges["vllm:generation_tokens_total"] == 20.0
    assert gauges["vllm:prompt_tokens_total"] == float(count_tokens(prompt))
    await engine.close()


async def test_many_concurrent_streams_all_complete_and_queue_past_max_num_seqs() -> None:
    engine = BatchedSimEngine.from_profile(QWEN, seed=1, time_scale=100.0)
    streams = [engine.submit(SimRequest(f"r{i}", f"question {i} " * 10, max_tokens=30)) for i in range(120)]
    tasks = [asyncio.create_task(collect(s)) for s in streams[:95] + streams[96:]]
    # 96 prompts of 30 tokens fill two 2,048-token prefill chunks: r95's first token comes out
    # of the second step, with every one of the first 96 running.
    last_admitted = aiter(streams[95])
    first_piece = await anext(last_admitted)
    gauges = engine.gauges()
    assert gauges["vllm:num_requests_running"] == 96.0  # the profile's max_num_seqs
    assert gauges["vllm:num_requests_waiting"] == 24.0
    assert gauges["vllm:kv_cache_usage_perc"] > 0.0
    results = [*await asyncio.gather(*tasks), [first_piece] + [p async for p in last_admitted]]
    assert all(len(r) == 30 for r in results)
    assert engine.gauges()["vllm:num_requests_running"] == 0.0
    assert engine.gauges()["vllm:kv_cache_usage_perc"] == 0.0
    await engine.close()


async def test_cancel_frees_the_slot_and_the_kv_blocks() -> None:
    engine = BatchedSimEngine.from_profile(QWEN, seed=1, time_scale=FAST)
    stream = engine.submit(SimRequest("a", "x" * 4000, max_tokens=5000))
    pieces = []
    async for piece in stream:
        pieces.append(piece)
        if len(pieces) == 3:
            break
    assert engine.gauges()["vllm:num_requests_running"] == 1.0
    assert engine.gauges()["vllm:kv_cache_usage_perc"] > 0.0
    stream.cancel()  # the client left
    assert engine.gauges()["vllm:num_requests_running"] == 0.0
    assert engine.gauges()["vllm:kv_cache_usage_perc"] == 0.0
    assert stream.finish_reason == "abort"
    stream.cancel()  # idempotent: the server also calls it in a finally
    await engine.close()


async def test_cancel_before_admission_never_reaches_the_scheduler() -> None:
    engine = BatchedSimEngine.from_profile(QWEN, seed=1, time_scale=1.0)  # 5 ms API latency
    stream = engine.submit(SimRequest("a", "hello", max_tokens=10))
    stream.cancel()
    await asyncio.sleep(0.01)
    assert engine.gauges()["vllm:num_requests_running"] == 0.0
    assert await collect(stream) == []
    await engine.close()


async def test_prefix_cache_counters_move_for_a_repeated_system_prompt() -> None:
    engine = BatchedSimEngine.from_profile(QWEN, seed=1, time_scale=FAST)
    system = "You are a careful assistant. " * 20  # 580 characters: 145 tokens, 9 full blocks
    await collect(engine.submit(SimRequest("a", system + "first?", max_tokens=2)))
    await collect(engine.submit(SimRequest("b", system + "second?", max_tokens=2)))
    gauges = engine.gauges()
    assert gauges["vllm:prefix_cache_hits_total"] == 9 * 16
    assert gauges["vllm:prefix_cache_queries_total"] == count_tokens(system + "first?") + count_tokens(
        system + "second?"
    )
    await engine.close()


async def test_the_same_seed_streams_the_same_text() -> None:
    async def text(seed: int) -> str:
        engine = BatchedSimEngine.from_profile(QWEN, seed=seed, time_scale=FAST)
        out = "".join(await collect(engine.submit(SimRequest("a", "same prompt", max_tokens=15))))
        await engine.close()
        return out

    assert await text(5) == await text(5)


async def test_idle_engine_does_not_step() -> None:
    engine = BatchedSimEngine.from_profile(QWEN, seed=1, time_scale=FAST)
    await collect(engine.submit(SimRequest("a", "hi", max_tokens=3)))
    steps = engine.steps_run
    await asyncio.sleep(0.05)
    assert engine.steps_run == steps
    await engine.close()


async def test_close_aborts_open_streams_and_refuses_new_ones() -> None:
    engine = BatchedSimEngine.from_profile(QWEN, seed=1, time_scale=10.0)
    stream = engine.submit(SimRequest("a", "hi", max_tokens=10_000))
    await asyncio.sleep(0.01)
    await engine.close()
    await collect(stream)
    assert stream.finish_reason == "abort"
    with pytest.raises(RuntimeError):
        engine.submit(SimRequest("b", "hi", max_tokens=1))


async def test_a_prompt_over_the_context_window_is_refused() -> None:
    engine = BatchedSimEngine.from_profile("rtx3060-llama-2-7b-gptq", seed=1, time_scale=FAST)
    with pytest.raises(ValueError, match="maximum context length is 4096"):
        engine.submit(SimRequest("a", "x" * 4 * 4096, max_tokens=1))
    await engine.close()


async def test_gauges_report_the_queues_as_the_last_step_left_them() -> None:
    """As in vLLM, a request that arrives during a step is not reported waiting: it joins the
    scheduler after the step, and the gauges move when a step ends."""
    engine = BatchedSimEngine.from_profile(QWEN, seed=1, time_scale=1.0)  # real time: a 2k prefill ~1 s
    first = engine.submit(SimRequest("a", "x" * 8000, max_tokens=3))
    await until(lambda: engine.model.num_running == 1)  # its prefill step has started
    second = engine.submit(SimRequest("b", "short question", max_tokens=3))
    await until(lambda: engine.model.num_waiting == 1)  # past the API-server latency, in the scheduler

    def reported() -> tuple[float, float]:
        gauges = engine.gauges()
        return gauges["vllm:num_requests_running"], gauges["vllm:num_requests_waiting"]

    assert reported() == (0.0, 0.0)  # the first step has not ended
    a, b = aiter(first), aiter(second)
    await anext(a)  # the prefill step ended: "a" running; "b" arrived during it, not reported
    assert reported() == (1.0, 0.0)
    await anext(b)  # the next step took "b" in
    assert reported() == (2.0, 0.0)
    assert len([p async for p in a]) == 2 and len([p async for p in b]) == 2
    assert reported() == (0.0, 0.0)
    await engine.close()


async def test_gauges_empty_after_the_last_request_is_cancelled_during_its_step() -> None:
    engine = BatchedSimEngine.from_profile(QWEN, seed=1, time_scale=1.0)
    stream = engine.submit(SimRequest("a", "x" * 4000, max_tokens=50))
    pieces = aiter(stream)
    await anext(pieces)  # prefilled: reported running
    assert engine.gauges()["vllm:num_requests_running"] == 1.0
    await until(lambda: engine.steps_run >= 3)
    stream.cancel()  # mid-step: the step's own report, published after it, still counts it
    await until(lambda: engine.steps_run >= 4 or not engine.model.has_work)
    await asyncio.sleep(0.2)  # past the end of the step that was running
    gauges = engine.gauges()
    assert (gauges["vllm:num_requests_running"], gauges["vllm:num_requests_waiting"]) == (0.0, 0.0)
    await engine.close()
