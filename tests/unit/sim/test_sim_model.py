"""The pure engine model: blocks, prefix cache, LRU eviction, preemption, counters, determinism."""

from __future__ import annotations

import random

import pytest

from sim.engine import count_tokens
from sim.model import EngineModel, StepResult, block_hashes, prompt_token_ids
from sim.profiles import (
    PROFILES,
    Efficiency,
    GpuSpec,
    ModelSpec,
    SimProfile,
    StepCoefficients,
    get_profile,
)

# A model whose KV costs 2 x 1 layer x 1 head x 8 dims x 2 bytes = 32 bytes per token,
# so a 16-token block is 512 bytes and the GPU's memory sets the block count exactly.
BLOCK_BYTES = 512


def tiny_profile(num_blocks: int = 8, max_num_seqs: int = 4, budget: int = 256, jitter: float = 0.0) -> SimProfile:
    model = ModelSpec(
        name="tiny",
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        hidden_size=8,
        weight_bytes=0,
        streamed_weight_bytes=1_000_000,
        matmul_params=1_000,
        max_model_len=4096,
    )
    gpu = GpuSpec(name="tiny", memory_bytes=num_blocks * BLOCK_BYTES, bandwidth_bytes_s=1e9, tensor_flops=1e9)
    eff = Efficiency(
        bandwidth=1.0,
        flops=1.0,
        step_overhead_s=1e-3,
        per_seq_overhead_s=0.0,
        frontend_latency_s=0.0,
        step_jitter=jitter,
    )
    return SimProfile(
        name="tiny",
        gpu=gpu,
        model=model,
        efficiency=eff,
        activation_reserve_bytes=0,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        gpu_memory_utilization=1.0,
    )


def run_until_idle(model: EngineModel, limit: int = 10_000) -> list[StepResult]:
    results: list[StepResult] = []
    while model.has_work and len(results) < limit:
        results.append(model.step())
    return results


def test_kv_bytes_per_token_is_two_x_layers_x_kv_heads_x_head_dim_x_dtype() -> None:
    assert get_profile("rtx3060-qwen2.5-7b-awq").model.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2  # 56 KiB
    assert get_profile("rtx3060-llama-2-7b-gptq").model.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2  # 512 KiB
    assert get_profile("h100x4-llama-3.1-70b").model.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2


