"""How long does a semantic cache lookup take on one core, over 100,000 cached questions?

    .venv/bin/python bench/cache_speed.py [--entries 100000] [--real 3000] [--core N] [--out FILE]

Times the cache step exactly as the gateway runs it (``ResponseCache.plan`` then
``ResponseCache.find``: the exact lookup, then the semantic one: embed with
all-MiniLM-L6-v2, search the local index, verify, fetch the answer from Redis), built by
``create_response_cache`` against a redis-server this script starts (no persistence) and
fills beforehand through the semantic store's own script. The measured cache then starts
the way a gateway does, loading every entry from Redis.

- One core: this process (and so the embedder's worker thread) is pinned to one CPU with
  ``os.sched_setaffinity``, the model (ONNX Runtime) and BLAS use one thread; redis-server runs on another
  CPU, as it would on its own host.
- Entries: ``--real`` questions of the held-out half of ``qqp_val.csv`` (embedded by the
  model, their answers stored), plus random unit vectors with made-up texts up to
  ``--entries``, all in one scope (the worst case: every lookup searches all of them).
- Lookups: the question1 of the same pairs (duplicates and non-duplicates of a cached
  question, so both hits and misses), each text asked once (the cache remembers
  vectors by text, a repeat would skip the model). Closed loops of 1, 32 and 256
  concurrent lookups.
- The embed timeout and the pending bound are raised for the run so that every lookup
  completes and is timed; the report says how many would have exceeded the defaults.
- The embedder runs as the gateway runs it: float32 on ONNX Runtime.

Wall time on a busy shared machine overstates the cost, so the report also gives this
process's CPU time per lookup and the machine's load while each phase ran.

``--variants`` (on by default) also times the model itself on the same texts, taking
turns: the embedder (ONNX Runtime) against ``SentenceTransformer.encode`` in float32 on
PyTorch, the reference whose vectors the embedder must reproduce (the baseline measured in
the same run, since times on this shared machine move between runs); and how far the
embedder's vectors are from the reference's. The batch sizes
the embedder ran in each phase come from ``fleetgate_cache_embed_batch_size``. Writes
``bench/results/cache-speed.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.qqp_pairs import SPLIT_SEED, load_pairs, split_pairs  # noqa: E402
from cache.config import (  # noqa: E402
    DEFAULT_EMBED_TIMEOUT_MS,
    CacheServiceSettings,
    CacheSettings,
    SemanticCacheSettings,
    SemanticServiceSettings,
)
from cache.keys import exact_key, semantic_query, split_key  # noqa: E402
from cache.metrics import EMBED_BATCH_BUCKETS, CacheMetrics  # noqa: E402
from cache.redis_store import RedisStore  # noqa: E402
from cache.semantic.cache import entry_scope  # noqa: E402
from cache.semantic.embed_model import DEFAULT_LAYERS, load_sentence_transformer  # noqa: E402
from cache.semantic.embedder import SentenceTransformerEmbedder, default_model_dir  # noqa: E402
from cache.semantic.index import SemanticEntry  # noqa: E402
from cache.semantic.redis_store import RedisSemanticStore  # noqa: E402
from cache.service import ResponseCache, create_response_cache  # noqa: E402
from capacity.stats import percentile  # noqa: E402
from dialects.answer import CachedCompletion  # noqa: E402
from dialects.openai import CHAT  # noqa: E402
from tests.integration.redis_server import RedisServer  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TENANT, MODEL = "bench", "m"
CONCURRENCY = (1, 32, 256)
# Lookups timed per concurrency level (each a text not asked before).
LOOKUPS = {1: 300, 32: 640, 256: 1024}
WARMUP = 20
BARS_MS = {1: 20.0, 32: 50.0}
ANSWER = CachedCompletion("chat", MODEL, "A cached answer.", "stop", 20, 5)
# Long enough to cover a whole run; the bound far above the entries stored.
TENANT_CACHE = CacheSettings(ttl_s=6 * 3600, max_entries=10**7, semantic=SemanticCacheSettings(enabled=True))
# Every lookup completes and is timed (see the module docstring).
SETTINGS = CacheServiceSettings(
    lookup_timeout_ms=1000,
    store_timeout_ms=5000,
    semantic=SemanticServiceSettings(embed_timeout_ms=60_000, max_pending=100_000, load_timeout_s=600),
)
PUT_CONCURRENCY = 64


def body(text: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "temperature": 0}


@dataclass
class Phase:
    """One closed-loop run: latencies, CPU and machine load while it ran."""

    concurrency: int
    latencies: list[float] = field(default_factory=list)
    # Per lookup, this process's CPU time (only meaningful one lookup at a time).
    cpu_latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    machine_busy: float = 0.0  # share of all CPUs busy (any process)
    hits: int = 0
    batches: float = 0.0  # embedding batches the model ran during the phase
    # Batches of at most n texts during the phase, n = each bucket of the batch-size histogram.
    batch_sizes: dict[float, float] = field(default_factory=dict)

    def ms(self, q: float) -> float:
        return percentile(self.latencies, q) * 1000


class CpuSampler:
    """The machine's busy share between two reads of /proc/stat."""

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[int, int]:
        with open("/proc/stat") as handle:
            values = [int(v) for v in handle.readline().split()[1:]]
        idle = values[3] + values[4]
        return sum(values), idle

    def busy(self) -> float:
        total, idle = self._read()
        last_total, last_idle = self._last
        self._last = (total, idle)
        span = total - last_total
        return 1.0 - (idle - last_idle) / span if span else 0.0


