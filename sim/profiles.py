"""GPU and model profiles for the simulated vLLM replica, and the step-time cost model.

A profile is what ``vllm serve`` on one machine amounts to: a GPU (memory, bandwidth,
tensor throughput), a model (layers, KV heads, weights), and the engine flags (tensor
parallel degree, ``--max-num-seqs``, ``--gpu-memory-utilization``, the chunked-prefill
token budget). From these follow the two things the scheduler model needs:

* the KV-cache capacity in tokens, computed the way vLLM sizes its pool at start-up:
  ``gpu_memory x utilization - weights - activation reserve``, divided by the KV bytes per
  token (``2 x layers x kv_heads x head_dim x dtype bytes``, split across tensor-parallel
  ranks);
* the duration of one engine step, from a roofline: a step streams the weights and the KV
  it attends over from HBM, and does ``2 x params`` FLOPs per scheduled token. Memory and
  compute time overlap only partly, so they are combined with a p-norm (p = 2) rather than
  ``max``; this fitted the published RTX 3060 curve (see ``docs/simulator.md``).

Hardware figures are vendor datasheet numbers; efficiency factors and CPU overheads are the
calibrated part, fitted on the RTX 3060 measurements in ``BENCHMARKS.md`` and set to
typical vLLM values for the datacenter GPUs (which have no published table here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sim.answer_lengths import CHAT_ANSWERS, AnswerLengths

FP16_BYTES = 2  # bf16/fp16 weights and KV cache
# vLLM's default page size: the prefix cache and the allocator work in blocks of this many tokens.
DEFAULT_BLOCK_SIZE = 16
# vLLM's --gpu-memory-utilization default: the share of GPU memory the engine may claim.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Each transformer layer ends its attention and its MLP with an all-reduce under tensor parallelism.
ALL_REDUCES_PER_LAYER = 2
# Attention FLOPs per (query token, context token) pair per layer per hidden unit: QK^T and AV,
# a multiply-add each.
ATTENTION_FLOPS_PER_PAIR = 4
# p of the p-norm that combines memory and compute time (p -> infinity is the ideal roofline,
# p = 1 no overlap at all); 2 fitted the RTX 3060's bend between batch 8 and batch 32.
DEFAULT_ROOFLINE_SHARPNESS = 2.0


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model, from its datasheet."""

    name: str
    memory_bytes: int  # what the driver reports as total memory (slightly under the label)
    bandwidth_bytes_s: float  # HBM/GDDR bandwidth
    tensor_flops: float  # dense fp16/bf16 tensor-core throughput the serving kernels reach for
    link_bytes_s: float = 0.0  # per-direction GPU-GPU bandwidth for tensor parallelism (NVLink)
    all_reduce_latency_s: float = 0.0  # one small all-reduce (vLLM's custom all-reduce kernel)


