"""What the routing pieces cost per request, per policy: the table in docs/routing.md.

    .venv/bin/python bench/route_cost.py            # prints a Markdown table

A pool of 8 replicas with scraped gauges and a chat request with a ~1,000-character system
prompt and a one-line question (1,000 distinct questions over 50 system prompts, so the
prefix index holds a realistic mix). "route" is what a request that goes upstream pays:
building its ``Route``, the admission check, the first pick (prefix hashing, the index,
metrics), its claim on the replica and its release, ``finished()`` and the access-log
fields. "classify + route" adds ``choose_tier`` and the debug header (``auto`` requests
only). Best of ``--repeat`` runs of ``--calls`` requests: on a shared machine the minimum is
the least disturbed figure, and even it is an upper bound.

    .venv/bin/python bench/route_cost.py --base REF [--rounds 5]

measures "route" with the default policy (``prefix_affinity``) in this checkout and in the
repository at ``REF`` (unpacked with ``git archive``), each in a fresh process, the two
alternating in every round, and writes the medians and the ratio new / base of each round
to ``bench/results/route-cost-vs-REF.md``: a change's cost per request, read in one run.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dialects.openai import CHAT

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry

from bench.overhead import RESULTS, ROOT, base_tree
from common.breaker import BreakerConfig, CircuitBreaker
from replicas.replica import GAUGE_KV_USAGE, GAUGE_RUNNING, GAUGE_WAITING, Replica, ReplicaState
from routing.config import RoutingSettings
from routing.metrics import RoutingMetrics
from routing.router import PoolSpec, Router

POLICIES = ("prefix_affinity", "least_outstanding_tokens", "least_requests", "round_robin")
MODEL = "m"


def fleet(n: int = 8) -> list[Replica]:
    replicas = []
    for i in range(n):
        r = Replica(f"r{i}", f"http://r{i}", MODEL, "medium", MODEL, False, CircuitBreaker(BreakerConfig(5, 10.0)))
        r.state = ReplicaState.HEALTHY
        r.observe({GAUGE_RUNNING: 3.0 + i % 3, GAUGE_WAITING: 0.0, GAUGE_KV_USAGE: 0.4})
        replicas.append(r)
    return replicas


def bodies(n: int = 1000) -> list[dict[str, Any]]:
    systems = [f"You are assistant number {k} of the support team. " * 20 for k in range(50)]
    rng = random.Random(7)
    return [
        {
            "model": "auto",
            "messages": [
                {"role": "system", "content": rng.choice(systems)},
                {"role": "user", "content": f"How do I reset the password of account {i}?"},
            ],
        }
        for i in range(n)
    ]


def one_request(router: Router, body: dict[str, Any], classify: bool) -> None:
    model = MODEL
    choice = None
    prompt = CHAT.prompt(body)
    if classify:
        choice = router.choose_tier(prompt, None, ())
        assert choice is not None
        model = choice.model
        choice.header()
    route = router.route(model, prompt, 300, 100, choice)
    route.pool.admission.ready(0.0)
    replica = route(set())
    assert replica is not None
    claim = route.claim(replica, streamed=True)
    claim.prefilled()
    claim.release()
    route.finished()
    route.annotate({})


def measure(policy: str, classify: bool, calls: int, repeat: int) -> float:
    """Microseconds per request, best of ``repeat``."""
    settings = RoutingSettings(policy=policy)
    router = Router.build(
        settings,
        [PoolSpec(MODEL, "medium")],
        {MODEL: fleet()},
        rng=random.Random(1),
        clock=lambda: 0.0,
        metrics=RoutingMetrics(CollectorRegistry(), policy),
    )
    work = bodies()
    for body in work:  # warm the index and the caches
        one_request(router, body, classify)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for i in range(calls):
            one_request(router, work[i % len(work)], classify)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


# Run in the tree under test (PYTHONPATH): microseconds per request for the default policy.
_CHILD = "import sys; from bench.route_cost import measure; print(measure('prefix_affinity', False, {}, {}))"


def _measure_tree(tree: Path, calls: int, repeat: int) -> float:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD.format(calls, repeat)],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"measuring {tree} failed:\n{done.stderr}")
    return float(done.stdout.strip().splitlines()[-1])


def _short(ref: str) -> str:
    """``ref``'s abbreviated commit id."""
    done = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def compare(ref: str, rounds: int, calls: int, repeat: int) -> Path:
    """ "route" here and at ``ref``, alternating; the report's path."""
    base_ref, commit = _short(ref), _short("HEAD")
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    new: list[float] = []
    old: list[float] = []
    with tempfile.TemporaryDirectory(prefix="route-cost-") as tmp:
        base = base_tree(base_ref, Path(tmp))
        for k in range(rounds):
            trees = [(new, ROOT), (old, base)] if k % 2 == 0 else [(old, base), (new, ROOT)]
            for into, tree in trees:
                into.append(_measure_tree(tree, calls, repeat))
            print(f"[{k + 1}/{rounds}] new {new[-1]:.1f} us, base {old[-1]:.1f} us", flush=True)
    ratios = ", ".join(f"{a / b:.3f}" for a, b in zip(new, old, strict=True))
    text = "\n".join(
        [
            f"# The cost of routing a request: `{commit}` against `{base_ref}`",
            "",
            f"`bench/route_cost.py --base {ref} --rounds {rounds} --calls {calls} --repeat {repeat}` ({started}).",
            "",
            "| policy | base | new | new / base (per round) |",
            "| --- | ---: | ---: | --- |",
            f"| `prefix_affinity`, route | {statistics.median(old):.1f} us | {statistics.median(new):.1f} us "
            f"| {statistics.median(new) / statistics.median(old):.3f} ({ratios}) |",
            "",
            "Method: " + " ".join(__doc__.split("\n\n")[2].split()) + " In each round both trees run "
            "in a fresh process, one after the other, the order alternating between rounds.",
            "",
        ]
    )
    out = RESULTS / f"route-cost-vs-{base_ref}.md"
    out.write_text(text)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--base", default=None, help="git ref: measure route against it, in the same run")
    parser.add_argument("--rounds", type=int, default=5, help="with --base: alternating rounds")
    args = parser.parse_args()
    if args.base:
        print(compare(args.base, args.rounds, args.calls, args.repeat).read_text())
        return
    print("| policy | route | classify + route |")
    print("| --- | ---: | ---: |")
    for policy in POLICIES:
        route = measure(policy, False, args.calls, args.repeat)
        both = measure(policy, True, args.calls, args.repeat)
        print(f"| `{policy}` | {route:.0f} us | {both:.0f} us |", flush=True)


if __name__ == "__main__":
    main()