def pin(core: int | None) -> tuple[int, int | None]:
    """Pin this process to one CPU; return it and another for redis-server (if any)."""
    cpus = sorted(os.sched_getaffinity(0))
    mine = core if core is not None else cpus[-1]
    os.sched_setaffinity(0, {mine})
    others = [c for c in cpus if c != mine]
    return mine, (others[0] if others else None)


async def populate(url: str, real: list[str], entries: int, rng: np.random.Generator) -> dict[str, float]:
    """Store ``real`` questions (embedded as the measured cache will, with answers) and random
    fillers up to ``entries``."""
    started = time.perf_counter()
    async with SentenceTransformerEmbedder(threads=1) as embedder:
        vectors = np.vstack([await embedder.embed(real[i : i + 64]) for i in range(0, len(real), 64)])
        identity = embedder.identity  # the measured cache's embedder is the same model
    embed_s = time.perf_counter() - started
    store = RedisStore.from_url(url, SETTINGS, max_connections=PUT_CONCURRENCY)
    semantic = RedisSemanticStore(store)
    scope_of = semantic_query(TENANT, MODEL, CHAT, body("x"))
    assert scope_of is not None
    scope = entry_scope(scope_of.scope, identity)  # every question of this benchmark shares one scope

    slots = asyncio.Semaphore(PUT_CONCURRENCY)  # never more calls than pooled connections

    async def put(n: int) -> None:
        async with slots:
            await write(n)

    async def write(n: int) -> None:
        if n < len(real):
            key = exact_key(TENANT, MODEL, CHAT, body(real[n]))
            await store.set(key, ANSWER.to_bytes(), ttl_s=TENANT_CACHE.ttl_s, max_entries=TENANT_CACHE.max_entries)
            text, vector = real[n], vectors[n]
        else:
            key = f"{TENANT}:{n:064x}"
            vector = rng.standard_normal(size=(vectors.shape[1],), dtype=np.float32)
            vector /= np.linalg.norm(vector)
            text = f"Made-up cached question number {n} about topic {n % 977}?"
        entry = SemanticEntry(split_key(key)[1], scope, text, vector, key)
        await semantic.put(entry, ttl_s=TENANT_CACHE.ttl_s, max_entries=TENANT_CACHE.max_entries)

    started = time.perf_counter()
    for first in range(0, entries, PUT_CONCURRENCY * 8):
        await asyncio.gather(*(put(n) for n in range(first, min(first + PUT_CONCURRENCY * 8, entries))))
    put_s = time.perf_counter() - started
    await store.close()
    return {"embed_s": embed_s, "put_s": put_s}