def test_llama2_pool_on_a_3060_holds_about_13200_tokens() -> None:
    profile = get_profile("rtx3060-llama-2-7b-gptq")
    pool = 12_630_000_000 * 0.9 - 3_890_000_000 - 550_000_000  # memory x utilisation - weights - reserve
    assert profile.num_blocks == int(pool // (524_288 * 16)) == 825
    assert profile.kv_capacity_tokens == 13_200


def test_tensor_parallel_splits_weights_and_kv_heads_across_ranks() -> None:
    profile = get_profile("h100x4-llama-3.1-70b")
    pool_per_gpu = 85_000_000_000 * 0.9 - 141_100_000_000 / 4 - 4_000_000_000
    assert profile.num_blocks == int(pool_per_gpu // (327_680 / 4 * 16))


def test_every_named_profile_is_registered_and_sane() -> None:
    for name in (
        "h100-llama-3.1-8b",
        "a100-llama-3.1-8b",
        "h100x4-llama-3.1-70b",
        "a100x4-llama-3.1-70b",
        "h100-qwen2.5-7b",
        "a100-qwen2.5-7b",
        "rtx3060-qwen2.5-7b-awq",
        "rtx3060-llama-2-7b-gptq",
    ):
        profile = PROFILES[name]
        assert profile.kv_capacity_tokens >= profile.max_model_len > 0
    with pytest.raises(ValueError, match="known"):
        get_profile("tpu-v5")


def test_step_time_is_overheads_plus_a_p_norm_of_memory_and_compute() -> None:
    coeff = StepCoefficients(
        fixed_s=0.001,
        per_seq_s=0.0001,
        weights_s=0.003,
        kv_read_s_per_token=1e-6,
        matmul_s_per_token=1e-4,
        attention_s_per_pair=0.0,
        all_reduce_s=0.0005,
        all_reduce_s_per_token=0.0,
        sharpness=2.0,
    )
    # memory 0.003 + 1000 x 1e-6 = 0.004; compute 30 x 1e-4 = 0.003; p-norm = 0.005
    assert coeff.seconds(num_seqs=10, num_tokens=30, kv_read_tokens=1000, attention_pairs=0.0) == pytest.approx(
        0.001 + 10 * 0.0001 + 0.005 + 0.0005
    )
    assert coeff.seconds(0, 0, 0, 0.0) == 0.0


def test_token_ids_count_like_the_simulator_tokenizer_and_share_prefixes() -> None:
    for text in ("", "abc", "abcd", "abcde", "x" * 1001):
        assert len(prompt_token_ids(text)) == count_tokens(text)
    a = prompt_token_ids("s" * 64 + "question one, asked first")
    b = prompt_token_ids("s" * 64 + "another question, asked next")
    assert a[:16] == b[:16] and a[16:] != b[16:]
    assert block_hashes(a, 4)[:4] == block_hashes(b, 4)[:4]
    assert block_hashes(a, 4)[4] != block_hashes(b, 4)[4]


def test_prefill_then_decode_takes_a_new_block_every_16_tokens() -> None:
    model = EngineModel(tiny_profile(num_blocks=8), random.Random(0))
    model.add_request("a", list(range(40)), max_tokens=20)
    first = model.step()
    assert first.events[0].position == 0 and first.num_scheduled_tokens == 40
    assert model.pool.num_free == 8 - 3  # ceil(40 / 16)
    for _ in range(8):  # computes tokens 41..48: still three blocks
        model.step()
    assert model.pool.num_free == 5
    model.step()  # token 49 needs a fourth block
    assert model.pool.num_free == 4


def test_prefix_cache_hits_are_full_blocks_counted_in_tokens() -> None:
    model = EngineModel(tiny_profile(num_blocks=32), random.Random(0))
    model.add_request("a", list(range(100)), max_tokens=1)
    run_until_idle(model)
    model.add_request("b", list(range(70)) + [999] * 30, max_tokens=1)
    run_until_idle(model)
    # 70 shared tokens = 4 full blocks = 64 tokens from cache; queries count every prompt token.
    assert model.counters.prefix_cache_queries_total == 100 + 100
    assert model.counters.prefix_cache_hits_total == 64


def test_a_fully_cached_prompt_still_recomputes_its_last_token() -> None:
    model = EngineModel(tiny_profile(num_blocks=32), random.Random(0))
    model.add_request("a", list(range(64)), max_tokens=1)
    run_until_idle(model)
    model.add_request("b", list(range(64)), max_tokens=1)
    result = model.step()
    assert model.counters.prefix_cache_hits_total == 48  # (64 - 1) // 16 blocks
    assert result.num_scheduled_tokens == 16


def test_lru_evicts_the_least_recently_freed_block_and_a_sequence_tail_first() -> None:
    model = EngineModel(tiny_profile(num_blocks=8), random.Random(0))
    model.add_request("a", list(range(32)), max_tokens=1)  # blocks 0, 1; freed tail first
    run_until_idle(model)
    model.add_request("b", list(range(1000, 1112)), max_tokens=1)  # 7 blocks: 6 never used + a's tail
    run_until_idle(model)
    model.add_request("c", list(range(32)) + list(range(2000, 2016)), max_tokens=1)
    run_until_idle(model)
    assert model.counters.prefix_cache_hits_total == 16  # a's first block survived, its second did not


def test_the_youngest_running_request_is_preempted_and_resumes_where_it_was() -> None:
    model = EngineModel(tiny_profile(num_blocks=4), random.Random(0))
    model.add_request("old", list(range(24)), max_tokens=12)
    model.add_request("young", list(range(100, 124)), max_tokens=12)
    results = run_until_idle(model)
    preempted = [r for r in results if r.preempted]
    # Both hold 2 blocks; when "old" computes its 33rd token it needs a third: "young" goes.
    assert preempted[0].preempted == ["young"]
    assert model.counters.num_preemptions_total >= 1
    indices = [e.position for r in results for e in r.events if e.request_id == "young"]
    assert indices == list(range(12))  # recomputed, not restarted: no token produced twice
    assert model.pool.num_free == 4


def test_max_num_seqs_and_the_kv_pool_bound_the_running_batch() -> None:
    model = EngineModel(tiny_profile(num_blocks=64, max_num_seqs=2), random.Random(0))
    for i in range(3):
        model.add_request(f"r{i}", [i] * 10, max_tokens=5)
    model.step()
    assert (model.num_running, model.num_waiting) == (2, 1)
    metrics = model.metrics()
    assert metrics["vllm:num_requests_running"] == 2.0
    assert metrics["vllm:num_requests_waiting"] == 1.0
    assert metrics["vllm:kv_cache_usage_perc"] == pytest.approx(2 / 64)


def test_chunked_prefill_spreads_a_long_prompt_over_the_token_budget() -> None:
    model = EngineModel(tiny_profile(num_blocks=16, budget=32), random.Random(0))
    model.add_request("a", list(range(80)), max_tokens=2)
    results = run_until_idle(model)
    assert [r.num_scheduled_tokens for r in results] == [32, 32, 16, 1]
    assert [len(r.events) for r in results] == [0, 0, 1, 1]


def test_counters_and_finish_reasons() -> None:
    model = EngineModel(tiny_profile(num_blocks=64), random.Random(0))
    model.add_request("a", list(range(10)), max_tokens=5)
    model.add_request("b", list(range(50, 70)), max_tokens=50, eos_after=3)
    results = run_until_idle(model)
    reasons = {e.request_id: e.finish_reason for r in results for e in r.events if e.finish_reason}
    assert reasons == {"a": "length", "b": "stop"}
    assert model.counters.prompt_tokens_total == 10 + 20
    assert model.counters.generation_tokens_total == 5 + 3
    assert set(model.metrics()) == {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    }


def test_abort_frees_the_blocks_of_a_running_request() -> None:
    model = EngineModel(tiny_profile(num_blocks=8), random.Random(0))
    model.add_request("a", list(range(40)), max_tokens=100)
    model.step()
    assert model.pool.num_free == 5
    assert model.abort("a") and not model.abort("a")
    assert model.pool.num_free == 8 and not model.has_work


def test_prompts_longer_than_the_context_are_refused() -> None:
    model = EngineModel(tiny_profile(num_blocks=8), random.Random(0))  # 128-token context
    with pytest.raises(ValueError, match="context"):
        model.add_request("a", list(range(128)), max_tokens=1)


def test_the_same_seed_gives_the_same_steps() -> None:
    def trace(seed: int) -> list[tuple[float, list[str]]]:
        model = EngineModel(tiny_profile(num_blocks=16, jitter=0.05), random.Random(seed))
        for i in range(6):
            model.add_request(f"r{i}", [i] * (10 + 7 * i), max_tokens=30)
        return [(r.duration_s, [e.request_id for e in r.events]) for r in run_until_idle(model)]

    assert trace(3) == trace(3)
    assert trace(3) != trace(4)


def test_reset_forgets_cached_blocks_unless_some_are_in_use() -> None:
    """As vLLM's /reset_prefix_cache: refused while a request holds blocks, then every hash is gone."""
    from sim.model import BlockPool

    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.cache(blocks[0], 111)
    assert not pool.reset()  # in use
    pool.release(blocks)
    assert pool.lookup([111]) == [blocks[0]]
    assert pool.reset()
    assert pool.lookup([111]) == []
    assert pool.num_free == 4
