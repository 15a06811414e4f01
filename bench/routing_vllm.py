"""Prefix-aware routing on real vLLM under KV pressure: each replica's own prefix-cache hit rate per policy.

The regime where routing matters on a GPU fleet: many chat requests behind a few dozen
long shared system prompts, on replicas whose KV cache holds only part of them (by default
60% of the prompts' tokens each: less than the working set, more than half of it). A
router that splits the prompts between the replicas keeps each one's share cached; one
that spreads every prompt over every replica makes them all thrash.

Two CPU vLLM replicas of the tiny test model (``scripts/build_tiny_model.py``), started by
the gateway's own launcher (``replicas.fleet.Fleet``) with ``--enable-prefix-caching`` and
``--num-gpu-blocks-override`` sized from the workload; gateway processes (``fleetgate
serve``) in front of them as ``url:`` replicas, so that two gateway pods can share them.
Rows, each on caches emptied first (vLLM's ``/reset_prefix_cache``), all sending the same
requests in the same order from a closed loop of ``concurrency`` clients:

- ``prefix_affinity`` (the default) with one gateway pod, and with two, the client
  alternating between them;
- ``round_robin`` and ``least_requests`` through one gateway pod;
- ``client_hash``: the client sends each request straight to the replica an MD5 of its
  system prompt picks (no gateway): the reference a router has to match.

The judge is vLLM's own ``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``
(tokens), per row and per quarter of the row's requests; the client measures time to first
token (the first streamed chunk with a choice, as vLLM's benchmark client does) and
errors. ``--engine sim`` runs the same workload on the simulator (``engine: sim``, the H100
profile with the same block size and the same KV share), for the comparison table of
``bench/results/routing-vllm.md``; the default runs both.

A second workload, ``--workload multiturn`` (``bench/routing_conversations.py``): chats of
4-6 turns behind 16 system prompts of Zipf popularity, each turn resending the history
with the replica's own answers; ``concurrency`` conversations at a time in a closed loop, a
conversation's turns in sequence. It adds a ``session_hash`` row (the client hashes the
conversation's id: vllm-router's ``consistent_hash`` on a session header) and judges the
spread too: the share of requests the busiest replica served, counted by each replica's own
``vllm:request_success_total``. Its replicas are pinned one per core
(``VLLM_CPU_OMP_THREADS_BIND`` 0 and 1, ``--cores per-replica``), gateways and client
sharing the cores with them, as the measurement this workload reproduces ran.

    .venv/bin/python bench/routing_vllm.py              # both engines, 3 prompt sets
    .venv/bin/python bench/routing_vllm.py --quick      # one prompt set, 120 requests
    .venv/bin/python bench/routing_vllm.py --workload multiturn --engine vllm --conversations 240
    .venv/bin/python bench/routing_vllm.py --workload uniform,multiturn
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import orjson
import pydantic
import yaml

from bench.routing_conversations import Conversations, ConversationSpec, build_conversations, stable_hash, turn_messages
from bench.routing_fleet import ADMIN_KEY, MODEL, FleetSpec, PolicyFleet, TenantSpec
from bench.soak import cpu_name
from capacity.loadgen import StreamError, stream_chunks
from gateway.exchange import REPLICA_HEADER
from gateway.settings import HealthSettings, ModelSettings, ReplicaSettings, RestartSettings, SimSettings
from replicas.config import EventsEndpoint
from replicas.fleet import Fleet
from replicas.health import parse_vllm_metrics
from replicas.launcher import group_members
from replicas.replica import GAUGE_KV_CAPACITY_TOKENS
from routing.config import AffinitySettings
from sim.engine import CHARS_PER_TOKEN

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
VLLM_PYTHON = Path(os.environ.get("FLEETGATE_VLLM_VENV", str(ROOT / ".venv-vllm"))) / "bin" / "python"
MODEL_DIR = ROOT / ".cache" / "tiny-llama"
CORPUS_DIR = Path("/usr/share/common-licenses")
TENANT = TenantSpec("bench", "sk-routing-vllm-bench")
ROWS = ("prefix_affinity", "prefix_affinity x2", "round_robin", "least_requests", "client_hash")
# The multi-turn workload's rows; ``session_hash`` sends a conversation to the replica an MD5
# of its id picks (no gateway), as vllm-router's ``consistent_hash`` does with a session header.
SESSION_ROW = "session_hash"
MULTITURN_ROWS = ("prefix_affinity", "prefix_affinity x2", "round_robin", "client_hash", SESSION_ROW)
WORKLOADS = ("uniform", "multiturn")
# Rows on request (``--rows``): ``events`` (and ``events x2``) is ``prefix_affinity`` with the
# replicas' KV-cache events read into the gateway's exact index (the replicas publish, the
# gateway has the model's tokenizer); ``infinite_cache`` sends every request to one more vLLM
# replica whose cache holds the whole workload: the hit rate no routing can beat.
EVENTS_ROW = "events"
IDEAL_ROW = "infinite_cache"
EXTRA_ROWS = (EVENTS_ROW, f"{EVENTS_ROW} x2", IDEAL_ROW)
# The infinite-cache replica's KV: 4,096 blocks of 128 tokens, more than any workload here
# sends in all (the tiny model's 512 bytes a token: 256 MiB).
IDEAL_BLOCKS = 4096
EXTRA_ROWS_METHOD = (
    "`events` (`x2`): `prefix_affinity` gateways given the model's tokenizer and each replica's KV-event "
    "endpoints (`kv_events`, `kv_events_replay`; the replicas launched publishing), each pod waiting until its "
    "index is exact for every replica before the row (a one-token request per replica after the reset publishes "
    "the reset's clear). `infinite_cache`: every request to one more vLLM replica with "
    f"{IDEAL_BLOCKS:,} blocks, idle until its row. **Per gateway pod**: the cached prompt tokens over the prompt "
    "tokens of the answers the pod returned (vLLM's usage, `--enable-prompt-tokens-details`). **Moved (split)**: "
    "conversations whose turns went to more than one replica (of those, the ones that went back to a replica "
    "they had left)."
)
DEFAULT_ROW = "prefix_affinity"
REFERENCE_ROW = "client_hash"
# vLLM's CPU backend allocates KV in blocks of 128 tokens; the simulator is given the same.
BLOCK_SIZE = 128
# Long enough for a prompt of the workload plus its answer; vLLM needs a cache of at least
# one such sequence (16 blocks).
MAX_MODEL_LEN = 2048
# As the end-to-end tests run vLLM: --enforce-eager skips a torch.compile warm-up whose
# cache does not load back on CPU.
VLLM_ARGS = [
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--dtype",
    "bfloat16",
    "--enforce-eager",
    "--enable-prefix-caching",
    # Each answer's usage says how many of its prompt tokens were cached: a gateway pod's own
    # hit rate, where two pods share the replicas.
    "--enable-prompt-tokens-details",
]
SIM_PROFILE = "h100-llama-3.1-8b"
REPLICA_START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
# Requests sent straight to the replicas before the first row (not measured).
WARM_UP_REQUESTS = 64
RESET_TIMEOUT_S = 30.0
EXACT_TIMEOUT_S = 30.0
SCRAPE_TIMEOUT_S = 10.0
# The bars of the routing issue, all measured in one run.
HIT_RATE_MARGIN = 0.03
TTFT_RATIO_BAR = 1.1
# The multi-turn workload's bars: the hash's hit rate within 0.02, and no replica serving
# more than 60% of the requests (with two replicas: a 60/40 split at worst).
MULTITURN_HIT_RATE_MARGIN = 0.02
MAX_SHARE_BAR = 0.6
# The KV-events bars: the events rows' hit rate at least the estimate's and the client
# hash's, within 0.02 of the infinite cache's; two pods within 0.005 of each other.
IDEAL_MARGIN = 0.02
PODS_MARGIN = 0.005
# vLLM's count of finished requests, labelled by finish reason (summed over the labels).
REQUESTS_METRIC = "vllm:request_success_total"


@dataclass(frozen=True)
class BenchConfig:
    """One run: the workload, the fleet and which rows to play."""

    engine: str = "vllm"
    replicas: int = 2
    prompts: int = 32
    prompt_tokens: int = 1400
    user_words: int = 12
    max_tokens: int = 16
    requests: int = 400
    concurrency: int = 8
    kv_share: float = 0.6
    seeds: tuple[int, ...] = (1, 2, 3)
    rows: tuple[str, ...] = ROWS
    # "uniform": independent requests, each drawing its system prompt uniformly;
    # "multiturn": conversations (``bench/routing_conversations.py``), ``concurrency`` at a time.
    workload: str = "uniform"
    conversations: int = 480
    min_turns: int = 4
    max_turns: int = 6
    zipf_s: float = 1.1
    # vLLM's cores: "apart" (every engine on the cores after the first, the gateways and the
    # client on the first) or "per-replica" (replica i's threads bound to core i).
    cores: str = "apart"
    # Blocks of KV per replica; None sizes them from the workload (``kv_share``).
    kv_blocks: int | None = None
    # The gateway rows' ``routing.affinity`` settings beyond the defaults (``--affinity``).
    affinity: tuple[tuple[str, Any], ...] = ()

    def conversation_spec(self) -> ConversationSpec:
        return ConversationSpec(
            self.prompts,
            self.prompt_tokens,
            self.user_words,
            self.conversations,
            self.min_turns,
            self.max_turns,
            self.zipf_s,
        )


# The multi-turn workload as measured beside vllm-router (docs/routing.md): 16 system prompts,
# 480 conversations of 4-6 turns (~2,400 requests), 12 at a time; one set. Sized for the
# tiny model's 2,048-token context: a sixth turn carries the 1,200-token prompt, five
# exchanges (a 12-word message, a 48-token answer, which the tokenizer may cut into a few
# more tokens when the text comes back) and its own message, ~1,800 tokens. KV of 140
# blocks per replica (17,920 tokens): less than the 16 prompts' 19,200, as in that
# measurement (20,480 tokens against prompts of its own size).
MULTITURN = BenchConfig(
    workload="multiturn",
    prompts=16,
    prompt_tokens=1200,
    max_tokens=48,
    concurrency=12,
    seeds=(1,),
    rows=MULTITURN_ROWS,
    cores="per-replica",
    kv_blocks=140,
)


# --- the workload (pure) ---------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """System prompts and the request stream: (index of the system prompt, user turn) in sending order."""

    systems: tuple[str, ...]
    requests: tuple[tuple[int, str], ...]
    tokens: int  # the system prompts' tokens, all together: the working set


def vocabulary() -> list[str]:
    """Words to write prompts with: the licence texts the tiny model's tokenizer was trained on."""
    words: set[str] = set()
    if CORPUS_DIR.is_dir():
        for path in sorted(CORPUS_DIR.iterdir()):
            with contextlib.suppress(OSError, UnicodeDecodeError):
                words.update(re.findall(r"[a-z]{3,12}", path.read_text().lower()))
    if len(words) < 200:  # no corpus here: pronounceable made-up words
        rng = random.Random(0)
        syllables = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
        words = {"".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(2000)}
    return sorted(words)