async def closed_loop(cache: ResponseCache, texts: list[str], concurrency: int) -> Phase:
    phase = Phase(concurrency)
    queue = iter(texts)

    async def worker() -> None:
        for text in queue:
            plan = cache.plan(TENANT, MODEL, CHAT, body(text), TENANT_CACHE, None)
            started, cpu = time.perf_counter(), time.process_time()
            hit = await cache.find(plan)
            phase.latencies.append(time.perf_counter() - started)
            phase.cpu_latencies.append(time.process_time() - cpu)
            phase.hits += hit is not None

    sampler = CpuSampler()
    batches = cache.metrics.sample("fleetgate_cache_embed_batches_total")
    sizes = batch_sizes(cache.metrics)
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    phase.wall_s, phase.cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    phase.machine_busy = sampler.busy()
    phase.batches = cache.metrics.sample("fleetgate_cache_embed_batches_total") - batches
    phase.batch_sizes = {n: count - sizes[n] for n, count in batch_sizes(cache.metrics).items()}
    return phase


def batch_sizes(metrics: CacheMetrics) -> dict[float, float]:
    """Cumulative buckets of ``fleetgate_cache_embed_batch_size``: batches of at most n texts."""
    return {n: metrics.sample("fleetgate_cache_embed_batch_size_bucket", le=str(float(n))) for n in EMBED_BATCH_BUCKETS}


async def components(cache: ResponseCache, texts: list[str]) -> dict[str, tuple[float, float]]:
    """p50 / p99 (ms) of each step of a lookup, run alone and one at a time."""
    semantic = cache.semantic
    assert semantic is not None and semantic.index is not None
    embedder, verifier, index = semantic.embedder, semantic.verifier, semantic.index
    assert embedder is not None and verifier is not None
    steps: dict[str, list[float]] = {"embed": [], "index top-4": [], "verify": [], "Redis GET (answer)": []}
    answer_key = exact_key(TENANT, MODEL, CHAT, body(texts[0]))
    for text in texts:
        query = semantic_query(TENANT, MODEL, CHAT, body(text))
        assert query is not None
        t0 = time.perf_counter()
        vector = (await embedder.embed([text]))[0]
        t1 = time.perf_counter()
        scope = entry_scope(query.scope, embedder.identity)
        found = index.candidates(scope, vector, k=4, min_score=verifier.min_cosine, now=time.time())
        t2 = time.perf_counter()
        verifier.choose(text, vector, found)
        t3 = time.perf_counter()
        await cache.store_backend.get(answer_key)
        t4 = time.perf_counter()
        for name, seconds in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            steps[name].append(seconds)
    return {name: (percentile(v, 50) * 1000, percentile(v, 99) * 1000) for name, v in steps.items()}


EncodeCall = Callable[[list[str]], Awaitable[np.ndarray]]
# Texts each variant embeds alone (taking turns), and the batch size of the batched pass.
VARIANT_LONE = 150
VARIANT_BATCH = 32
# The variants: the reference first (the drift is measured against it), then the embedder.
ENCODE_FLOAT32 = "float32, `SentenceTransformer.encode` on PyTorch (the reference)"
ONNX_FLOAT32 = "float32, ONNX Runtime (the embedder, measured above)"


def through_encode(model: Any) -> EncodeCall:
    """``SentenceTransformer.encode``, normalised: the reference the embedder is checked against."""

    async def encode(batch: list[str]) -> np.ndarray:
        out: np.ndarray = model.encode(
            batch, batch_size=64, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
        )
        return out

    return encode


async def embedder_variants(texts: list[str]) -> list[dict[str, Any]]:
    """The model alone, the embedder against encode: cost lone and in batches, vector gap.

    The variants take turns text by text (and batch by batch), so a change in the machine's
    load hits them alike. The first, the reference, is the one the gap is measured against.
    """
    import torch

    torch.set_num_threads(1)
    model = load_sentence_transformer(default_model_dir(), DEFAULT_LAYERS)  # the shipped default's model
    async with SentenceTransformerEmbedder(threads=1, max_wait_s=0) as embedder:
        variants: dict[str, EncodeCall] = {ENCODE_FLOAT32: through_encode(model), ONNX_FLOAT32: embedder.embed}
        return await _time_variants(variants, texts)