@dataclass(frozen=True)
class ModelSpec:
    """One checkpoint: its attention shape (for the KV cache) and its weights (for step time)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int  # query heads x head_dim: sizes attention FLOPs and all-reduce messages
    weight_bytes: int  # resident in GPU memory (all ranks together)
    streamed_weight_bytes: int  # read from memory every forward pass (all but the embedding table)
    matmul_params: int  # parameters in matrix multiplies: 2 FLOPs each per token
    max_model_len: int  # the native context length
    kv_dtype_bytes: int = FP16_BYTES

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer and KV head (the same formula as vLLM's cache sizing)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes


@dataclass(frozen=True)
class Efficiency:
    """The calibrated part: how close vLLM gets to the datasheet, and what the CPU adds."""

    bandwidth: float  # share of peak bandwidth a decode step achieves
    flops: float  # share of peak tensor throughput (model FLOPs utilisation)
    step_overhead_s: float  # per step: scheduler, input preparation, kernel launches, sampling
    per_seq_overhead_s: float  # per scheduled sequence: bookkeeping, sampler, detokeniser
    frontend_latency_s: float  # API server: parse, tokenise, hand to the engine core, stream out
    step_jitter: float = 0.02  # relative sd of step times: keeps lock-stepped requests apart
    roofline_sharpness: float = DEFAULT_ROOFLINE_SHARPNESS


@dataclass(frozen=True)
class StepCoefficients:
    """A profile reduced to per-unit costs, so one step costs a handful of float operations."""

    fixed_s: float
    per_seq_s: float
    weights_s: float
    kv_read_s_per_token: float
    matmul_s_per_token: float
    attention_s_per_pair: float
    all_reduce_s: float
    all_reduce_s_per_token: float
    sharpness: float

    def seconds(self, num_seqs: int, num_tokens: int, kv_read_tokens: int, attention_pairs: float) -> float:
        """Duration of a step scheduling ``num_tokens`` tokens over ``num_seqs`` sequences.

        ``kv_read_tokens`` is the context attended over from the cache; ``attention_pairs`` the
        (query, key) pairs computed. An empty step costs nothing.
        """
        if num_tokens <= 0:
            return 0.0
        memory = self.weights_s + kv_read_tokens * self.kv_read_s_per_token
        compute = num_tokens * self.matmul_s_per_token + attention_pairs * self.attention_s_per_pair
        p = self.sharpness
        gpu = math.pow(math.pow(memory, p) + math.pow(compute, p), 1.0 / p)
        comm = self.all_reduce_s + num_tokens * self.all_reduce_s_per_token
        return self.fixed_s + num_seqs * self.per_seq_s + gpu + comm


@dataclass(frozen=True)
class SimProfile:
    """A GPU (or a tensor-parallel group of them), a model and vLLM's engine flags."""

    name: str
    gpu: GpuSpec
    model: ModelSpec
    efficiency: Efficiency
    activation_reserve_bytes: int  # per GPU: profiled activations, CUDA graphs, NCCL, non-torch
    tensor_parallel: int = 1
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # chunked-prefill token budget per step
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    block_size: int = DEFAULT_BLOCK_SIZE
    # vLLM's --num-gpu-blocks-override: a KV cache of this many blocks, whatever the memory.
    num_blocks_override: int | None = None
    # How long the model's answers run when they end on their own (``sim.answer_lengths``).
    answer_lengths: AnswerLengths = CHAT_ANSWERS

    @property
    def kv_pool_bytes_per_gpu(self) -> int:
        budget = self.gpu.memory_bytes * self.gpu_memory_utilization
        weights = self.model.weight_bytes / self.tensor_parallel
        return max(0, int(budget - weights - self.activation_reserve_bytes))

    @property
    def num_blocks(self) -> int:
        """KV-cache blocks: each rank holds its share of the KV heads for every token."""
        if self.num_blocks_override is not None:
            return self.num_blocks_override
        per_rank_token_bytes = self.model.kv_bytes_per_token / self.tensor_parallel
        return int(self.kv_pool_bytes_per_gpu // (per_rank_token_bytes * self.block_size))

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_model_len(self) -> int:
        # vLLM refuses to start if one sequence of max_model_len does not fit in the cache.
        return min(self.model.max_model_len, self.kv_capacity_tokens)

    def coefficients(self) -> StepCoefficients:
        """Per-unit step costs derived from the datasheet figures and the efficiency factors."""
        gpu, model, eff, tp = self.gpu, self.model, self.efficiency, self.tensor_parallel
        bandwidth = gpu.bandwidth_bytes_s * eff.bandwidth
        flops = gpu.tensor_flops * eff.flops
        all_reduce_s = 0.0
        all_reduce_s_per_token = 0.0
        if tp > 1:
            # A ring all-reduce moves 2 (tp - 1) / tp of the message over each link.
            reductions = ALL_REDUCES_PER_LAYER * model.num_layers
            all_reduce_s = reductions * gpu.all_reduce_latency_s
            message_per_token = model.hidden_size * FP16_BYTES * 2 * (tp - 1) / tp
            all_reduce_s_per_token = reductions * message_per_token / gpu.link_bytes_s
        return StepCoefficients(
            fixed_s=eff.step_overhead_s,
            per_seq_s=eff.per_seq_overhead_s,
            weights_s=model.streamed_weight_bytes / tp / bandwidth,
            kv_read_s_per_token=model.kv_bytes_per_token / tp / bandwidth,
            matmul_s_per_token=2 * model.matmul_params / tp / flops,
            attention_s_per_pair=ATTENTION_FLOPS_PER_PAIR * model.num_layers * model.hidden_size / tp / flops,
            all_reduce_s=all_reduce_s,
            all_reduce_s_per_token=all_reduce_s_per_token,
            sharpness=eff.roofline_sharpness,
        )


def describe(profile: SimProfile) -> str:
    """One line for logs and docs: what the profile holds and what follows from it."""
    kib = profile.model.kv_bytes_per_token / 1024
    coeff = profile.coefficients()
    decode_1 = coeff.seconds(1, 1, 0, 0.0)
    return (
        f"{profile.name}: {profile.kv_capacity_tokens:,} KV tokens ({kib:.0f} KiB/token), "
        f"max_num_seqs {profile.max_num_seqs}, single-stream {1 / decode_1:.0f} tok/s, "
        f"prefill ~{1 / coeff.matmul_s_per_token:,.0f} tok/s"
    )


# --- GPUs (datasheet figures) ---------------------------------------------------------------

H100_SXM_80GB = GpuSpec(
    name="H100-SXM-80GB",
    memory_bytes=85_000_000_000,  # 79.2 GiB as torch reports it
    bandwidth_bytes_s=3.35e12,  # HBM3
    tensor_flops=989e12,  # dense BF16
    link_bytes_s=450e9,  # NVLink 4: 900 GB/s both directions
    all_reduce_latency_s=6e-6,
)
A100_SXM_80GB = GpuSpec(
    name="A100-SXM-80GB",
    memory_bytes=85_100_000_000,  # 79.3 GiB as torch reports it
    bandwidth_bytes_s=2.039e12,  # HBM2e
    tensor_flops=312e12,  # dense BF16
    link_bytes_s=300e9,  # NVLink 3: 600 GB/s both directions
    all_reduce_latency_s=8e-6,
)
RTX_3060_12GB = GpuSpec(
    name="RTX-3060-12GB",
    memory_bytes=12_630_000_000,  # 11.76 GiB as torch reports it
    bandwidth_bytes_s=360e9,  # GDDR6, 192-bit at 15 Gbps
    # GeForce Ampere runs FP16 tensor maths with FP32 accumulation (what the Marlin int4 kernels
    # use) at half the FP16-accumulate rate: 28 SMs x 1.78 GHz x 512 FLOPs/clock.
    tensor_flops=25.5e12,
)

# --- Models ------------------------------------------------------------------------------
# Streamed weights leave out the input embedding table (a lookup reads a few rows); the LM head
# is read in full every step. Quantised checkpoints keep embeddings and LM head in fp16.

LLAMA_31_8B = ModelSpec(
    name="meta-llama/Llama-3.1-8B-Instruct",
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    hidden_size=4096,
    weight_bytes=16_060_000_000,  # 8.03 B params in bf16
    streamed_weight_bytes=15_010_000_000,  # minus the 128,256 x 4,096 embedding table
    matmul_params=7_500_000_000,
    max_model_len=131_072,
)
LLAMA_31_70B = ModelSpec(
    name="meta-llama/Llama-3.1-70B-Instruct",
    num_layers=80,
    num_kv_heads=8,
    head_dim=128,
    hidden_size=8192,
    weight_bytes=141_100_000_000,  # 70.6 B params in bf16
    streamed_weight_bytes=139_000_000_000,  # minus the 128,256 x 8,192 embedding table
    matmul_params=69_500_000_000,
    max_model_len=131_072,
)
QWEN25_7B = ModelSpec(
    name="Qwen/Qwen2.5-7B-Instruct",
    num_layers=28,
    num_kv_heads=4,
    head_dim=128,
    hidden_size=3584,
    weight_bytes=15_230_000_000,  # 7.62 B params in bf16
    streamed_weight_bytes=14_140_000_000,  # minus the 152,064 x 3,584 embedding table
    matmul_params=7_070_000_000,
    max_model_len=32_768,
)
QWEN25_7B_AWQ = ModelSpec(
    name="Qwen/Qwen2.5-7B-Instruct-AWQ",
    num_layers=28,
    num_kv_heads=4,
    head_dim=128,
    hidden_size=3584,
    # 6.53 B body params at 4 bits (3.27 GB) + group-128 scales and zeros (0.13 GB)
    # + fp16 embedding and LM head (1.09 GB each): the checkpoint's 5.58 GB.
    weight_bytes=5_580_000_000,
    streamed_weight_bytes=4_490_000_000,
    matmul_params=7_070_000_000,
    max_model_len=32_768,
)
LLAMA2_7B_GPTQ = ModelSpec(
    name="TheBloke/Llama-2-7B-Chat-GPTQ",
    # Full multi-head attention: 32 KV heads, 512 KiB of KV per token.
    num_layers=32,
    num_kv_heads=32,
    head_dim=128,
    hidden_size=4096,
    # 6.48 B body params at 4 bits (3.24 GB) + scales (0.13 GB) + fp16 embedding and LM head
    # (0.26 GB each): the checkpoint's 3.89 GB.
    weight_bytes=3_890_000_000,
    streamed_weight_bytes=3_630_000_000,
    matmul_params=6_610_000_000,
    max_model_len=4_096,
)

# --- Efficiency ----------------------------------------------------------------------------

# Datacenter GPUs: decode kernels reach ~80% of HBM bandwidth; prefill GEMMs ~50% of dense
# BF16 peak; vLLM V1's CPU side costs ~1 ms per step plus tens of microseconds per sequence on
# a server CPU. No published table here: typical figures, not a fit.
DATACENTER = Efficiency(
    bandwidth=0.8, flops=0.5, step_overhead_s=1.0e-3, per_seq_overhead_s=20e-6, frontend_latency_s=3e-3
)
# RTX 3060 with vLLM 0.11 in a VM: fitted on BENCHMARKS.md's Qwen2.5-7B AWQ sweep (a grid over
# bandwidth share, FLOPs share, per-sequence overhead and p, scored by bench/sim_calibration.py).
# The ~1,185 tok/s plateau at 64-96 users pins the FLOPs share (0.8 x 25.5 TFLOPS / 14.1 GFLOP
# per token = 1,443 tok/s of compute); one stream at the published 58.9 tok/s pins the fixed
# overhead: 16.98 ms = 4.49 GB / (0.8 x 360 GB/s) [15.59 ms] + 0.06 ms + 1.33 ms.
RTX3060 = Efficiency(
    bandwidth=0.8, flops=0.8, step_overhead_s=1.33e-3, per_seq_overhead_s=60e-6, frontend_latency_s=5e-3
)

# Per GPU, held back from the KV pool: vLLM's profiling run (peak activations for a full
# chunked-prefill batch), CUDA graphs and allocations outside torch. 0.55 GB on the 3060
# reproduces the ~13,200-token Llama-2 pool quoted in BENCHMARKS.md.
DATACENTER_RESERVE_BYTES = 4_000_000_000
RTX3060_RESERVE_BYTES = 550_000_000
# The published experiment ran with --max-num-seqs 96; below 70 GB of GPU memory vLLM's
# OpenAI server defaults to a 2,048-token chunked-prefill budget.
RTX3060_MAX_NUM_SEQS = 96
RTX3060_BATCHED_TOKENS = 2048


def _datacenter(name: str, gpu: GpuSpec, model: ModelSpec, tp: int = 1) -> SimProfile:
    return SimProfile(
        name=name,
        gpu=gpu,
        model=model,
        efficiency=DATACENTER,
        activation_reserve_bytes=DATACENTER_RESERVE_BYTES,
        tensor_parallel=tp,
    )


def _rtx3060(name: str, model: ModelSpec) -> SimProfile:
    return SimProfile(
        name=name,
        gpu=RTX_3060_12GB,
        model=model,
        efficiency=RTX3060,
        activation_reserve_bytes=RTX3060_RESERVE_BYTES,
        max_num_seqs=RTX3060_MAX_NUM_SEQS,
        max_num_batched_tokens=RTX3060_BATCHED_TOKENS,
    )


PROFILES: dict[str, SimProfile] = {
    p.name: p
    for p in (
        _datacenter("h100-llama-3.1-8b", H100_SXM_80GB, LLAMA_31_8B),
        _datacenter("a100-llama-3.1-8b", A100_SXM_80GB, LLAMA_31_8B),
        _datacenter("h100x4-llama-3.1-70b", H100_SXM_80GB, LLAMA_31_70B, tp=4),
        _datacenter("a100x4-llama-3.1-70b", A100_SXM_80GB, LLAMA_31_70B, tp=4),
        _datacenter("h100-qwen2.5-7b", H100_SXM_80GB, QWEN25_7B),
        _datacenter("a100-qwen2.5-7b", A100_SXM_80GB, QWEN25_7B),
        _rtx3060("rtx3060-qwen2.5-7b-awq", QWEN25_7B_AWQ),
        _rtx3060("rtx3060-llama-2-7b-gptq", LLAMA2_7B_GPTQ),
    )
}


def get_profile(name: str) -> SimProfile:
    """The registered profile called ``name``; the error lists the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown simulator profile {name!r} (known: {known})") from None
