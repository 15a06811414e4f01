"""Routing benchmark: four replica-choice policies on a fleet of simulated H100s, through the gateway.

    .venv/bin/python bench/routing.py            # the full benchmark (~45 min): bench/results/routing.md
    .venv/bin/python bench/routing.py --quick    # a smoke test (~5 min): bench/results/routing-quick.md
    .venv/bin/python bench/routing.py --from-json bench/results/routing.json   # re-render the report
    .venv/bin/python bench/routing.py --fair-only     # the fair-queue experiment alone: routing-fair.json
    .venv/bin/python bench/routing.py --from-json bench/results/routing.json --fair-from bench/results/routing-fair.json
                                                      # the report with that run's fair-queue section
    .venv/bin/python bench/routing.py --only hot-prefix   # hot-prefix saturation alone (~6 min):
                                                          # bench/results/routing-hot-prefix.md

Each policy gets its own ``fleetgate serve`` process with eight managed ``engine: sim``
replicas (``h100-llama-3.1-8b``), started once and kept for the whole run. The four fleets
run side by side: every (workload, rate, seed) point is played against all of them at the
same moment, by one load generator (``capacity.loadgen``), so whatever else the machine does
hits every policy alike. The simulated GPUs run slower than real time (``--time-scale``)
so the Python cost of relaying tokens stays small next to simulated step times; every
figure is converted back to real-time-equivalent seconds.

Workloads (``bench/profiles/routing-*.yaml``), open loop, arrival rates rising through
saturation, three seeds each; the bars of issue 7 are judged in the report. A fair-queue
experiment follows: tenant A alone, then tenant A while tenant B floods at ten times its share.

``--only hot-prefix`` runs one more case on its own: four replicas, eight system prompts of
Zipf popularity whose hottest alone needs more than one replica at the upper rates
(``routing-hot-zipf``), against ``client_hash`` (the client sends each request straight to
the replica an MD5 of its system prompt picks: what a router that pins prefixes does) and
round robin. ``--only KEY,...`` also runs any of the workloads above alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import hashlib
import os
import resource
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import orjson

from bench.routing_fleet import (
    DEFAULT_POLICY,
    MODEL,
    POLICIES,
    PRE_INTEGRATION_POLICY,
    PROFILE,
    FleetSpec,
    PolicyFleet,
    TenantSpec,
    routing_supported,
    runnable_policies,
)
from bench.routing_metrics import RUNNING, WAITING, FleetReading, point_summary, pooled, read_fleet
from capacity.fleet_probe import FleetProbe, MetricsSource
from capacity.loadgen import LoadGenerator, PointPlan, Progress, Target
from capacity.stats import Metrics, RequestSample
from capacity.workload import RequestSpec, Workload, load_workload

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# The routing workloads are this benchmark's own, beside it, not among the planner's shipped
# profiles (capacity/profiles).
PROFILES = ROOT / "bench" / "profiles"
# A background load's measurement window never opens: it runs until it is cancelled.
NEVER_S = 1e9
# Fleet gauges are read this often (wall seconds) while a point runs.
PROBE_INTERVAL_S = 0.5
CPU_READ_INTERVAL_S = 5.0
# Before each point every fleet is left to empty (no request running or waiting on any
# replica), at most this long (real-time-equivalent): requests cancelled at the end of an
# overloaded point may still be queued on a replica, and would load the next point.
SETTLE_TIMEOUT_S = 60.0
SETTLE_POLL_S = 0.25
TENANT_A = TenantSpec("tenant-a", "sk-routing-tenant-a")
TENANT_B = TenantSpec("tenant-b", "sk-routing-tenant-b")
# A row that is not a gateway policy: the client hashes each request's shared prefix to a
# replica and sends it there itself. Its fleet's gateway only starts and watches the replicas.
CLIENT_HASH = "client_hash"
# The policy that idle gateway runs with (it routes nothing).
CLIENT_HASH_GATEWAY_POLICY = "round_robin"
T = TypeVar("T")


@dataclass(frozen=True)
class Experiment:
    """One workload and its sweep of arrival rates."""

    key: str
    profile: str
    title: str
    rates: tuple[float, ...]  # open loop: session arrivals per second (single-turn: requests/s)
    # A user class played as unmeasured background load, started ``background_lead_s``
    # before the measured traffic so its long requests are in flight when the window opens.
    background: str | None = None
    background_lead_s: float = 0.0
    # Before the first rate point: traffic at the middle rate for this long, unmeasured, so
    # the replicas' prefix caches start in a steady state rather than empty.
    prewarm_s: float = 0.0


@dataclass(frozen=True)
class FairPlan:
    """Tenant A alone at ``rate_a``, then A while B sends ``rate_b`` (both weight 1)."""

    profile: str
    rate_a: float
    rate_b: float
    capacity: float  # the fleet's nominal capacity on this workload, requests/s (for the report)
    # Tenant A's measurement window (default: the sweep's). Its bar is a p95 of A's TTFT:
    # longer windows give it enough samples that a few slow requests do not decide it.
    duration_s: float | None = None


@dataclass(frozen=True)
class Timing:
    """Durations in real-time-equivalent seconds; the GPUs run ``time_scale`` times real time."""

    warmup_s: float
    duration_s: float
    time_scale: float
    # A user who has waited this long for a ~100-token answer has left: the request counts
    # as not completed. Also bounds how long an overloaded point takes to drain.
    request_timeout_s: float = 20.0
    background_timeout_s: float = 600.0


@dataclass(frozen=True)
class BenchConfig:
    """Everything one run does."""

    experiments: tuple[Experiment, ...]
    fair: FairPlan | None
    seeds: tuple[int, ...]
    timing: Timing
    policies: tuple[str, ...] = POLICIES
    # The fair-queue experiment runs on the default policy's fleet only: the queue sits in
    # front of any policy, and a flood on every fleet at once would load the machine, not the fleets.
    fair_policies: tuple[str, ...] = (DEFAULT_POLICY,)
    replicas: int = 8
    profile: str = PROFILE
    nice: int = 5


EXPERIMENTS = (
    Experiment(
        "chat",
        "routing-chat",
        "(1) multi-turn chat, shared system prompts competing for KV",
        rates=(5.0, 9.0, 14.0, 20.0),
        prewarm_s=10.0,
    ),
    # The knee of this workload lies between 10 and 15/s (~15/s is the fleet's nominal capacity).
    Experiment("no_reuse", "routing-no-reuse", "(2) no prefix reuse (control)", rates=(5.0, 10.0, 12.5, 15.0)),
    Experiment(
        "hot_prefix",
        "routing-hot-prefix",
        "(3) one hot prefix takes half of the traffic",
        rates=(5.0, 10.0, 16.0),
        prewarm_s=10.0,
    ),
    Experiment(
        "short_long",
        "routing-short-long",
        "(4) 90% short, 10% very long generations",
        rates=(10.0, 20.0, 30.0),
        background="long",
        background_lead_s=8.0,
    ),
)
# The hot-prefix saturation case (``--only hot-prefix``): its bars ask the default for 1.2x
# the hash's goodput at the saturating rates, with a TTFT p95 no worse than the hash's.
SATURATION_EXPERIMENT = Experiment(
    "hot_prefix_saturation",
    "routing-hot-zipf",
    "(5) Zipf-popular prefixes, the hottest saturating one replica",
    # A replica serves ~2.5 of these requests/s: the hottest prompt (40%) needs half a replica
    # at 3/s, one at 6/s, one and a half at 9/s, where the fleet runs near its capacity (~10/s).
    rates=(3.0, 6.0, 9.0),
    prewarm_s=10.0,
)
SATURATION_GOODPUT_BAR = 1.2
SATURATION = BenchConfig(
    experiments=(SATURATION_EXPERIMENT,),
    fair=None,
    seeds=(1, 2, 3),
    timing=Timing(warmup_s=4.0, duration_s=8.0, time_scale=0.5),
    policies=(DEFAULT_POLICY, "round_robin", CLIENT_HASH),
    replicas=4,
)
# ``--only`` names: the workloads' keys, and "hot-prefix" for the saturation case.
ONLY_SATURATION = "hot-prefix"
FULL = BenchConfig(
    experiments=EXPERIMENTS,
    fair=FairPlan("routing-no-reuse", rate_a=6.0, rate_b=75.0, capacity=15.0, duration_s=24.0),
    seeds=(1, 2, 3),
    timing=Timing(warmup_s=4.0, duration_s=8.0, time_scale=0.5),
)
QUICK = BenchConfig(
    experiments=tuple(
        replace(
            e,
            rates=(e.rates[0], e.rates[-1]),
            prewarm_s=min(e.prewarm_s, 3.0),
            background_lead_s=min(e.background_lead_s, 5.0),
        )
        for e in EXPERIMENTS
    ),
    fair=FairPlan("routing-no-reuse", rate_a=6.0, rate_b=75.0, capacity=15.0),
    seeds=(1,),
    timing=Timing(warmup_s=2.0, duration_s=4.0, time_scale=0.5),
)


@dataclass
class PointRun:
    """One (workload, policy, rate, seed) as measured. ``samples`` stay in memory only."""

    experiment: str
    policy: str
    rate: float
    seed: int
    metrics: Metrics
    window_s: float
    fleet: FleetReading | None
    samples: list[RequestSample] = field(repr=False)


@dataclass
class FairRun:
    """Tenant A's point in one phase ("alone" or "flood"), and what became of B's flood."""

    policy: str
    seed: int
    phase: str
    metrics: Metrics
    window_s: float
    samples: list[RequestSample] = field(repr=False)
    flood: dict[str, int] = field(default_factory=dict)


# -- running ----------------------------------------------------------------------------


def prefix_home(spec: RequestSpec, replicas: int, salt: str = "") -> int:
    """The client-side hash: an MD5 of the shared prefix the request opens with, modulo the replicas.

    The prefix's name (``system#12``) stands for its text: the system message also carries
    per-user data after the shared part, which would make every session hash apart. A request
    with no shared opening hashes its first message. ``salt`` (the point's seed) gives every
    seed a placement of its own, as new prompt text would: with a few prefixes on a few
    replicas one placement alone may leave a replica idle or put the hottest two together.
    """
    key = spec.prefix_key or (spec.messages[0]["content"] if spec.messages else "")
    return int.from_bytes(hashlib.md5(f"{salt}/{key}".encode()).digest()[:8], "little") % replicas


class HashingLoadGenerator(LoadGenerator):
    """A load generator that sends each request straight to the replica ``prefix_home`` picks."""

    def __init__(self, workload: Workload, replica_urls: Sequence[str], run_id: str) -> None:
        super().__init__(workload, run_id=run_id)
        self.replica_urls = tuple(replica_urls)

    async def _stream(
        self, run: Any, spec: RequestSpec, sample: RequestSample, times: list[float], parts: list[str]
    ) -> None:
        # The run's state is shared by its requests; only the target differs, so the request
        # streams through a shallow copy naming its replica (warm keys and counters stay shared).
        home = self.replica_urls[prefix_home(spec, len(self.replica_urls), salt=str(run.plan.seed))]
        routed = copy.copy(run)
        routed.target = replace(run.target, base_url=home, api_key=None)
        await super()._stream(routed, spec, sample, times, parts)


def split_workload(workload: Workload, background: str | None) -> tuple[Workload, Workload | None, float]:
    """The measured part, the background class (shares renormalised), and the background's share."""
    if background is None:
        return workload, None, 0.0
    bg = [c for c in workload.classes if c.name == background]
    fg = [c for c in workload.classes if c.name != background]
    if not bg or not fg:
        raise ValueError(f"{workload.name}: no class {background!r} to run as background, or nothing else")
    share = bg[0].share
    fg = [c.model_copy(update={"share": c.share / (1.0 - share)}) for c in fg]
    return (
        workload.model_copy(update={"classes": fg}),
        workload.model_copy(update={"classes": [bg[0].model_copy(update={"share": 1.0})]}),
        share,
    )


async def with_background(
    gen: LoadGenerator | None,
    target: Target,
    plan: PointPlan | None,
    lead_s: float,
    work: Awaitable[T],
    progress: Progress | None = None,
) -> T:
    """Await ``work`` while ``gen`` plays ``plan`` as background load, started ``lead_s`` (wall) before."""
    if gen is None or plan is None:
        return await work
    task = asyncio.create_task(gen.run_point(target, plan, progress))
    try:
        await asyncio.sleep(lead_s)
        return await work
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def measure(
    fleet: PolicyFleet, gen: LoadGenerator, target: Target, plan: PointPlan
) -> tuple[list[RequestSample], float, Metrics, FleetReading | None]:
    """One point against one fleet, with its replicas' gauges read throughout."""
    source = MetricsSource(fleet.replica_urls)
    async with FleetProbe(source, gen.session, clock=gen.clock, interval_s=PROBE_INTERVAL_S) as probe:
        result = await gen.run_point(target, plan)
    reading = read_fleet(probe.window.samples, result.window_start, result.window_end)
    metrics = point_summary(result.samples, result.window_s, result.window_tokens, reading)
    return result.samples, result.window_s, metrics, reading


class Bench:
    """One run: the fleets, the sweep, the records."""

    def __init__(self, config: BenchConfig, log: Callable[[str], None]) -> None:
        self.config = config
        self.log = log
        self.nonce = secrets.token_hex(3)
        self.fleets: dict[str, PolicyFleet] = {}
        self.points: list[PointRun] = []
        self.fair: list[FairRun] = []
        # Called with the fleets still up, before they are stopped (the CPU meter's last reading).
        self.before_stop: Callable[[], None] = lambda: None
        # Real-time-equivalent seconds each point waited for the fleets to empty first.
        self.settle_waits: list[float] = []
        self._session: aiohttp.ClientSession | None = None

    def plan(
        self,
        rate: float,
        seed: int,
        warmup_s: float | None = None,
        duration_s: float | None = None,
        background: bool = False,
    ) -> PointPlan:
        t = self.config.timing
        return PointPlan(
            "open",
            rate,
            warmup_s=t.warmup_s if warmup_s is None else warmup_s,
            duration_s=t.duration_s if duration_s is None else duration_s,
            time_scale=t.time_scale,
            request_timeout_s=t.background_timeout_s if background else t.request_timeout_s,
            seed=seed,
        )

    async def run(self, work_dir: Path) -> None:
        c = self.config
        tenants = (TenantSpec("bench", "sk-routing-bench"), TENANT_A, TENANT_B)
        specs = [
            FleetSpec(
                CLIENT_HASH_GATEWAY_POLICY if p == CLIENT_HASH else p,
                c.replicas,
                c.profile,
                c.timing.time_scale,
                0,
                tenants,
                c.nice,
            )
            for p in c.policies
        ]
        async with contextlib.AsyncExitStack() as stack:
            fleets = [PolicyFleet(spec, work_dir / row) for row, spec in zip(c.policies, specs, strict=True)]
            for fleet in fleets:  # each is stopped on the way out, started or not
                stack.push_async_exit(fleet)
            started = time.monotonic()
            outcomes = await asyncio.gather(*(f.__aenter__() for f in fleets), return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
            self.fleets = dict(zip(c.policies, fleets, strict=True))
            self.log(f"{len(fleets)} fleets of {c.replicas} replicas ready in {time.monotonic() - started:.0f} s")
            self._session = await stack.enter_async_context(aiohttp.ClientSession())
            try:
                for experiment in c.experiments:
                    await self.run_experiment(experiment)
                if c.fair is not None:
                    await self.run_fair(c.fair)
            finally:
                self.before_stop()

    async def settle(self) -> None:
        """Wait until no replica of any fleet has a request running or waiting (bounded)."""
        assert self._session is not None
        scale = self.config.timing.time_scale
        loop = asyncio.get_running_loop()
        started = loop.time()
        sources = [MetricsSource(f.replica_urls) for f in self.fleets.values()]
        while True:
            try:
                readings = await asyncio.gather(*(s.read(self._session) for s in sources))
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.log(f"settle: a replica did not answer ({exc!r}); going on")
                break
            busy = sum(r.get(RUNNING, 0.0) + r.get(WAITING, 0.0) for reps in readings for r in reps)
            waited = (loop.time() - started) * scale
            if busy == 0:
                break
            if waited >= SETTLE_TIMEOUT_S:
                self.log(f"settle: {busy:.0f} requests still on the replicas after {waited:.0f} s; going on")
                break
            await asyncio.sleep(SETTLE_POLL_S)
        self.settle_waits.append((loop.time() - started) * scale)

    async def run_experiment(self, exp: Experiment) -> None:
        c, scale = self.config, self.config.timing.time_scale
        workload = load_workload(PROFILES / f"{exp.profile}.yaml")
        fg, bg, bg_share = split_workload(workload, exp.background)
        run_id = f"{self.nonce}-{exp.key}"
        key = TenantSpec("bench", "sk-routing-bench").api_key
        async with contextlib.AsyncExitStack() as stack:
            gens = {p: await stack.enter_async_context(self.generator(p, fg, run_id)) for p in c.policies}
            bg_gens = {
                p: await stack.enter_async_context(self.generator(p, bg, run_id)) if bg is not None else None
                for p in c.policies
            }
            targets = {p: Target(p, self.fleets[p].url, MODEL, key) for p in c.policies}
            if exp.prewarm_s > 0:
                await self.settle()
                middle = exp.rates[(len(exp.rates) - 1) // 2]
                self.log(f"{exp.key}: pre-warming the prefix caches at {middle:g}/s for {exp.prewarm_s:g} s")
                plan = self.plan(middle, 0, warmup_s=exp.prewarm_s, duration_s=0.5)
                await asyncio.gather(*(gens[p].run_point(targets[p], plan) for p in c.policies))
            for rate in exp.rates:
                for seed in c.seeds:
                    await self.settle()
                    started = time.monotonic()
                    fg_plan = self.plan(rate * (1.0 - bg_share), seed)
                    bg_plan = self.plan(rate * bg_share, seed + 1000, warmup_s=NEVER_S, background=True) if bg else None
                    lead = exp.background_lead_s / scale
                    results = await asyncio.gather(
                        *(
                            with_background(
                                bg_gens[p],
                                targets[p],
                                bg_plan,
                                lead,
                                measure(self.fleets[p], gens[p], targets[p], fg_plan),
                            )
                            for p in c.policies
                        )
                    )
                    for policy, (samples, window_s, metrics, reading) in zip(c.policies, results, strict=True):
                        self.points.append(PointRun(exp.key, policy, rate, seed, metrics, window_s, reading, samples))
                    self.log(_progress_line(exp.key, rate, seed, c.policies, results, time.monotonic() - started))

    def generator(self, row: str, workload: Workload, run_id: str) -> LoadGenerator:
        """The load generator of ``row``: through its gateway, or (``client_hash``) straight to its replicas."""
        if row == CLIENT_HASH:
            return HashingLoadGenerator(workload, self.fleets[row].replica_urls, run_id)
        return LoadGenerator(workload, run_id=run_id)

    async def run_fair(self, fair: FairPlan) -> None:
        c = self.config
        policies = [p for p in c.fair_policies if p in self.fleets]
        workload = load_workload(PROFILES / f"{fair.profile}.yaml")
        run_id = f"{self.nonce}-fair"
        async with contextlib.AsyncExitStack() as stack:
            gens_a = {p: await stack.enter_async_context(LoadGenerator(workload, run_id=run_id)) for p in policies}
            gens_b = {p: await stack.enter_async_context(LoadGenerator(workload, run_id=run_id)) for p in policies}
            ta = {p: Target(TENANT_A.id, self.fleets[p].url, MODEL, TENANT_A.api_key) for p in policies}
            tb = {p: Target(TENANT_B.id, self.fleets[p].url, MODEL, TENANT_B.api_key) for p in policies}
            for seed in c.seeds:
                for phase in ("alone", "flood"):
                    await self.settle()
                    started = time.monotonic()
                    plan_a = self.plan(fair.rate_a, seed, duration_s=fair.duration_s)
                    # The flooding tenant is a batch job: it never gives up on a request (a client
                    # timeout would leave the replica prefilling a prompt nobody waits for).
                    plan_b = (
                        self.plan(fair.rate_b, seed + 2000, warmup_s=NEVER_S, background=True)
                        if phase == "flood"
                        else None
                    )
                    progress = {p: Progress() for p in policies}
                    results = await asyncio.gather(
                        *(
                            with_background(
                                gens_b[p],
                                tb[p],
                                plan_b,
                                0.0,
                                measure(self.fleets[p], gens_a[p], ta[p], plan_a),
                                progress[p],
                            )
                            for p in policies
                        )
                    )
                    for policy, (samples, window_s, metrics, _) in zip(policies, results, strict=True):
                        pr = progress[policy]
                        flood = {"sent": pr.started, "finished": pr.finished, "errors": pr.errors} if plan_b else {}
                        self.fair.append(FairRun(policy, seed, phase, metrics, window_s, samples, flood))
                    self.log(
                        _progress_line(
                            f"fair/{phase}", fair.rate_a, seed, policies, results, time.monotonic() - started
                        )
                    )


def _progress_line(
    name: str,
    rate: float,
    seed: int,
    policies: Sequence[str],
    results: Sequence[tuple[Any, Any, Metrics, Any]],
    wall_s: float,
) -> str:
    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    cells = [
        f"{p}: good {f(m['goodput'], '.1f')}/s ttft95 {f(m['ttft_p95'], '.2f')} itl95 {f(m['itl_p95'], '.3f')} "
        f"hit {f(m['hit_rate'], '.2f')}"
        for p, (_, _, m, _) in zip(policies, results, strict=True)
    ]
    return f"{name} rate {rate:g} seed {seed} ({wall_s:.0f} s): " + " | ".join(cells)


# -- records ------------------------------------------------------------------------------


def document(bench: Bench, meta: dict[str, Any]) -> dict[str, Any]:
    """The run as JSON-ready data: settings, every point's metrics, and the pooled figures."""
    c = bench.config
    pooled_points = []
    for exp in c.experiments:
        for policy in c.policies:
            for rate in exp.rates:
                runs = [p for p in bench.points if (p.experiment, p.policy, p.rate) == (exp.key, policy, rate)]
                if runs:
                    metrics = pooled([(p.samples, p.window_s, p.fleet) for p in runs])
                    pooled_points.append({"experiment": exp.key, "policy": policy, "rate": rate, "metrics": metrics})
    fair_pooled = []
    for policy in c.fair_policies:
        for phase in ("alone", "flood"):
            fair_runs = [r for r in bench.fair if (r.policy, r.phase) == (policy, phase)]
            if fair_runs:
                metrics = pooled([(r.samples, r.window_s, None) for r in fair_runs])
                fair_pooled.append({"policy": policy, "phase": phase, "metrics": metrics})
    waits = sorted(bench.settle_waits)
    meta = {
        **meta,
        "settle_s": {
            "limit": SETTLE_TIMEOUT_S,
            "points": len(waits),
            "median": round(waits[len(waits) // 2], 2) if waits else None,
            "max": round(waits[-1], 2) if waits else None,
            "over_1s": sum(1 for w in waits if w > 1.0),
        },
    }
    return {
        "meta": meta,
        "config": _config_json(c),
        "points": [
            {
                "experiment": p.experiment,
                "policy": p.policy,
                "rate": p.rate,
                "seed": p.seed,
                "window_s": p.window_s,
                "metrics": p.metrics,
                "replicas": None
                if p.fleet is None
                else {"generated": p.fleet.generated, "mean_load": p.fleet.mean_load},
            }
            for p in bench.points
        ],
        "pooled": pooled_points,
        "fair": [
            {"policy": r.policy, "seed": r.seed, "phase": r.phase, "metrics": r.metrics, "flood": r.flood}
            for r in bench.fair
        ],
        "fair_pooled": fair_pooled,
    }


def _config_json(c: BenchConfig) -> dict[str, Any]:
    return {
        "experiments": [asdict(e) for e in c.experiments],
        "fair": asdict(c.fair) if c.fair else None,
        "seeds": list(c.seeds),
        "timing": asdict(c.timing),
        "policies": list(c.policies),
        "fair_policies": list(c.fair_policies),
        "replicas": c.replicas,
        "profile": c.profile,
    }


class CpuMeter:
    """CPU seconds used by this process and by the fleets' processes (gateways and replicas)."""

    def __init__(self) -> None:
        self.started = self._self()
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}

    @staticmethod
    def _self() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def read(self, pids: Sequence[int]) -> None:
        """Note the processes' CPU time now (call before they exit: the last reading counts)."""
        for pid in pids:
            cpu = _proc_cpu(pid)
            if cpu is not None:
                self.first.setdefault(pid, cpu)
                self.last[pid] = cpu

    def used(self) -> dict[str, float]:
        fleets = sum(self.last[pid] - start for pid, start in self.first.items())
        return {"client": round(self._self() - self.started, 1), "fleets": round(fleets, 1)}


def _proc_cpu(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _git_rev() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _git_modified() -> list[str]:
    """Paths changed in the working tree against its commit (what the commit alone does not say)."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [line[3:] for line in out.stdout.splitlines() if line.strip()]


async def run_config(config: BenchConfig, work_dir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Run ``config`` and return the JSON document (not yet written)."""
    bench = Bench(config, log)
    cpu = CpuMeter()
    started = time.monotonic()
    load_before = os.getloadavg()
    meta: dict[str, Any] = {
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": _git_rev(),
        "modified": _git_modified(),
        "routing_key": routing_supported(),
        "model": MODEL,
        "command": " ".join(["bench/routing.py", *sys.argv[1:]]),
    }

    def read_cpu() -> None:
        cpu.read([pid for fleet in bench.fleets.values() for pid in (fleet.pid, *fleet.replica_pids) if pid])

    async def watch_cpu() -> None:
        while True:
            read_cpu()
            await asyncio.sleep(CPU_READ_INTERVAL_S)

    bench.before_stop = read_cpu
    watcher = asyncio.create_task(watch_cpu())
    # Stopped with SIGTERM (kill, a CI timeout): unwind like Ctrl-C, so every fleet's gateway
    # and replicas are stopped rather than left running.
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    try:
        await bench.run(work_dir)
    finally:
        watcher.cancel()
        meta["wall_s"] = round(time.monotonic() - started, 1)
        meta["cpu_s"] = cpu.used()
        meta["loadavg_before"] = [round(x, 2) for x in load_before]
        meta["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return document(bench, meta)


def with_fair_from(doc: dict[str, Any], fair_run: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its fair-queue section replaced by ``fair_run``'s (a ``--fair-only`` run).

    For a change that only matters with several tenants: the workloads (one tenant each) keep
    their run, the fair queue gets the later one, and the method names both.
    """
    out = dict(doc)
    out["fair"], out["fair_pooled"] = fair_run["fair"], fair_run["fair_pooled"]
    out["config"] = {**doc["config"], "fair": fair_run["config"]["fair"]}
    out["config"]["fair_policies"] = fair_run["config"]["fair_policies"]
    out["meta"] = {**doc["meta"], "fair_run": fair_run["meta"]}
    return out


def write_outputs(doc: dict[str, Any], out_dir: Path, name: str, report: bool = True) -> list[Path]:
    """The run's JSON, then (``report``) its report and plots."""
    from bench.routing_report import write_report

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    json_path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    return [json_path, *(write_report(doc, out_dir, name) if report else [])]


def saturation_report(doc: dict[str, Any]) -> str:
    """The hot-prefix saturation case: per rate and row, goodput, TTFT and the spread; its bars."""
    meta, config = doc["meta"], doc["config"]
    exp = config["experiments"][0]
    policies = config["policies"]
    pooled_by = {(p["policy"], p["rate"]): p["metrics"] for p in doc["pooled"]}
    generated: dict[tuple[str, float], list[float]] = {}
    for point in doc["points"]:
        if point["replicas"] is not None:
            per = generated.setdefault((point["policy"], point["rate"]), [0.0] * len(point["replicas"]["generated"]))
            for k, g in enumerate(point["replicas"]["generated"]):
                per[k] += g

    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        "# Routing: hot-prefix saturation (simulated replicas)",
        "",
        f"`{meta['command']}` ({meta['wall_s'] / 60:.1f} min, {meta['started_at']}, commit `{meta['git']}`"
        + (f", modified: {', '.join(meta['modified'])}" if meta.get("modified") else "")
        + f"; load average {meta['loadavg_before'][0]:.1f} before, {meta['loadavg_after'][0]:.1f} after).",
        "",
        "## The bars",
        "",
        "| bar | asks | measured | verdict |",
        "| --- | --- | --- | --- |",
    ]
    top = max(exp["rates"])
    ref = pooled_by.get((CLIENT_HASH, top))
    for policy in policies:
        m = pooled_by.get((policy, top))
        if policy == CLIENT_HASH or m is None or ref is None:
            continue
        ratio = m["goodput"] / ref["goodput"] if m["goodput"] is not None and ref["goodput"] else None
        lines.append(
            f"| {policy} goodput at {top:g}/s | >= {SATURATION_GOODPUT_BAR}x client hash's | "
            f"{f(m['goodput'], '.2f')}/s vs {f(ref['goodput'], '.2f')}/s ({f(ratio, '.2f')}x) | "
            f"{'pass' if ratio is not None and ratio >= SATURATION_GOODPUT_BAR else '**fail**'} |"
        )
        ok = m["ttft_p95"] is not None and ref["ttft_p95"] is not None and m["ttft_p95"] <= ref["ttft_p95"]
        lines.append(
            f"| {policy} TTFT p95 at {top:g}/s | <= client hash's | "
            f"{f(m['ttft_p95'], '.2f')} s vs {f(ref['ttft_p95'], '.2f')} s | {'pass' if ok else '**fail**'} |"
        )
    lines += [
        "",
        "## Every rate",
        "",
        "| rate (req/s) | row | goodput (req/s) | attainment | TTFT p50 | TTFT p95 | hit rate "
        "| busiest replica (share of tokens generated) | mean-load imbalance |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for rate in exp["rates"]:
        for policy in policies:
            m = pooled_by.get((policy, rate))
            if m is None:
                continue
            per = generated.get((policy, rate), [])
            share = max(per) / sum(per) if per and sum(per) > 0 else None
            lines.append(
                f"| {rate:g} | {policy} | {f(m['goodput'], '.2f')} | {f(m['attainment'], '.0%')} "
                f"| {f(m['ttft_p50'], '.2f')} s | {f(m['ttft_p95'], '.2f')} s | {f(m['hit_rate'], '.3f')} "
                f"| {f(share, '.0%')} | {f(m['imbalance'], '.2f')} |"
            )
    lines += [
        "",
        "## Method",
        "",
        f"- **Fleets**: one per row, {config['replicas']} simulated replicas each (`{config['profile']}`), "
        "side by side, every point played against all rows at once. Gateway rows: `fleetgate serve` with "
        f"`routing.policy`. `{CLIENT_HASH}`: the client sends each request straight to the replica an MD5 of "
        "the point's seed and its system prompt's name picks (a placement per seed, as new prompt text would "
        "give; the fleet's gateway only starts the replicas).",
        f"- **Workload**: `bench/profiles/{exp['profile']}.yaml`, open loop at "
        f"{', '.join(f'{r:g}' for r in exp['rates'])} requests/s, "
        f"seeds {', '.join(map(str, config['seeds']))}, pooled; caches pre-warmed at the middle rate "
        f"for {exp['prewarm_s']:g} s. Windows of {config['timing']['duration_s']:g} s after "
        f"{config['timing']['warmup_s']:g} s of warm-up (simulated time; the GPUs run at "
        f"{config['timing']['time_scale']:g}x real time).",
        "- **Goodput**: requests per second that completed within both SLOs (TTFT and inter-token latency, "
        "`bench/routing_metrics.py`); attainment is their share of requests sent. The bars are judged at the top "
        "rate, where the hottest prompt alone needs more than one replica.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/routing.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few minutes: two rates per workload, one seed")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output directory (bench/results)")
    parser.add_argument("--name", help="file stem (routing, or routing-quick with --quick)")
    parser.add_argument("--time-scale", type=float, help="override the simulated GPUs' speed vs real time")
    parser.add_argument("--policies", help="comma-separated subset of " + ",".join((*POLICIES, CLIENT_HASH)))
    parser.add_argument(
        "--only",
        help=f"comma-separated workload keys to run alone ({', '.join(e.key for e in EXPERIMENTS)}; no fair queue), "
        f"or {ONLY_SATURATION!r}: the hot-prefix saturation case (routing-hot-prefix.md)",
    )
    parser.add_argument("--from-json", type=Path, metavar="FILE", help="write the report again from a run's JSON")
    parser.add_argument(
        "--fair-only", action="store_true", help="run the fair-queue experiment alone (writes routing-fair.json)"
    )
    parser.add_argument(
        "--fair-from",
        type=Path,
        metavar="FILE",
        help="with --from-json: take the fair-queue section from this --fair-only run (the method says so)",
    )
    args = parser.parse_args(argv)
    saturation = args.only == ONLY_SATURATION
    name = args.name or (
        "routing-hot-prefix"
        if saturation
        else "routing-quick"
        if args.quick
        else "routing-fair"
        if args.fair_only
        else "routing"
    )
    if args.from_json and args.fair_only:
        parser.error("--fair-only runs the experiment; --from-json only writes a report")
    if args.from_json:
        doc = orjson.loads(args.from_json.read_bytes())
        if args.fair_from:
            doc = with_fair_from(doc, orjson.loads(args.fair_from.read_bytes()))
        paths = write_outputs(doc, args.out, name)
        print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
        return 0
    if args.fair_from:
        parser.error("--fair-from goes with --from-json")
    config = SATURATION if saturation else QUICK if args.quick else FULL
    if args.quick and saturation:
        config = replace(config, seeds=(1,), timing=QUICK.timing)
    if args.only and not saturation:
        keys = args.only.split(",")
        unknown = set(keys) - {e.key for e in EXPERIMENTS}
        if unknown:
            parser.error(
                f"--only: unknown {sorted(unknown)}; known: {', '.join(e.key for e in EXPERIMENTS)}, hot-prefix"
            )
        config = replace(config, experiments=tuple(e for e in config.experiments if e.key in keys), fair=None)
    if args.fair_only:
        config = replace(config, experiments=(), policies=config.fair_policies)
    if args.time_scale:
        config = replace(config, timing=replace(config.timing, time_scale=args.time_scale))
    wanted = tuple(args.policies.split(",")) if args.policies else config.policies
    unknown = set(wanted) - {*POLICIES, CLIENT_HASH}
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICIES)}")
    policies = runnable_policies(wanted)
    if not policies:
        parser.error(f"this gateway has no 'routing' key yet: only {PRE_INTEGRATION_POLICY} can run")
    if policies != wanted:
        print(
            f"routing.policy is not configurable in this gateway: running {', '.join(policies)} only", file=sys.stderr
        )
    config = replace(config, policies=policies)

    def log(line: str) -> None:
        print(f"[{datetime.now().strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)

    import tempfile

    import uvloop

    with tempfile.TemporaryDirectory(prefix="routing-bench-") as tmp:
        doc = uvloop.run(run_config(config, Path(tmp), log))
    if saturation:  # its own short report: the full report's figures and bars are issue 7's
        paths = write_outputs(doc, args.out, name, report=False)
        paths.append(args.out / f"{name}.md")
        paths[-1].write_text(saturation_report(doc))
        log(f"done in {doc['meta']['wall_s']:.0f} s; wrote " + ", ".join(str(p) for p in paths))
        return 0
    # --fair-only has no workloads to report: its JSON is for --fair-from.
    paths = write_outputs(doc, args.out, name, report=not args.fair_only)
    log(f"done in {doc['meta']['wall_s']:.0f} s; wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