async def _time_variants(variants: dict[str, EncodeCall], texts: list[str]) -> list[dict[str, Any]]:
    for call in variants.values():
        await call(texts[:8])
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for text in texts[:VARIANT_LONE]:
        for name, call in variants.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            await call([text])
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - cpu_started)
    batch_cpu = dict.fromkeys(variants, 0.0)
    vectors: dict[str, list[np.ndarray]] = {name: [] for name in variants}
    for first in range(0, len(texts), VARIANT_BATCH):
        for name, call in variants.items():
            cpu_started = time.process_time()
            vectors[name].append(await call(texts[first : first + VARIANT_BATCH]))
            batch_cpu[name] += time.process_time() - cpu_started
    reference = np.vstack(next(iter(vectors.values())))
    rows = []
    for name in variants:
        mine = np.vstack(vectors[name])
        pairs = np.einsum("ij,ij->i", mine[:-1], mine[1:]) - np.einsum("ij,ij->i", reference[:-1], reference[1:])
        rows.append(
            {
                "name": name,
                "single_p50_ms": percentile(wall[name], 50) * 1000,
                "single_cpu_ms": float(np.mean(cpu[name])) * 1000,
                "single_cpu_p99_ms": percentile(cpu[name], 99) * 1000,
                "batch_cpu_ms": batch_cpu[name] / len(texts) * 1000,
                "gap_max": float(np.max(1.0 - np.einsum("ij,ij->i", mine, reference))),
                "drift_mean": float(np.abs(pairs).mean()),
                "drift_max": float(np.abs(pairs).max()),
            }
        )
    return rows


