"""A model's pool (``routing.pool``): policies by name, and room-aware picks that keep
prefixes where they are cached."""

from __future__ import annotations

import random

import pytest

from replicas.replica import Replica
from routing.config import AffinitySettings, CapacitySettings
from routing.policies import LeastRequests, LoadModel, PrefixAffinity, RoundRobin
from routing.pool import make_policy
from routing.router import PoolSpec, Router
from tests.unit.routing.test_router import SYSTEM, build, chat, replica


def test_policy_names_make_their_policies() -> None:

    rng, load, aff = random.Random(0), LoadModel(), AffinitySettings()
    assert isinstance(make_policy("prefix_affinity", rng, load, aff), PrefixAffinity)
    assert isinstance(make_policy("round_robin", rng, load, aff), RoundRobin)
    assert isinstance(make_policy("least_requests", rng, load, aff), LeastRequests)


def test_picks_prefer_replicas_with_room() -> None:
    full, free = replica("m", 0), replica("m", 1)
    full.outstanding_requests = 2
    rs = {"m": [full, free]}
    router, _ = build([PoolSpec("m", "t", capacity=CapacitySettings(max_requests=2))], rs, policy="round_robin")
    route = router.route("m", chat("hi"), 10, 10)
    assert [route(set()).id for _ in range(3)] == ["m-1", "m-1", "m-1"]  # type: ignore[union-attr]
    # everyone full: the policy chooses among all (the replica queues it)
    free.outstanding_requests = 2
    assert route(set()) is not None


@pytest.mark.parametrize("policy", ["prefix_affinity", "least_requests"])
def test_a_full_replica_is_passed_over_where_the_first_token_comes_sooner_caches_counted(policy: str) -> None:
    """Prefix affinity leaves a full home only where the first token comes sooner; a baseline always does.

    The pool's prefix index records each prompt where it is sent; a prefill backlog past
    1,000 tokens fills a replica. Prompts of 1,000 tokens, mostly a cached system prompt.
    """
    affinity = policy == "prefix_affinity"
    # Cached at a full home behind 5,000 tokens of backlog: next door, with nothing to wait
    # for, prefills the whole prompt (counted twice: its copy evicts another) and still
    # starts sooner. Either policy diverts.
    router, home, other = _prefill_bound_pool(policy, SYSTEM)
    home.prefill_tokens = 5000
    assert _pick(router, "another question", SYSTEM) is other
    # Behind 1,500 tokens: full, but its first token still comes sooner at home.
    router, home, other = _prefill_bound_pool(policy, SYSTEM)
    home.prefill_tokens = 1500
    assert _pick(router, "another question", SYSTEM) is (home if affinity else other)
    # A hard limit is no wait: a replica at its requests bound is passed over.
    router, home, other = _prefill_bound_pool(policy, SYSTEM, max_requests=1)
    home.outstanding_requests = 1
    assert _pick(router, "another question", SYSTEM) is other
    # Too short for a prefix: no home, it goes where there is room.
    router, home, other = _prefill_bound_pool(policy, SYSTEM)
    home.prefill_tokens = 1500
    assert _pick(router, "hi", "") is other


def _prefill_bound_pool(policy: str, system: str, max_requests: int | None = None) -> tuple[Router, Replica, Replica]:
    """Two replicas under a prefill bound of 1,000 tokens, ``system`` sent once: (router, its home, the other)."""
    a, b = replica("m", 0), replica("m", 1)
    bounds = CapacitySettings(max_requests=max_requests, max_prefill_tokens=1000)
    router, _ = build([PoolSpec("m", "t", capacity=bounds)], {"m": [a, b]}, policy=policy)
    home = _pick(router, "a question", system)
    return router, home, b if home is a else a


def _pick(router: Router, text: str, system: str) -> Replica:
    picked = router.route("m", chat(text, system=system), 1000, 10)(set())
    assert picked is not None
    return picked