def build_workload(
    config: BenchConfig, seed: int, words: Sequence[str], cut: Callable[[list[str]], tuple[list[str], int]]
) -> Workload:
    """Seeded system prompts, each cut to ``prompt_tokens`` tokens by ``cut``, and the request stream.

    ``cut(texts) -> (texts cut to prompt_tokens tokens each, their tokens in all)`` is the
    engine's tokenizer. Every request draws its system prompt uniformly: the whole working set
    stays in use for the whole run.
    """
    rng = random.Random(f"routing-vllm:{seed}")
    drafts = [
        f"System prompt {i} of set {seed}. " + " ".join(rng.choices(words, k=config.prompt_tokens * 2))
        for i in range(config.prompts)
    ]
    systems, tokens = cut(drafts)
    stream = tuple(
        (rng.randrange(config.prompts), f"Request {n}: " + " ".join(rng.choices(words, k=config.user_words)) + "?")
        for n in range(config.requests)
    )
    return Workload(tuple(systems), stream, tokens)


def hf_cutter(model_dir: Path, prompt_tokens: int) -> Callable[[list[str]], tuple[list[str], int]]:
    """Cut texts with the served model's own tokenizer (run in the vLLM environment, which has it)."""

    def cut(texts: list[str]) -> tuple[list[str], int]:
        script = (
            "import json, sys\n"
            "from tokenizers import Tokenizer\n"
            "t = Tokenizer.from_file(sys.argv[1])\n"
            "n = int(sys.argv[2])\n"
            "out = []\n"
            "for text in json.load(sys.stdin):\n"
            "    enc = t.encode(text, add_special_tokens=False)\n"
            "    end = enc.offsets[min(n, len(enc.ids)) - 1][1]\n"
            "    out.append([text[:end], min(n, len(enc.ids))])\n"
            "json.dump(out, sys.stdout)\n"
        )
        done = subprocess.run(
            [str(VLLM_PYTHON), "-c", script, str(model_dir / "tokenizer.json"), str(prompt_tokens)],
            input=json.dumps(texts),
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        pairs = json.loads(done.stdout)
        return [p[0] for p in pairs], sum(p[1] for p in pairs)

    return cut


def sim_cutter(prompt_tokens: int) -> Callable[[list[str]], tuple[list[str], int]]:
    """The simulator's tokenizer: ``CHARS_PER_TOKEN`` characters a token."""

    def cut(texts: list[str]) -> tuple[list[str], int]:
        out = [t[: prompt_tokens * CHARS_PER_TOKEN] for t in texts]
        return out, sum(-(-len(t) // CHARS_PER_TOKEN) for t in out)

    return cut


def kv_blocks(config: BenchConfig, working_set_tokens: int) -> int:
    """Blocks per replica: ``kv_blocks``, else ``kv_share`` of the working set; at least one full sequence."""
    if config.kv_blocks is not None:
        return max(config.kv_blocks, -(-MAX_MODEL_LEN // BLOCK_SIZE))
    return max(math.ceil(config.kv_share * working_set_tokens / BLOCK_SIZE), -(-MAX_MODEL_LEN // BLOCK_SIZE))


def client_hash(system: str, replicas: int) -> int:
    """The reference router: an MD5 of the system prompt, modulo the replicas."""
    return stable_hash(system, replicas)


# --- results (pure) ---------------------------------------------------------------------------


@dataclass
class RowResult:
    """One row of one prompt set: what vLLM counted and what the client saw."""

    row: str
    seed: int
    hit_rate: float
    quarters: list[float]
    ttft_s: list[float] = field(repr=False)
    errors: int
    per_replica: dict[str, float]
    seconds: float
    # The gateway pods' routing decisions by reason (fleetgate_routing_decisions_total).
    decisions: dict[str, float] = field(default_factory=dict)
    # How many runs of the row this merges (the reference runs twice per set: ``merge``).
    runs: int = 1
    # Requests each replica served over the row: its own ``vllm:request_success_total``, or
    # where a replica has no such counter (the simulator) what the client saw (the replica it
    # sent to, or the gateway's ``x-fleetgate-replica``). ``split_source`` says which.
    requests_per_replica: dict[str, float] = field(default_factory=dict)
    split_source: str = "vllm"
    # Each gateway pod's own hit rate (pod0, pod1...): the cached prompt tokens over the prompt
    # tokens of the answers it returned (vLLM's usage); empty for rows without a gateway.
    per_pod: dict[str, float] = field(default_factory=dict)
    # Multi-turn: conversations whose turns went to more than one replica (moved), and those
    # that went back to a replica they had left (split: two pods disagreeing, or a spill undone).
    moved: int | None = None
    split: int | None = None

    @property
    def max_share(self) -> float:
        """The busiest replica's share of the row's requests."""
        total = sum(self.requests_per_replica.values())
        return max(self.requests_per_replica.values()) / total if total > 0 else math.nan

    @property
    def ttft_p50(self) -> float:
        return percentile(self.ttft_s, 50)

    @property
    def ttft_p95(self) -> float:
        return percentile(self.ttft_s, 95)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        del out["ttft_s"]
        out["ttft_p50_s"], out["ttft_p95_s"], out["requests"] = self.ttft_p50, self.ttft_p95, len(self.ttft_s)
        out["max_share"] = self.max_share
        return out


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def merge(runs: Sequence[RowResult]) -> RowResult:
    """Runs of one row of one set as one: every request's TTFT, the hit rates' means, errors summed."""
    first = runs[0]
    if len(runs) == 1:
        return first
    return RowResult(
        first.row,
        first.seed,
        statistics.fmean(r.hit_rate for r in runs),
        [statistics.fmean(q) for q in zip(*(r.quarters for r in runs), strict=True)],
        [t for r in runs for t in r.ttft_s],
        sum(r.errors for r in runs),
        {k: statistics.fmean(r.per_replica[k] for r in runs) for k in first.per_replica},
        sum(r.seconds for r in runs),
        first.decisions,
        sum(r.runs for r in runs),
        {k: statistics.fmean(r.requests_per_replica.get(k, 0.0) for r in runs) for k in first.requests_per_replica},
        first.split_source,
        first.per_pod,
        None if first.moved is None else max(r.moved or 0 for r in runs),
        None if first.split is None else max(r.split or 0 for r in runs),
    )


def row_order(rows: Sequence[str], k: int) -> list[str]:
    """Set ``k``'s order: the others alternating forwards and backwards, the reference first and last.

    The machine's load drifts over a set's rows; bracketing the others with the reference
    weighs it the same at both ends, so a drift favours neither side of the TTFT ratio.
    """
    others = [r for r in rows if r != REFERENCE_ROW]
    if k % 2:
        others.reverse()
    if REFERENCE_ROW not in rows:
        return others
    return [REFERENCE_ROW, *others, REFERENCE_ROW] if others else [REFERENCE_ROW]


# One reading of a replica's counters: (prefix-cache queries, prefix-cache hits, requests
# finished), the last NaN where the replica does not count them.
Reading = dict[str, tuple[float, float, float]]


def hit_rate(before: Reading, after: Reading) -> float:
    """Prefix-cache hits over queries (tokens) between two readings of every replica's counters."""
    queries = sum(after[r][0] - before[r][0] for r in after)
    hits = sum(after[r][1] - before[r][1] for r in after)
    return hits / queries if queries > 0 else math.nan


def requests_served(before: Reading, after: Reading, urls: Sequence[str]) -> dict[str, float] | None:
    """Requests each replica (``r0``, ``r1``...) finished between two readings; None if one has no counter."""
    out = {f"r{k}": after[u][2] - before[u][2] for k, u in enumerate(urls)}
    return None if any(math.isnan(v) for v in out.values()) else out


def _by_seed(results: Sequence[RowResult]) -> dict[int, dict[str, RowResult]]:
    """The rows of each prompt set, by name."""
    by_seed: dict[int, dict[str, RowResult]] = {}
    for r in results:
        by_seed.setdefault(r.seed, {})[r.row] = r
    return by_seed


def events_verdicts(results: Sequence[RowResult]) -> list[tuple[str, str, str, bool]]:
    """The KV-events rows' bars, per set: at least the estimate's and the client hash's hit
    rate, within ``IDEAL_MARGIN`` of the infinite cache's; two pods alike; no split conversation."""
    out: list[tuple[str, str, str, bool]] = []
    for seed, rows in sorted(_by_seed(results).items()):
        one, two = rows.get(EVENTS_ROW), rows.get(f"{EVENTS_ROW} x2")
        for name, row in ((EVENTS_ROW, one), (f"{EVENTS_ROW} x2", two)):
            if row is None:
                continue
            # At least the estimate's and the hash's; within a margin of the ideal's.
            for other, margin in ((DEFAULT_ROW, 0.0), (REFERENCE_ROW, 0.0), (IDEAL_ROW, IDEAL_MARGIN)):
                ref = rows.get(other)
                if ref is not None:
                    out.append(
                        (
                            f"set {seed}: {name} hit rate",
                            f">= {other}'s" + (f" - {margin}" if margin else ""),
                            f"{row.hit_rate:.3f} vs {ref.hit_rate:.3f} ({row.hit_rate - ref.hit_rate:+.3f})",
                            row.hit_rate >= ref.hit_rate - margin,
                        )
                    )
            out.append((f"set {seed}: {name} errors", "0", str(row.errors), row.errors == 0))
        if one is not None and two is not None:
            out.append(
                (
                    f"set {seed}: {EVENTS_ROW} x2 against one pod",
                    f"hit rates within {PODS_MARGIN}",
                    f"{two.hit_rate:.3f} vs {one.hit_rate:.3f}",
                    abs(two.hit_rate - one.hit_rate) <= PODS_MARGIN,
                )
            )
            pods = [v for v in two.per_pod.values() if not math.isnan(v)]
            if len(pods) == 2:
                out.append(
                    (
                        f"set {seed}: {EVENTS_ROW} x2 pod against pod",
                        f"hit rates within {PODS_MARGIN} (cached prompt tokens, vLLM's usage)",
                        " vs ".join(f"{v:.3f}" for v in pods),
                        abs(pods[0] - pods[1]) <= PODS_MARGIN,
                    )
                )
            if two.split is not None:
                out.append(
                    (
                        f"set {seed}: {EVENTS_ROW} x2 split conversations",
                        "0 (turns back on a replica they had left)",
                        f"{two.split} ({two.moved} moved)",
                        two.split == 0,
                    )
                )
    return out


def multiturn_verdicts(results: Sequence[RowResult]) -> list[tuple[str, str, str, bool]]:
    """The multi-turn workload's bars, per conversation set: hit rate, spread, errors."""
    out: list[tuple[str, str, str, bool]] = []
    by_seed = _by_seed(results)
    for seed, rows in sorted(by_seed.items()):
        ref = rows.get(REFERENCE_ROW)
        for name in (DEFAULT_ROW, f"{DEFAULT_ROW} x2"):
            row = rows.get(name)
            if row is None:
                continue
            if ref is not None:
                out.append(
                    (
                        f"set {seed}: {name} hit rate",
                        f">= client hash - {MULTITURN_HIT_RATE_MARGIN}",
                        f"{row.hit_rate:.3f} vs {ref.hit_rate:.3f}",
                        row.hit_rate >= ref.hit_rate - MULTITURN_HIT_RATE_MARGIN,
                    )
                )
            split = "/".join(f"{v:.0f}" for v in row.requests_per_replica.values())
            out.append(
                (
                    f"set {seed}: {name} busiest replica",
                    f"<= {MAX_SHARE_BAR:.0%} of requests",
                    f"{row.max_share:.1%} ({split})",
                    row.max_share <= MAX_SHARE_BAR,
                )
            )
            out.append((f"set {seed}: {name} errors", "0", str(row.errors), row.errors == 0))
    return out + events_verdicts(results)


def verdicts(results: Sequence[RowResult]) -> list[tuple[str, str, str, bool]]:
    """The bars, per prompt set: (bar, what it asks, what was measured, passed)."""
    out: list[tuple[str, str, str, bool]] = []
    by_seed = _by_seed(results)
    for seed, rows in sorted(by_seed.items()):
        ref = rows.get(REFERENCE_ROW)
        for name in (DEFAULT_ROW, f"{DEFAULT_ROW} x2"):
            row = rows.get(name)
            if row is None or ref is None:
                continue
            out.append(
                (
                    f"set {seed}: {name} hit rate",
                    f">= client hash - {HIT_RATE_MARGIN}",
                    f"{row.hit_rate:.3f} vs {ref.hit_rate:.3f}",
                    row.hit_rate >= ref.hit_rate - HIT_RATE_MARGIN,
                )
            )
            first, last = row.quarters[0], row.quarters[-1]
            out.append(
                (
                    f"set {seed}: {name} steady",
                    f"last quarter >= first - {HIT_RATE_MARGIN}",
                    f"{last:.3f} vs {first:.3f}",
                    last >= first - HIT_RATE_MARGIN,
                )
            )
            out.append((f"set {seed}: {name} errors", "0", str(row.errors), row.errors == 0))
    # TTFT over every set's requests: one row's p50 moves by 10-15% from one run to the next
    # with the machine's load, as much as the bar's margin, so a set alone cannot judge it.
    ref_ttft = [t for rows in by_seed.values() if REFERENCE_ROW in rows for t in rows[REFERENCE_ROW].ttft_s]
    for name in (DEFAULT_ROW, f"{DEFAULT_ROW} x2"):
        sets = [rows for rows in by_seed.values() if name in rows and REFERENCE_ROW in rows]
        if not sets:
            continue
        ttft = [t for rows in sets for t in rows[name].ttft_s]
        p50, ref_p50 = percentile(ttft, 50), percentile(ref_ttft, 50)
        per_set = ", ".join(f"{rows[name].ttft_p50 / rows[REFERENCE_ROW].ttft_p50:.2f}" for rows in sets)
        out.append(
            (
                f"all sets: {name} TTFT p50",
                f"<= {TTFT_RATIO_BAR}x client hash's",
                f"{p50 * 1000:.0f} ms vs {ref_p50 * 1000:.0f} ms ({p50 / ref_p50:.2f}x; per set {per_set})",
                p50 <= TTFT_RATIO_BAR * ref_p50,
            )
        )
    return out + events_verdicts(results)


# --- the edge: replicas, gateways, the client ---------------------------------------------------


def replica_models(config: BenchConfig, blocks: int, model_dir: Path, count: int | None = None) -> list[ModelSettings]:
    """The replicas as the gateway's launcher takes them: one per core for vLLM (``count``
    of them; default the configuration's)."""
    count = config.replicas if count is None else count
    if config.engine == "sim":
        sim = ReplicaSettings(
            engine="sim",
            count=count,
            sim=SimSettings(profile=SIM_PROFILE),
            args=["--num-gpu-blocks-override", str(blocks), "--block-size", str(BLOCK_SIZE)],
        )
        return [ModelSettings(name=MODEL, replicas=[sim])]
    engine_cores = split_cores()[1] if config.cores == "apart" else sorted(os.sched_getaffinity(0))
    replicas = [
        ReplicaSettings(
            engine="vllm",
            python=str(VLLM_PYTHON),
            model_path=str(model_dir),
            args=[*VLLM_ARGS, "--num-gpu-blocks-override", str(blocks)],
            env={
                "HF_HUB_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                # "apart": every engine on the cores after the first (both on core 1 of two);
                # "per-replica": replica i on core i.
                "VLLM_CPU_OMP_THREADS_BIND": str(engine_cores[i % len(engine_cores)]),
                # For /reset_prefix_cache between rows.
                "VLLM_SERVER_DEV_MODE": "1",
            },
        )
        for i in range(count)
    ]
    return [ModelSettings(name=MODEL, replicas=replicas)]


def split_cores() -> tuple[list[int], list[int]]:
    """(the gateway's and the client's cores, the engines' cores): the first core, then the rest.

    On a GPU host the engines compute on GPUs and the gateway has its CPU to itself. CPU vLLM
    computes on CPU cores, and a gateway sharing them waits for CPU behind busy engines: the
    TTFT of every gateway row would then measure the machine, not the routing. Engines get the
    other cores (all of them, on a machine with one), the gateways and the client the first.
    """
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[:1], (cpus[1:] or cpus)


def pin_process_groups(pgids: Sequence[int], cpus: Sequence[int]) -> int:
    """Move every thread of every process in ``pgids`` onto ``cpus``; how many threads moved."""
    moved = 0
    for pgid in pgids:
        for member in group_members(pgid):
            with contextlib.suppress(OSError, ValueError):  # gone meanwhile
                moved += pin_threads(Path(f"/proc/{member.pid}"), cpus)
    return moved


def pin_threads(process: Path, cpus: Sequence[int]) -> int:
    """Move every thread of the process at ``process`` (a /proc entry) onto ``cpus``."""
    tasks = list((process / "task").iterdir())
    for task in tasks:
        os.sched_setaffinity(int(task.name), set(cpus))
    return len(tasks)


@contextlib.contextmanager
def engines_apart(pgids: Sequence[int], log: Callable[[str], None]) -> Iterator[None]:
    """The engines (process groups ``pgids``) on their cores; this process, the client, on the first.

    The gateways this process starts meanwhile inherit its core. Its own CPUs come back after.
    """
    front, engines = split_cores()
    before = sorted(os.sched_getaffinity(0))
    moved = pin_process_groups(pgids, engines)
    pin_threads(Path("/proc/self"), front)
    log(f"[vllm] engines on cores {engines} ({moved} threads), gateways and client on {front}")
    try:
        yield
    finally:
        pin_threads(Path("/proc/self"), before)


def thread_cores(pgids: Sequence[int]) -> list[dict[str, int]]:
    """Per process group (a replica): how many of its threads may run on each core, as the kernel says.

    What ``VLLM_CPU_OMP_THREADS_BIND`` did: vLLM's compute threads bound to the replica's core,
    its other threads (the API server, tokenizers) left free to run anywhere.
    """
    out: list[dict[str, int]] = []
    for pgid in pgids:
        counts: dict[str, int] = {}
        for member in group_members(pgid):
            with contextlib.suppress(OSError, ValueError):
                for task in Path(f"/proc/{member.pid}/task").iterdir():
                    allowed = ",".join(map(str, sorted(os.sched_getaffinity(int(task.name)))))
                    counts[allowed] = counts.get(allowed, 0) + 1
        out.append(dict(sorted(counts.items())))
    return out


def build_tiny_model() -> Path:
    done = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "scripts" / "build_tiny_model.py"), "--out", str(MODEL_DIR)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=True,
    )
    return Path(done.stdout.strip().splitlines()[-1])


async def counters(session: aiohttp.ClientSession, urls: Sequence[str]) -> Reading:
    """Each replica's (prefix-cache queries, hits, requests finished) counters."""
    out: Reading = {}
    for url in urls:
        text = await scrape_text(session, url)
        gauges = parse_vllm_metrics(text)
        out[url] = (
            gauges.get("vllm:prefix_cache_queries_total", 0.0),
            gauges.get("vllm:prefix_cache_hits_total", 0.0),
            requests_finished(text),
        )
    return out


_REQUESTS = re.compile(rf"^{re.escape(REQUESTS_METRIC)}(?:\{{[^}}]*\}})? (\S+)$", re.MULTILINE)


def requests_finished(metrics_text: str) -> float:
    """``vllm:request_success_total`` summed over its labels (finish reasons); NaN when absent."""
    values = _REQUESTS.findall(metrics_text)
    return sum(float(v) for v in values) if values else math.nan


async def scrape_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as resp:
        resp.raise_for_status()
        return await resp.text()


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    return parse_vllm_metrics(await scrape_text(session, url))


_DECISION = re.compile(r'^fleetgate_routing_decisions_total\{[^}]*reason="([^"]+)"[^}]*\} (\S+)$', re.MULTILINE)


async def decisions(session: aiohttp.ClientSession, gateway_url: str) -> dict[str, float]:
    """A gateway's routing decisions by reason, from its /metrics (empty when it does not answer)."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with session.get(
            f"{gateway_url}/metrics", headers=headers, timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        ) as resp:
            if resp.status == 200:
                out: dict[str, float] = {}
                for reason, value in _DECISION.findall(await resp.text()):
                    out[reason] = out.get(reason, 0.0) + float(value)
                return out
    return {}


async def reset_caches(session: aiohttp.ClientSession, urls: Sequence[str]) -> None:
    """Empty every replica's prefix cache (retried while a request still holds blocks)."""
    deadline = time.monotonic() + RESET_TIMEOUT_S
    for url in urls:
        while True:
            async with session.post(f"{url}/reset_prefix_cache", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                ok = resp.status == 200 and (await resp.json(content_type=None)).get("success", True)
            if ok:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}: the prefix cache would not reset")
            await asyncio.sleep(0.2)


async def publish_clears(session: aiohttp.ClientSession, urls: Sequence[str]) -> None:
    """Have each replica run one scheduler step, so that its reset's ``AllBlocksCleared``
    (queued until the engine's next step) is published before a gateway pod subscribes: the
    pod's replay then holds it, and the pod's index is exact from it on (``routing.kv_index``)."""
    body = orjson.dumps({"model": MODEL, "prompt": "ok", "max_tokens": 1})
    for url in urls:
        async with session.post(
            f"{url}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
        ) as resp:
            resp.raise_for_status()
            await resp.read()


async def wait_exact(session: aiohttp.ClientSession, gateway_url: str, replicas: int) -> None:
    """Wait until the gateway pod's index is exact for every replica (``/admin/fleet``'s ``kv_events``)."""
    deadline = time.monotonic() + EXACT_TIMEOUT_S
    state: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with session.get(
                f"{gateway_url}/admin/fleet",
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S),
            ) as resp:
                state = (await resp.json()).get("kv_events") or {}
            if len(state) == replicas and all(s.get("exact") for s in state.values()):
                return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{gateway_url}: the KV-events index is not exact after {EXACT_TIMEOUT_S:.0f} s: {state}")


async def stream_one(
    session: aiohttp.ClientSession, url: str, api_key: str | None, system: str, user: str, max_tokens: int
) -> float:
    """Send one streamed chat request; seconds to its first chunk with a choice. Raises on any failure."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return (await stream_chat(session, url, api_key, messages, max_tokens)).ttft_s


@dataclass(frozen=True)
class Answer:
    """What the client saw of one streamed request."""

    ttft_s: float
    text: str
    replica: str | None  # the gateway's ``x-fleetgate-replica``, when a gateway answered
    # The answer's usage: prompt tokens, and how many of them the replica had cached.
    prompt_tokens: int = 0
    cached_tokens: int = 0


async def stream_chat(
    session: aiohttp.ClientSession, url: str, api_key: str | None, messages: list[dict[str, str]], max_tokens: int
) -> Answer:
    """Send one streamed chat request; what came back. Raises on any failure."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    start = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    async with session.post(
        f"{url}/v1/chat/completions",
        data=orjson.dumps(body),
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
    ) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.content.read(500)).decode(errors='replace')}")
        replica = resp.headers.get(REPLICA_HEADER)
        try:
            async for chunk in stream_chunks(resp.content):
                usage = chunk.get("usage") or usage
                choices = chunk.get("choices")
                if first is None and choices:
                    first = time.perf_counter() - start
                for choice in choices or ():
                    parts.append((choice.get("delta") or {}).get("content") or "")
        except StreamError as exc:
            raise RuntimeError(f"stream {exc}") from exc
        if first is None:
            raise RuntimeError("the stream ended without a choice")
    details = usage.get("prompt_tokens_details") or {}
    return Answer(
        first, "".join(parts), replica, int(usage.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0)
    )


async def play(
    session: aiohttp.ClientSession,
    workload: Workload,
    config: BenchConfig,
    targets: Callable[[int, int], tuple[str, str | None]],
    replica_urls: Sequence[str],
) -> Played:
    """Send the workload from ``concurrency`` clients; TTFTs, errors, and counters at each quarter.

    ``targets(n, system_index) -> (url, api key)`` says where request ``n`` goes.
    """
    queue = iter(enumerate(workload.requests))
    played = Played(readings=[await counters(session, replica_urls)])
    marks = Marks(len(workload.requests), session, replica_urls)

    async def client() -> None:
        for n, (system_index, user) in queue:
            url, key = targets(n, system_index)
            messages = [
                {"role": "system", "content": workload.systems[system_index]},
                {"role": "user", "content": user},
            ]
            try:
                played.served(url, await stream_chat(session, url, key, messages, config.max_tokens))
            except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as exc:
                played.errors += 1
                print(f"  request {n} failed: {exc}", file=sys.stderr)
            marks.done(1)

    await asyncio.gather(*(client() for _ in range(config.concurrency)))
    played.readings += await marks.readings()
    played.readings.append(await counters(session, replica_urls))
    return played


@dataclass
class Played:
    """What the client saw of a row: TTFTs, errors, counters read at each quarter, where requests went."""

    ttfts: list[float] = field(default_factory=list)
    errors: int = 0
    readings: list[Reading] = field(default_factory=list)
    # Requests answered, by the replica the gateway named (``x-fleetgate-replica``) or else
    # the URL the client sent to.
    tally: dict[str, int] = field(default_factory=dict)
    # Per URL sent to (a gateway pod, or a replica): [prompt tokens, cached prompt tokens].
    tokens: dict[str, list[int]] = field(default_factory=dict)
    # Multi-turn: each conversation's replicas, turn by turn.
    routes: dict[int, list[str]] = field(default_factory=dict)

    def served(self, url: str, answer: Answer, conversation: int | None = None) -> str:
        """Count ``answer``, sent to ``url``; the replica that served it."""
        self.ttfts.append(answer.ttft_s)
        where = answer.replica or url
        self.tally[where] = self.tally.get(where, 0) + 1
        counts = self.tokens.setdefault(url, [0, 0])
        counts[0] += answer.prompt_tokens
        counts[1] += answer.cached_tokens
        if conversation is not None:
            self.routes.setdefault(conversation, []).append(where)
        return where

    def moved_and_split(self) -> tuple[int, int]:
        """Conversations that changed replica, and those that went back to one they had left."""
        moved = split = 0
        for route in self.routes.values():
            visits = [where for where, _ in itertools.groupby(route)]
            moved += len(visits) > 1
            split += len(visits) > len(set(visits))
        return moved, split


class Marks:
    """Reads every replica's counters as the 1st, 2nd and 3rd quarter of ``total`` requests complete."""

    def __init__(self, total: int, session: aiohttp.ClientSession, urls: Sequence[str]) -> None:
        self._left = [total * q // 4 for q in (1, 2, 3)]
        self._completed = 0
        self._session, self._urls = session, urls
        self._scrapes: list[asyncio.Task[Reading]] = []

    def done(self, requests: int) -> None:
        """``requests`` more finished (or were given up: a conversation's turns after a failure)."""
        self._completed += requests
        while self._left and self._completed >= self._left[0]:
            self._left.pop(0)
            self._scrapes.append(asyncio.create_task(counters(self._session, self._urls)))

    async def readings(self) -> list[Reading]:
        return [await task for task in self._scrapes]


async def play_conversations(
    session: aiohttp.ClientSession,
    chats: Conversations,
    config: BenchConfig,
    targets: Callable[[int, int], tuple[str, str | None]],
    replica_urls: Sequence[str],
) -> Played:
    """Play the conversations, ``concurrency`` at a time, each turn after the last one's answer.

    ``targets(n, conversation_index) -> (url, api key)`` says where request ``n`` (in sending
    order) goes. A failed turn ends its conversation: the next turn would need its answer.
    """
    queue = iter(enumerate(chats.conversations))
    played = Played(readings=[await counters(session, replica_urls)])
    marks = Marks(chats.requests, session, replica_urls)
    sent = itertools.count()

    async def client() -> None:
        for c, chat in queue:
            replies: list[str] = []
            for turn in range(len(chat.users)):
                n = next(sent)
                url, key = targets(n, c)
                messages = turn_messages(chats.systems[chat.system], chat.users, replies)
                try:
                    answer = await stream_chat(session, url, key, messages, config.max_tokens)
                except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as exc:
                    played.errors += 1
                    print(f"  {chat.id} turn {turn} failed: {exc}", file=sys.stderr)
                    marks.done(len(chat.users) - turn)
                    break
                played.served(url, answer, c)
                replies.append(answer.text)
                marks.done(1)

    await asyncio.gather(*(client() for _ in range(config.concurrency)))
    played.readings += await marks.readings()
    played.readings.append(await counters(session, replica_urls))
    return played


def gateway_extra(
    config: BenchConfig,
    replica_urls: Sequence[str],
    events: Mapping[str, EventsEndpoint] | None = None,
    tokenizer: Path | None = None,
) -> dict[str, Any]:
    """What a gateway row's configuration sets beyond the benchmark fleet's (``FleetSpec.extra``).

    ``events``: where each replica (by URL) publishes its KV-cache events, for the gateway to
    read them, with the model's ``tokenizer`` (an events row); None: the estimate.
    """
    replicas: list[dict[str, Any]] = []
    for url in replica_urls:
        where = (events or {}).get(url)
        replicas.append(
            {"url": url}
            if where is None
            else {"url": url, "kv_events": where.endpoint, "kv_events_replay": where.replay}
        )
    model: dict[str, Any] = {"name": MODEL, "replicas": replicas}
    if events is not None:
        model["tokenizer"] = str(tokenizer)
    extra: dict[str, Any] = {
        "models": [model],
        # A gateway waiting for CPU behind busy engines must not time out connecting.
        "upstream": {"connect_timeout_s": 15.0},
    }
    if config.affinity:
        extra["routing"] = {"affinity": dict(config.affinity)}
    return extra


async def run_row(
    session: aiohttp.ClientSession,
    row: str,
    seed: int,
    workload: Workload | Conversations,
    config: BenchConfig,
    replica_urls: Sequence[str],
    work_dir: Path,
    events: Mapping[str, EventsEndpoint] | None = None,
    tokenizer: Path | None = None,
) -> RowResult:
    """Play ``workload`` as ``row`` on emptied caches; what the replicas counted and the client saw.

    ``replica_urls``: the replicas the row is judged on (for ``infinite_cache``, its own one);
    ``events``, ``tokenizer``: what an events row's gateways read (``gateway_extra``).
    """
    await reset_caches(session, replica_urls)
    started = time.monotonic()
    reasons: dict[str, float] = {}
    pod_rates: dict[str, float] = {}
    replica_names = {u: f"r{k}" for k, u in enumerate(replica_urls)}

    async def send(targets: Callable[[int, int], tuple[str, str | None]]) -> Played:
        # ``targets(n, i)``: i is the request's system prompt (uniform), its conversation (multi-turn).
        if isinstance(workload, Conversations):
            return await play_conversations(session, workload, config, targets, replica_urls)
        return await play(session, workload, config, targets, replica_urls)

    if row == REFERENCE_ROW:
        homes = [replica_urls[client_hash(s, len(replica_urls))] for s in workload.systems]
        if isinstance(workload, Conversations):
            chats = workload.conversations
            played = await send(lambda n, c: (homes[chats[c].system], None))
        else:
            played = await send(lambda n, i: (homes[i], None))
    elif row == IDEAL_ROW:
        played = await send(lambda n, i: (replica_urls[0], None))
    elif row == SESSION_ROW:
        if not isinstance(workload, Conversations):
            raise ValueError(f"{SESSION_ROW} needs conversations (--workload multiturn)")
        homes = [replica_urls[stable_hash(c.id, len(replica_urls))] for c in workload.conversations]
        played = await send(lambda n, c: (homes[c], None))
    else:
        policy, _, pods = row.partition(" x")
        exact = policy == EVENTS_ROW
        if exact:
            if events is None:
                raise ValueError(f"{row}: the replicas publish no KV events")
            await publish_clears(session, replica_urls)
        spec = FleetSpec(
            policy=DEFAULT_ROW if exact else policy,
            replicas=len(replica_urls),
            tenants=(TENANT,),
            nice=0,
            extra=gateway_extra(config, replica_urls, events if exact else None, tokenizer),
        )
        async with contextlib.AsyncExitStack() as stack:
            gateways = [
                await stack.enter_async_context(PolicyFleet(spec, work_dir / f"{seed}-{row}-pod{i}"))
                for i in range(int(pods or 1))
            ]
            urls = [g.url for g in gateways]
            if exact:
                await wait_exact(session, urls[0], len(replica_urls))
            played = await send(lambda n, i: (urls[n % len(urls)], TENANT.api_key))
            for k, url in enumerate(urls):
                prompt, cached = played.tokens.get(url, [0, 0])
                pod_rates[f"pod{k}"] = cached / prompt if prompt else math.nan
            for gateway in gateways:
                ids = zip(gateway.replica_ids, gateway.replica_urls, strict=True)
                replica_names.update({i: replica_names.get(u.rstrip("/"), u) for i, u in ids})
            for url in urls:
                for reason, count in (await decisions(session, url)).items():
                    reasons[reason] = reasons.get(reason, 0.0) + count
    readings = played.readings
    quarters = [hit_rate(a, b) for a, b in itertools.pairwise(readings)]
    first, last = readings[0], readings[-1]
    per_replica = {f"r{k}": hit_rate({u: first[u]}, {u: last[u]}) for k, u in enumerate(replica_urls)}
    seconds = time.monotonic() - started
    served = requests_served(first, last, replica_urls)
    moved, split = played.moved_and_split() if isinstance(workload, Conversations) else (None, None)
    source = "vllm"
    if served is None:  # no counter on the replicas: what the client saw
        served = {name: 0.0 for name in replica_names.values()}
        for where, count in played.tally.items():
            name = replica_names.get(where, where)
            served[name] = served.get(name, 0.0) + count
        source = "client"
    return RowResult(
        row,
        seed,
        hit_rate(first, last),
        quarters,
        played.ttfts,
        played.errors,
        per_replica,
        seconds,
        reasons,
        requests_per_replica=served,
        split_source=source,
        per_pod=pod_rates,
        moved=moved,
        split=split,
    )


async def run_engine(config: BenchConfig, log: Callable[[str], None]) -> dict[str, Any]:
    """Every prompt set and row on one engine's replicas; a JSON-able summary."""
    model_dir = build_tiny_model() if config.engine == "vllm" else MODEL_DIR
    words = vocabulary()
    cut = hf_cutter(model_dir, config.prompt_tokens) if config.engine == "vllm" else sim_cutter(config.prompt_tokens)
    workloads: dict[int, Workload | Conversations] = {
        seed: build_conversations(config.conversation_spec(), seed, words, cut)
        if config.workload == "multiturn"
        else build_workload(config, seed, words, cut)
        for seed in config.seeds
    }
    working_set = max(w.tokens for w in workloads.values())
    blocks = kv_blocks(config, working_set)
    tag = f"[{config.engine} {config.workload}]"
    log(f"{tag} system prompts {working_set:,} tokens; {blocks} blocks of {BLOCK_SIZE} per replica")
    cores: list[dict[str, int]] = []
    results: list[RowResult] = []
    # The events rows need the replicas publishing (launched so when the gateway's fleet has
    # the model's tokenizer) and the infinite cache its own replica: vLLM only.
    exact = any(r.partition(" x")[0] == EVENTS_ROW for r in config.rows) and config.engine == "vllm"
    ideal = IDEAL_ROW in config.rows and config.engine == "vllm"
    health = HealthSettings(interval_s=0.5, timeout_s=15.0, start_timeout_s=REPLICA_START_TIMEOUT_S)
    with tempfile.TemporaryDirectory(prefix="routing-vllm-") as tmp, contextlib.ExitStack() as pins:
        work = Path(tmp)
        fleet = Fleet(
            replica_models(config, blocks, model_dir),
            health,
            log_dir=work / "replicas",
            restart=RestartSettings(),
            tokenized={MODEL} if exact else (),
        )
        # Started beside the others and idle until its row: it takes the first core.
        big = Fleet(
            replica_models(config, IDEAL_BLOCKS, model_dir, count=1) if ideal else [],
            health,
            log_dir=work / "ideal",
            restart=RestartSettings(),
        )
        async with fleet, big, aiohttp.ClientSession() as session:
            started = time.monotonic()
            for f in (fleet, big) if ideal else (fleet,):
                if not await f.wait_healthy(REPLICA_START_TIMEOUT_S, every=True):
                    raise RuntimeError(f"replicas not healthy after {REPLICA_START_TIMEOUT_S:.0f} s; logs: {work}")
            urls = [r.base_url for r in fleet.all()]
            ideal_urls = [r.base_url for r in big.all()]
            events = {r.base_url: fleet.kv_endpoints[r.id] for r in fleet.all()} if exact else None
            log(f"{tag} {len(urls) + len(ideal_urls)} replicas healthy in {time.monotonic() - started:.0f} s")
            pgids = [r.pid for r in fleet.all() if r.pid is not None]
            if config.engine == "vllm" and config.cores == "apart":
                pins.enter_context(engines_apart(pgids, log))
            if config.engine == "vllm":
                cores = thread_cores(pgids)
                log(f"{tag} threads per allowed cores, per replica: {cores}")
            capacity = [(await scrape(session, u)).get(GAUGE_KV_CAPACITY_TOKENS) for u in urls]
            # A fresh engine's first requests are slow (allocations, first kernels): warm it
            # up, so the first row measured is not the only one to pay for that.
            warm = build_workload(
                dataclasses.replace(config, prompts=config.concurrency, requests=WARM_UP_REQUESTS), 0, words, cut
            )
            everyone = urls + ideal_urls
            warmed = await play(session, warm, config, lambda n, i: (everyone[n % len(everyone)], None), everyone)
            log(f"{tag} warm-up: {len(warmed.ttfts)} requests, {warmed.errors} errors")
            rows = [r for r in config.rows if r not in EXTRA_ROWS or config.engine == "vllm"]
            for k, seed in enumerate(config.seeds):
                runs: dict[str, list[RowResult]] = {}
                for row in row_order(rows, k):
                    judged_on = ideal_urls if row == IDEAL_ROW else urls
                    result = await run_row(
                        session, row, seed, workloads[seed], config, judged_on, work, events, model_dir
                    )
                    runs.setdefault(row, []).append(result)
                    log(
                        f"{tag} set {seed} {row:20s} hit {result.hit_rate:.3f} "
                        f"quarters {' '.join(f'{q:.2f}' for q in result.quarters)} "
                        f"split {_split(result)} "
                        f"TTFT p50 {result.ttft_p50 * 1000:.0f} ms p95 {result.ttft_p95 * 1000:.0f} ms "
                        f"errors {result.errors} ({result.seconds:.0f} s) {_reasons(result.decisions)}"
                    )
                results += [merge(r) for r in runs.values()]
    judged = multiturn_verdicts(results) if config.workload == "multiturn" else verdicts(results)
    return {
        "engine": config.engine,
        "workload": config.workload,
        "config": dataclasses.asdict(config),
        "working_set_tokens": working_set,
        "requests_per_set": {
            str(seed): len(w.requests) if isinstance(w, Workload) else w.requests for seed, w in workloads.items()
        },
        "blocks_per_replica": blocks,
        "kv_capacity_tokens_scraped": capacity,
        "replica_env": [r.env for m in replica_models(config, blocks, model_dir) for r in m.replicas],
        "replica_thread_cores": cores,
        "rows": [r.to_json() for r in results],
        "verdicts": [{"bar": b, "asks": a, "measured": m, "passed": p} for b, a, m, p in judged],
        "_results": results,
    }


# --- the report ---------------------------------------------------------------------------------


def summary_table(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Per row: the hit rate on each engine (median over prompt sets, range) and vLLM's TTFT."""
    engines = [r["engine"] for r in runs]
    lines = [
        "| row | "
        + " | ".join(f"{e}: hit rate (median [min-max])" for e in engines)
        + " | vLLM TTFT p50 / p95 | vLLM busiest replica (max share) | errors |",
        "| --- | " + " | ".join("---:" for _ in engines) + " | ---: | ---: | ---: |",
    ]
    rows = runs[0]["config"]["rows"]
    for row in rows:
        cells = []
        for run in runs:
            rates = [r.hit_rate for r in run["_results"] if r.row == row]
            cells.append(f"{statistics.median(rates):.3f} [{min(rates):.3f}-{max(rates):.3f}]" if rates else "-")
        vllm = next((r for r in runs if r["engine"] == "vllm"), runs[0])
        rs = [r for r in vllm["_results"] if r.row == row]
        ttft = [t for r in rs for t in r.ttft_s]
        errors = sum(r.errors for r in rs)
        shares = [r.max_share for r in rs]
        share = f"{max(shares):.0%}" if shares and not any(math.isnan(x) for x in shares) else "-"
        lines.append(
            f"| {row} | "
            + " | ".join(cells)
            + f" | {percentile(ttft, 50) * 1000:.0f} / {percentile(ttft, 95) * 1000:.0f} ms"
            f" | {share} | {errors} |"
        )
    return lines


def _split(row: RowResult) -> str:
    """Requests per replica and the busiest one's share: ``612/598 (51%)``."""
    counts = "/".join(f"{v:.0f}" for v in row.requests_per_replica.values())
    return f"{counts} ({row.max_share:.0%})" if counts else "-"


def _pods(row: RowResult) -> str:
    """Each gateway pod's hit rate by vLLM's usage: ``pod0 0.912 pod1 0.910``."""
    return " ".join(f"{k} {v:.3f}" for k, v in row.per_pod.items()) or "-"


def _reasons(decisions: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(decisions.items())) or "-"


def detail_table(run: dict[str, Any]) -> list[str]:
    lines = [
        "| set | row | hit rate | by quarter | per replica | per gateway pod | requests per replica (max share) "
        "| TTFT p50 | TTFT p95 | errors | gateway decisions |",
        "| ---: | --- | ---: | --- | --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for r in run["_results"]:
        quarters = " ".join(f"{q:.2f}" for q in r.quarters)
        replicas = " ".join(f"{k} {v:.2f}" for k, v in r.per_replica.items())
        runs = f" ({r.runs} runs)" if r.runs > 1 else ""
        lines.append(
            f"| {r.seed} | {r.row}{runs} | {r.hit_rate:.3f} | {quarters} | {replicas} | {_pods(r)} | {_split(r)} "
            f"| {r.ttft_p50 * 1000:.0f} ms "
            f"| {r.ttft_p95 * 1000:.0f} ms | {r.errors} | {_reasons(r.decisions)} |"
        )
    return lines


def report(runs: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    config = runs[0]["config"]
    out = [
        "# Routing on real vLLM" + (" under KV pressure" if config.get("kv_blocks") is None else ""),
        "",
        f"`{meta['command']}` ({meta['minutes']:.1f} min, {meta['started']}, commit `{meta['commit']}`, "
        f"CPU: {meta['cpu']}).",
        "",
        "## The bars (vLLM)",
        "",
        "| bar | asks | measured | verdict |",
        "| --- | --- | --- | --- |",
    ]
    vllm = next((r for r in runs if r["engine"] == "vllm"), None)
    if vllm is None:
        out.append("| - | - | no vLLM run | - |")
    else:
        for v in vllm["verdicts"]:
            out.append(f"| {v['bar']} | {v['asks']} | {v['measured']} | {'pass' if v['passed'] else '**fail**'} |")
    out += ["", "## Hit rate per row, vLLM beside the simulator", "", *summary_table(runs), ""]
    for run in runs:
        out += [f"## Every row: {run['engine']}", "", *detail_table(run), ""]
    out += [
        "## Method",
        "",
        f"- **Replicas**: {config['replicas']}, started by the gateway's launcher. vLLM: `vllm-cpu` with the tiny "
        f"test model (`scripts/build_tiny_model.py`), `{' '.join(VLLM_ARGS)}`; "
        + (
            "every vLLM thread on the cores after the first (`VLLM_CPU_OMP_THREADS_BIND`, then each thread's CPU "
            "affinity; on a 2-core machine both replicas share core 1), the gateways and the client on the first: "
            "on a GPU host the engines compute on GPUs and leave the gateway its CPU, and on a shared core the "
            "gateway rows' TTFT measured the wait for CPU behind busy engines. "
            if config.get("cores", "apart") == "apart"
            else "replica i's compute threads on core i (`VLLM_CPU_OMP_THREADS_BIND`), the gateways and the "
            "client sharing the cores with them. "
        )
        + f"Simulator: profile `{SIM_PROFILE}` with the same block size. Each run "
        "sizes the KV cache with `--num-gpu-blocks-override` to "
        + (
            f"{config['kv_share']:.0%} of the working set (the largest prompt set's): "
            if config.get("kv_blocks") is None
            else f"`--kv-blocks {config['kv_blocks']}` (the working set is {runs[0]['working_set_tokens']:,} tokens): "
        )
        + "; ".join(
            f"{r['engine']} {r['blocks_per_replica']} blocks of {BLOCK_SIZE} tokens "
            f"(scraped `vllm:cache_config_info`: {r['kv_capacity_tokens_scraped']})"
            for r in runs
        )
        + ".",
        f"- **Workload**: {config['prompts']} system prompts of {config['prompt_tokens']} tokens (the engine's "
        f"tokenizer; words of the licence texts), a {config['user_words']}-word user turn of its own per request, "
        f"{config['max_tokens']} tokens out (`ignore_eos`), streamed; {config['requests']} requests per row, each "
        f"drawing its system prompt uniformly, from {config['concurrency']} clients in a closed loop. Prompt sets "
        f"(seeds) {', '.join(map(str, config['seeds']))}: each set is new text, so the hash splits it anew.",
        f"- **Rows**: after the replicas start, {WARM_UP_REQUESTS} unmeasured requests warm the engines up; "
        "every row starts on emptied prefix caches (`POST /reset_prefix_cache`, vLLM with "
        "`VLLM_SERVER_DEV_MODE=1`) and sends the same requests in the same order; the gateway rows' order "
        "alternates from one set to the next, and `client_hash` runs first and last in every set (its figures "
        "merge both runs: every request's TTFT, the mean hit rate), so a drift of the machine's load over a set "
        "weighs on both sides of the TTFT ratio. Gateway rows: `fleetgate serve` processes with the replicas as "
        "`url:` sources and default settings but `routing.policy`; `x2` is two gateway processes, request n to "
        "pod n mod 2. "
        "`client_hash`: straight to the replica an MD5 of the system prompt picks. " + EXTRA_ROWS_METHOD,
        "- **Hit rate**: the replicas' own `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` (tokens), "
        "deltas over the row, and over each quarter of its requests (read as the 1st, 2nd and 3rd quarter complete). "
        "The first quarter holds every prompt's first, cold request. **TTFT**: client-side, to the first streamed "
        "chunk with a choice. Hit rate, steadiness and errors are judged per prompt set; TTFT p50 over every "
        "set's requests together (one row's p50 moves by 10-15% between runs with the machine's load), with the "
        "per-set ratios alongside.",
        "",
    ]
    return "\n".join(out)


def multiturn_section(runs: Sequence[dict[str, Any]], level: str = "##") -> list[str]:
    """The multi-turn workload's bars, its rows per engine, and how it ran."""
    config = runs[0]["config"]
    out = [f"{level} Multi-turn chat, Zipf-popular system prompts", ""]
    vllm = next((r for r in runs if r["engine"] == "vllm"), None)
    if vllm is not None:
        out += [
            f"{level}# The bars (vLLM)",
            "",
            "| bar | asks | measured | verdict |",
            "| --- | --- | --- | --- |",
            *(
                f"| {v['bar']} | {v['asks']} | {v['measured']} | {'pass' if v['passed'] else '**fail**'} |"
                for v in vllm["verdicts"]
            ),
            "",
        ]
    for run in runs:
        out += [
            f"{level}# Every row: {run['engine']}",
            "",
            "| set | row | hit rate | by quarter | per gateway pod | requests per replica | max share "
            "| conversations moved (split) | TTFT p50 | TTFT p95 | errors | gateway decisions |",
            "| ---: | --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for r in run["_results"]:
            counts = "/".join(f"{v:.0f}" for v in r.requests_per_replica.values())
            source = "" if r.split_source == "vllm" else f" ({r.split_source})"
            runs_note = f" ({r.runs} runs)" if r.runs > 1 else ""
            out.append(
                f"| {r.seed} | {r.row}{runs_note} | {r.hit_rate:.3f} | {' '.join(f'{q:.2f}' for q in r.quarters)} "
                f"| {_pods(r)} | {counts}{source} | {r.max_share:.1%} | {r.moved} ({r.split}) "
                f"| {r.ttft_p50 * 1000:.0f} ms | {r.ttft_p95 * 1000:.0f} ms "
                f"| {r.errors} | {_reasons(r.decisions)} |"
            )
        out.append("")
    requests = ", ".join(f"set {k}: {v:,}" for k, v in runs[0]["requests_per_set"].items())
    pinning = "; ".join(
        f"{r['engine']}: "
        + ", ".join(
            f"r{k} `VLLM_CPU_OMP_THREADS_BIND={e.get('VLLM_CPU_OMP_THREADS_BIND', '-')}`"
            for k, e in enumerate(r["replica_env"])
        )
        + (
            f" (threads per allowed cores, as the kernel reported them: {r['replica_thread_cores']})"
            if r["replica_thread_cores"]
            else ""
        )
        for r in runs
        if r["engine"] == "vllm"
    )
    out += [
        f"{level}# Method (multi-turn)",
        "",
        f"- **Workload** (`bench/routing_conversations.py`): {config['prompts']} system prompts of "
        f"{config['prompt_tokens']} tokens, drawn with Zipf popularity (s = {config['zipf_s']}); "
        f"{config['conversations']} conversations of {config['min_turns']}-{config['max_turns']} turns ({requests} "
        f"requests); each turn resends the system prompt and the whole history, the replica's own earlier answers "
        f"as it returned them included, and adds a {config['user_words']}-word user message; "
        f"{config['max_tokens']} tokens out (`ignore_eos`), streamed. {config['concurrency']} conversations at a "
        "time in a closed loop: a conversation's turns in sequence, the next conversation as one ends.",
        f"- **Replicas**: {config['replicas']}, KV cache of {runs[0]['blocks_per_replica']} blocks of {BLOCK_SIZE} "
        f"tokens each (`--num-gpu-blocks-override`; the system prompts alone are {runs[0]['working_set_tokens']:,} "
        f"tokens). Cores: `{config['cores']}`"
        + (f"; {pinning}" if pinning else "")
        + ". With `per-replica` the gateways and the client share the cores with the engines.",
        "- **Rows**: every row on emptied prefix caches, `client_hash` first and last (merged). "
        "`client_hash`: straight to the replica an MD5 of the system prompt picks; `session_hash`: straight to "
        "the replica an MD5 of the conversation's id picks (vllm-router's `consistent_hash` on a session header). "
        "Gateway rows: `fleetgate serve` processes with the replicas as `url:` sources and default settings but "
        "`routing.policy`"
        + "".join(f", `routing.affinity.{k}: {v}`" for k, v in config.get("affinity") or ())
        + "; `x2` alternates requests between two gateway processes. "
        + EXTRA_ROWS_METHOD,
        f"- **Split**: each replica's own `{REQUESTS_METRIC}` over the row (the simulator has no such counter: "
        "there, what the client saw, marked `(client)`). **Hit rate**: the replicas' own prefix-cache hits over "
        "queries (tokens), over the row and each quarter of its requests. **TTFT**: client-side, to the first "
        "streamed chunk with a choice.",
        "",
    ]
    return out


def multiturn_report(runs: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    out = [
        "# Routing on real vLLM: multi-turn chat",
        "",
        f"`{meta['command']}` ({meta['minutes']:.1f} min, {meta['started']}, commit `{meta['commit']}`"
        + (f", modified: {', '.join(meta['modified'])}" if meta.get("modified") else "")
        + f", CPU: {meta['cpu']}).",
        "",
        *multiturn_section(runs, level="#"),
    ]
    return "\n".join(out)


def git_modified() -> list[str]:
    """Paths changed in the working tree against its commit (what the commit alone does not say)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=ROOT
        )
        return [line[3:] for line in done.stdout.splitlines() if line.strip()]
    return []


def git_commit() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        return done.stdout.strip() or "unknown"
    return "unknown"


async def run(configs: Sequence[BenchConfig], log: Callable[[str], None]) -> list[dict[str, Any]]:
    return [await run_engine(c, log) for c in configs]


def affinity_settings(settings: Sequence[str]) -> tuple[tuple[str, Any], ...]:
    """``KEY=VALUE`` settings of ``routing.affinity``, their values read as YAML, checked by the gateway's model."""
    pairs = []
    for setting in settings:
        key, sep, text = setting.partition("=")
        if not sep or key not in AffinitySettings.model_fields:
            raise ValueError(f"{setting!r}: KEY=VALUE with KEY one of {', '.join(AffinitySettings.model_fields)}")
        pairs.append((key, yaml.safe_load(text)))
    try:
        AffinitySettings.model_validate(dict(pairs))
    except pydantic.ValidationError as e:
        raise ValueError(str(e)) from None
    return tuple(pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("both", "vllm", "sim"), default="both")
    parser.add_argument("--quick", action="store_true", help="one prompt set of 120 requests")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--seeds", type=str, default=None, help="prompt sets, e.g. 1,2,3")
    parser.add_argument(
        "--rows",
        type=str,
        default=None,
        help=f"comma-separated, of: {', '.join(dict.fromkeys(ROWS + MULTITURN_ROWS + EXTRA_ROWS))} "
        f"({SESSION_ROW}: multi-turn only; {', '.join(EXTRA_ROWS)}: vLLM only)",
    )
    parser.add_argument("--workload", type=str, default="uniform", help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    parser.add_argument("--conversations", type=int, default=None, help="multi-turn: conversations per set (480)")
    parser.add_argument("--concurrency", type=int, default=None, help="clients (uniform, 8) or conversations (12)")
    parser.add_argument("--zipf-s", type=float, default=None, help="multi-turn: Zipf exponent of the prompts (1.1)")
    parser.add_argument(
        "--cores",
        choices=("apart", "per-replica"),
        default=None,
        help="vLLM's cores (uniform: apart; multi-turn: per-replica)",
    )
    parser.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per replica (multi-turn: 140)")
    parser.add_argument(
        "--affinity",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a routing.affinity setting of the gateway rows, e.g. margin_requests=8 (repeatable)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--name", default=None, help="file stem (routing-vllm; routing-vllm-multiturn for --workload multiturn)"
    )
    args = parser.parse_args(argv)
    try:
        affinity = affinity_settings(args.affinity)
    except ValueError as e:
        parser.error(f"--affinity: {e}")
    workloads = tuple(w.strip() for w in args.workload.split(","))
    if not workloads or set(workloads) - set(WORKLOADS):
        parser.error(f"--workload: of {', '.join(WORKLOADS)}")
    bases = []
    for workload in workloads:
        base = MULTITURN if workload == "multiturn" else BenchConfig()
        if args.quick:
            base = dataclasses.replace(base, requests=120, conversations=48, seeds=(1,))
        if args.requests:
            base = dataclasses.replace(base, requests=args.requests)
        if args.conversations:
            base = dataclasses.replace(base, conversations=args.conversations)
        if args.concurrency:
            base = dataclasses.replace(base, concurrency=args.concurrency)
        if args.zipf_s is not None:
            base = dataclasses.replace(base, zipf_s=args.zipf_s)
        if args.cores:
            base = dataclasses.replace(base, cores=args.cores)
        if args.kv_blocks:
            base = dataclasses.replace(base, kv_blocks=args.kv_blocks)
        if affinity:
            base = dataclasses.replace(base, affinity=affinity)
        if args.seeds:
            base = dataclasses.replace(base, seeds=tuple(int(s) for s in args.seeds.split(",")))
        if args.rows:
            known = (MULTITURN_ROWS if workload == "multiturn" else ROWS) + EXTRA_ROWS
            rows = tuple(r.strip() for r in args.rows.split(",") if r.strip() in known)
            unknown = {r.strip() for r in args.rows.split(",")} - set(ROWS) - set(MULTITURN_ROWS) - set(EXTRA_ROWS)
            if unknown:
                parser.error(f"unknown rows: {', '.join(sorted(unknown))}")
            base = dataclasses.replace(base, rows=rows)
        bases.append(base)
    engines = ("vllm", "sim") if args.engine == "both" else (args.engine,)
    configs = [dataclasses.replace(base, engine=e) for base in bases for e in engines]
    name = args.name or ("routing-vllm" if "uniform" in workloads else "routing-vllm-multiturn")
    started = time.time()
    runs = asyncio.run(run(configs, lambda line: print(line, flush=True)))
    meta = {
        "command": "bench/routing_vllm.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "minutes": (time.time() - started) / 60,
        "commit": git_commit(),
        "modified": git_modified(),
        "cpu": cpu_name(),
    }
    uniform = [r for r in runs if r["workload"] == "uniform"]
    multiturn = [r for r in runs if r["workload"] == "multiturn"]
    text = report(uniform, meta) if uniform else multiturn_report(multiturn, meta)
    if uniform and multiturn:
        text += "\n" + "\n".join(multiturn_section(multiturn))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.md").write_text(text)
    doc = {"meta": meta, "runs": [{k: v for k, v in r.items() if k != "_results"} for r in runs]}
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out / f'{name}.md'}")
    judged = [v for r in runs if r["engine"] == "vllm" for v in r["verdicts"]]
    return 0 if all(v["passed"] for v in judged) else 1


if __name__ == "__main__":
    sys.exit(main())