async def run(args: argparse.Namespace) -> dict[str, Any]:
    mine, other = pin(args.core)
    rng = np.random.default_rng(0)
    _, held_out = split_pairs(load_pairs(args.pairs), SPLIT_SEED)
    pairs = held_out[: args.real]
    real = sorted({p.question2 for p in pairs})
    cached = set(real)
    queries = list(dict.fromkeys(p.question1 for p in pairs if p.question1 not in cached))
    lookups = {c: max(c, round(n * args.lookups_scale)) for c, n in LOOKUPS.items()}
    needed = WARMUP + sum(lookups.values()) + args.component_samples
    if len(queries) < needed:
        raise SystemExit(f"{len(queries)} distinct query texts, {needed} needed: raise --real")
    order = rng.permutation(len(queries))
    queries = [queries[i] for i in order]
    loads_before = os.getloadavg()
    with RedisServer() as server:
        if other is not None and server.pid is not None:
            os.sched_setaffinity(server.pid, {other})
        print(f"filling Redis: {len(real)} real questions + fillers up to {args.entries:,}", flush=True)
        filled = await populate(server.url, real, args.entries, rng)
        metrics = CacheMetrics()
        cache = create_response_cache(server.url, SETTINGS, metrics, start_semantic=True)
        started = time.perf_counter()
        async with cache:
            start_s = time.perf_counter() - started
            semantic = cache.semantic
            assert semantic is not None and semantic.index is not None
            loaded = len(semantic.index)
            assert isinstance(semantic.embedder, SentenceTransformerEmbedder)
            print(f"gateway cache started in {start_s:.1f} s with {loaded:,} entries", flush=True)
            taken = 0
            await closed_loop(cache, queries[:WARMUP], 1)
            taken += WARMUP
            phases = []
            for c in CONCURRENCY:
                texts = queries[taken : taken + lookups[c]]
                taken += len(texts)
                phase = await closed_loop(cache, texts, c)
                phases.append(phase)
                print(
                    f"c={c:>3}: p50 {phase.ms(50):7.1f} ms  p99 {phase.ms(99):7.1f} ms  "
                    f"CPU {phase.cpu_s / len(texts) * 1000:5.1f} ms/lookup  machine busy {phase.machine_busy:.0%}",
                    flush=True,
                )
            if not any(phase.hits for phase in phases):
                # Some queries are rephrasings of cached questions: a run without a single
                # hit measured a cache that could not find its entries (a scope mismatch).
                raise SystemExit("no lookup hit any cached entry: the benchmark's entries do not match its queries")
            steps = await components(cache, queries[taken : taken + args.component_samples])
            taken += args.component_samples
    return {
        "core": mine,
        "nice": os.nice(0),
        "redis_core": other,
        "cpu": _cpu_model(),
        "loads_before": loads_before,
        "loads_after": os.getloadavg(),
        "entries": loaded,
        "real": len(real),
        "filled": filled,
        "start_s": start_s,
        "phases": phases,
        "steps": steps,
        "variants": await embedder_variants(queries[:512]) if args.variants else [],
    }


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as handle:
        for line in handle:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def write_report(result: dict[str, Any], out: Path) -> None:
    phases: list[Phase] = result["phases"]
    lines = [
        "# Semantic cache lookup speed",
        "",
        f"Generated by `.venv/bin/python bench/cache_speed.py{result['arguments']}`.",
        "The cache step as the gateway runs it (`ResponseCache.plan` + `ResponseCache.find`: exact lookup in",
        "Redis, then embed, search the local",
        "index, verify, fetch the answer from Redis), over "
        f"**{result['entries']:,} entries in one scope**, on **one core** ({result['cpu']}, CPU "
        f"{result['core']}; the model and BLAS on one thread; redis-server on CPU {result['redis_core']}; "
        f"niceness {result['nice']}). Embedder: the gateway's default settings (the shipped model, float32 on "
        "ONNX Runtime).",
        "",
        "| concurrent lookups | lookups | p50 | p99 | bar (p99) | CPU per lookup | lookups/s | mean batch | hits "
        "| machine busy |",
        "| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in phases:
        bar = BARS_MS.get(p.concurrency)
        verdict = "-" if bar is None else (f"< {bar:g} ms: **{'met' if p.ms(99) < bar else 'not met'}**")
        n = len(p.latencies)
        lines.append(
            f"| {p.concurrency} | {n} | {p.ms(50):.1f} ms | {p.ms(99):.1f} ms | {verdict} | "
            f"{p.cpu_s / n * 1000:.1f} ms | {n / p.wall_s:.0f} | {n / p.batches if p.batches else 0:.1f} | "
            f"{p.hits} | {p.machine_busy:.0%} |"
        )
    alone = next(p for p in phases if p.concurrency == 1)
    cpu_p50, cpu_p99 = (percentile(alone.cpu_latencies, q) * 1000 for q in (50, 99))
    lines += [
        "",
        f"One lookup at a time, counted in this process's CPU time instead of wall time (what it would take "
        f"with the core to itself, Redis round trips aside): p50 **{cpu_p50:.1f} ms**, p99 **{cpu_p99:.1f} ms**.",
    ]
    over = {p.concurrency: sum(x * 1000 > DEFAULT_EMBED_TIMEOUT_MS for x in p.latencies) for p in phases}
    lines += [
        "",
        "*Machine busy*: share of both CPUs in use by any process while the phase ran (from /proc/stat);",
        "this process can use at most one of the two. Load average (1, 5, 15 min): "
        f"{'/'.join(f'{x:.2f}' for x in result['loads_before'])} before, "
        f"{'/'.join(f'{x:.2f}' for x in result['loads_after'])} after.",
        "*CPU per lookup*: this process's CPU time (event loop and embedding thread) over the phase, divided",
        "by its lookups: what a lookup costs when nothing else competes for the core.",
        "Lookups slower than the default embed timeout "
        f"({DEFAULT_EMBED_TIMEOUT_MS:g} ms; they would have been misses in a gateway): "
        + ", ".join(f"{over[c]} of {len(p.latencies)} at {c}" for c, p in zip(over, phases, strict=True))
        + ".",
        "",
        "Each step alone, one lookup at a time (ms):",
        "",
        "| step | p50 | p99 |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| {name} | {p50:.2f} | {p99:.2f} |" for name, (p50, p99) in result["steps"].items()]
    lines += [
        "",
        "Batch sizes the embedder ran (`fleetgate_cache_embed_batch_size`): batches of at most n texts, per phase:",
        "",
        "| concurrent lookups | " + " | ".join(f"<= {n}" for n in EMBED_BATCH_BUCKETS) + " |",
        "| ---: | " + " | ".join("---:" for _ in EMBED_BATCH_BUCKETS) + " |",
    ]
    lines += [
        f"| {p.concurrency} | " + " | ".join(f"{p.batch_sizes.get(n, 0):.0f}" for n in EMBED_BATCH_BUCKETS) + " |"
        for p in phases
    ]
    if result["variants"]:
        lines += [
            "",
            f"The model alone, same core ({len(result['variants'])} variants taking turns text by text: "
            f"{VARIANT_LONE} lone texts, then 512 query texts in batches of {VARIANT_BATCH}). The embedder is timed "
            "through `SentenceTransformerEmbedder.embed` (a lone text unpadded, a batch in groups of similar "
            "length); the reference is `SentenceTransformer.encode` on PyTorch, whose vectors the embedder must "
            "reproduce. Vector gap = largest 1 - cosine to the reference's vector of the same text; drift = "
            "|change of the cosine between consecutive texts| against the reference, what the verifier would see:",
            "",
            "| variant | one text p50 | one text CPU (mean) | one text CPU p99 | CPU per text in batches of "
            f"{VARIANT_BATCH} | vector gap | drift mean | drift max |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {v['name']} | {v['single_p50_ms']:.1f} ms | {v['single_cpu_ms']:.1f} ms "
            f"| {v['single_cpu_p99_ms']:.1f} ms | {v['batch_cpu_ms']:.1f} ms | {v['gap_max']:.1e} "
            f"| {v['drift_mean']:.4f} | {v['drift_max']:.4f} |"
            for v in result["variants"]
        ]
    lines += analysis(result)
    filled = result["filled"]
    lines += [
        "",
        f"Setup: {result['real']:,} held-out QQP questions embedded in {filled['embed_s']:.0f} s and stored with "
        f"answers, plus random unit-vector fillers, written through the store's script in {filled['put_s']:.0f} s; "
        f"the measured cache then started (model load + full load of {result['entries']:,} entries from Redis by "
        f"SCAN) in {result['start_s']:.1f} s.",
        "",
    ]
    out.write_text("\n".join(lines))


def analysis(result: dict[str, Any]) -> list[str]:
    """Why the bars are met or not, from this run's own numbers."""
    by_c = {p.concurrency: p for p in result["phases"]}
    one, many = by_c[1], by_c[32]
    steps = result["steps"]
    others = sum(p50 for name, (p50, _) in steps.items() if name != "embed")
    lines = ["", "## Reading the numbers", "", *_alone(one, steps, others, result["variants"])]
    lines += _concurrent(many, others, result["variants"])
    lines += [
        "- **In a gateway** these lookups do not wait that long: past `embed_timeout_ms` (100 ms) a "
        "semantic lookup is a miss and the request goes upstream, and past `max_pending` (64) texts the "
        "model is not even asked. Under a load like the 32 and 256 rows the semantic cache therefore "
        "mostly stands aside (counted as `timeout` / `unavailable`) instead of delaying requests.",
    ]
    return lines + _levers(result["variants"])


def _variant(variants: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((v for v in variants if v["name"] == name), None)


def _alone(
    one: Phase, steps: dict[str, tuple[float, float]], others: float, variants: list[dict[str, Any]]
) -> list[str]:
    """The bullet on one lookup at a time."""
    bar = BARS_MS[1]
    cpu_mean = one.cpu_s / len(one.latencies) * 1000
    cpu_p99 = percentile(one.cpu_latencies, 99) * 1000
    verdict = "met" if one.ms(99) < bar else "not met"
    text = (
        f"- **One lookup at a time** is a serial chain: the exact lookup (one Redis read), the embedding, the "
        f"index, the verifier, one more Redis read. p99 **{one.ms(99):.1f} ms** against the {bar:g} ms bar: "
        f"**{verdict}**. In CPU time a lookup cost {cpu_mean:.1f} ms on average, p99 {cpu_p99:.1f} ms, "
        f"{'under' if cpu_p99 < bar else 'over'} the bar before any wait for the CPU. Alone, the embedding took "
        f"{steps['embed'][0]:.1f} ms at p50 (p99 {steps['embed'][1]:.1f}), the index, verifier and answer read "
        f"{others:.1f} ms together at p50."
    )
    mine, reference = _variant(variants, ONNX_FLOAT32), _variant(variants, ENCODE_FLOAT32)
    if mine and reference:
        text += (
            f" The model's CPU for a lone text was {mine['single_cpu_ms']:.1f} ms on average on ONNX Runtime "
            f"(p99 {mine['single_cpu_p99_ms']:.1f}) against {reference['single_cpu_ms']:.1f} ms "
            f"(p99 {reference['single_cpu_p99_ms']:.1f}) through `encode` on PyTorch, taking turns in this run."
        )
    if one.ms(99) >= bar:
        text += (
            f" Between the CPU-time p99 ({cpu_p99:.1f} ms) and the wall-time p99 ({one.ms(99):.1f} ms) the lookup "
            f"waited for the CPU: the machine was {one.machine_busy:.0%} busy while the phase ran, and this process "
            "had one of its two cores."
        )
    if cpu_p99 >= bar:
        text += (
            f" Even in CPU time the tail is over the bar{' (the mean is under it)' if cpu_mean < bar else ''}: on "
            "this shared machine the same work costs more when the other core is busy (caches and memory "
            "bandwidth are shared), and the model's cost grows with the length of the text; a quiet core or a "
            "cheaper encoder is what would leave margin."
        )
    return [text]


def _concurrent(many: Phase, others: float, variants: list[dict[str, Any]]) -> list[str]:
    """The bullet on 32 lookups in flight."""
    bar = BARS_MS[32]
    cpu_many = many.cpu_s / len(many.latencies) * 1000
    text = (
        f"- **32 lookups in flight on one core**: p99 **{many.ms(99):.0f} ms** against the {bar:g} ms bar: "
        f"**{'met' if many.ms(99) < bar else 'not met'}**. By Little's law a closed loop of 32 takes at least "
        f"32 x (CPU per lookup) per round, {32 * cpu_many:.0f} ms at the {cpu_many:.1f} ms measured here (the "
        f"measured p50, {many.ms(50):.0f} ms, adds the waits for a CPU {many.machine_busy:.0%} busy); the bar needs "
        f"about {bar / 32:.1f} ms of CPU per lookup, all steps included."
    )
    mine = _variant(variants, ONNX_FLOAT32)
    if mine:
        text += (
            f" The model alone costs {mine['batch_cpu_ms']:.1f} ms per text in batches of {VARIANT_BATCH} as "
            f"measured, and the other steps {others:.1f} ms per lookup at p50: no setting of this encoder on "
            "one core reaches it. Batching does its part (see the mean batch and the batch sizes)."
        )
    return [text]


def _levers(variants: list[dict[str, Any]]) -> list[str]:
    """What the runtime saves against the reference in this run's table, and what would go further."""
    reference, onnx = _variant(variants, ENCODE_FLOAT32), _variant(variants, ONNX_FLOAT32)
    if not (reference and onnx):
        return []
    return [
        "- **The model's cost**, from the table above: on ONNX Runtime (fused kernels, little per-operation "
        f"overhead, a lone text unpadded, a batch in groups of similar length) a lone text took "
        f"{onnx['single_cpu_ms']:.1f} ms of CPU and a text in a batch of {VARIANT_BATCH} "
        f"{onnx['batch_cpu_ms']:.1f} ms, "
        f"{reference['single_cpu_ms'] / onnx['single_cpu_ms']:.1f}x and "
        f"{reference['batch_cpu_ms'] / onnx['batch_cpu_ms']:.1f}x less than `SentenceTransformer.encode` on PyTorch "
        f"in float32 ({reference['single_cpu_ms']:.1f} and {reference['batch_cpu_ms']:.1f} ms), with its vectors "
        f"(gap {onnx['gap_max']:.0e}, drift at most {onnx['drift_max']:.4f}).",
        "- **What would go further**: 32 concurrent lookups within 50 ms need more than one core for the "
        "embedder, a much smaller encoder, or both; a quantised encoder would move the vectors, and the verifier "
        "would have to be retrained on them first.",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--real", type=int, default=3000, help="held-out pairs whose questions are used")
    parser.add_argument("--core", type=int, default=None, help="CPU to pin to (default: the last one)")
    parser.add_argument("--pairs", default=None, help="qqp_val.csv (default: shared/data)")
    parser.add_argument("--component-samples", type=int, default=200)
    parser.add_argument(
        "--lookups-scale",
        type=float,
        default=1.0,
        help="timed lookups per level, relative to the default (a smoke run)",
    )
    parser.add_argument("--no-variants", dest="variants", action="store_false", help="skip timing the model alone")
    parser.add_argument("--out", type=Path, default=RESULTS / "cache-speed.md")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    result["arguments"] = "".join(f" {word}" for word in (sys.argv[1:] if argv is None else argv))
    write_report(result, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
