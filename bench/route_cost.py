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
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

from dialects.openai import CHAT

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    print("| policy | route | classify + route |")
    print("| --- | ---: | ---: |")
    for policy in POLICIES:
        route = measure(policy, False, args.calls, args.repeat)
        both = measure(policy, True, args.calls, args.repeat)
        print(f"| `{policy}` | {route:.0f} us | {both:.0f} us |", flush=True)


if __name__ == "__main__":
    main()
