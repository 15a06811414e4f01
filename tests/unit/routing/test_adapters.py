"""LoRA adapters in routing: which pool, which replicas, where to load (``routing.adapters``, ``Pool.pick``)."""

from __future__ import annotations

import pytest

from replicas.replica import ReplicaState
from routing.adapters import AdapterCatalog, AdapterSpec, load_target, serves, serving
from routing.config import CapacitySettings
from routing.router import NO_REPLICA, PoolSpec
from tests.unit.routing.test_router import build, chat, replica


def test_configured_adapters_belong_to_their_model_and_listed_ones_to_the_replicas() -> None:
    base = [replica("base", 0), replica("base", 1)]
    other = [replica("other", 0)]
    base[1].adapters = frozenset({"listed-only"})
    other[0].adapters = frozenset({"listed-only", "elsewhere"})
    catalog = AdapterCatalog([AdapterSpec("sql", "base", "/a/sql")], {"base": base, "other": other})
    assert catalog.base_of("sql") == "base"  # configured, served by no replica yet
    assert catalog.base_of("listed-only") == "base"  # the first model in order that lists it
    assert catalog.base_of("elsewhere") == "other"
    assert catalog.base_of("unknown") is None
    assert catalog.base_of("base") is None  # a model is never an adapter
    assert catalog.listing() == {"sql": "base", "listed-only": "base", "elsewhere": "other"}
    assert catalog.spec("sql") == AdapterSpec("sql", "base", "/a/sql")
    assert catalog.spec("listed-only") is None


def test_serving_and_serves() -> None:
    a, b, c = replica("m", 0), replica("m", 1), replica("m", 2, ReplicaState.DOWN)
    b.adapters = c.adapters = frozenset({"x"})
    assert serving([a, b, c], "x") == [b, c]
    assert serves([a, b, c], "x", 0.0)
    b.state = ReplicaState.DRAINING
    assert not serves([a, b, c], "x", 0.0)  # listed only by replicas out of rotation


def test_load_target_is_the_least_loaded_routable_replica() -> None:
    a, b, c = replica("m", 0), replica("m", 1), replica("m", 2, ReplicaState.DOWN)
    a.outstanding_requests, b.outstanding_requests = 3, 1
    assert load_target([a, b, c], 0.0) is b
    b.foreign_requests = 5.0  # other gateway pods keep it busy: 1 + 5 > 3
    assert load_target([a, b, c], 0.0) is a
    a.outstanding_requests, b.foreign_requests = 1, 0.0  # a tie in requests: fewer outstanding tokens
    a.outstanding_tokens, b.outstanding_tokens = 500, 100
    assert load_target([a, b, c], 0.0) is b
    assert load_target([c], 0.0) is None


@pytest.mark.parametrize("policy", ["prefix_affinity", "least_outstanding_tokens", "least_requests", "round_robin"])
def test_an_adapters_requests_go_only_to_the_replicas_that_serve_it(policy: str) -> None:
    rs = {"m": [replica("m", i) for i in range(4)]}
    rs["m"][1].adapters = rs["m"][3].adapters = frozenset({"lora"})
    rs["m"][1].outstanding_requests = 7  # the busiest replica still gets the adapter's share
    router, registry = build([PoolSpec("m", "t")], rs, policy=policy)
    chosen = set()
    for i in range(20):
        route = router.route("m", chat(f"question {i}", "system prompt " * 100), 10, 10)
        route.adapter = "lora"
        replica_ = route(set())
        assert replica_ is not None
        chosen.add(replica_.id)
    assert chosen <= {"m-1", "m-3"}
    # The pool's policy chose, as for any request: its decisions are counted under the pool's model.
    decided = sum(
        s.value
        for m in registry.collect()
        if m.name == "fleetgate_routing_decisions"
        for s in m.samples
        if s.name.endswith("_total") and s.labels["model"] == "m"
    )
    assert decided == 20


def test_an_adapter_with_no_routable_replica_has_no_fallback() -> None:
    rs = {"m": [replica("m", 0), replica("m", 1)], "small": [replica("small", 0)]}
    rs["m"][0].adapters = frozenset({"lora"})
    rs["m"][0].state = ReplicaState.DOWN
    router, _ = build([PoolSpec("m", "t", ("small",)), PoolSpec("small", "s")], rs)
    route = router.route("m", chat("hi"), 10, 10)
    route.adapter = "lora"
    # Neither the pool's other replica nor the fallback model serves the adapter.
    assert route.next_attempt(0.0, set(), 0, None) == NO_REPLICA
    plain = router.route("m", chat("hi"), 10, 10)
    assert plain.next_attempt(0.0, set(), 0, None) is rs["m"][1]


def test_retries_stay_among_the_adapters_replicas() -> None:
    rs = {"m": [replica("m", i) for i in range(3)]}
    rs["m"][0].adapters = rs["m"][2].adapters = frozenset({"lora"})
    router, _ = build([PoolSpec("m", "t")], rs, policy="round_robin")
    route = router.route("m", chat("hi"), 10, 10)
    route.adapter = "lora"
    first = route({"none"})
    assert first is not None
    second = route({first.id})
    assert second is not None and {first.id, second.id} == {"m-0", "m-2"}
    assert route({"m-0", "m-2"}) is None


def test_room_is_looked_for_among_the_adapters_replicas_only() -> None:
    rs = {"m": [replica("m", i) for i in range(3)]}
    rs["m"][0].adapters = rs["m"][1].adapters = frozenset({"lora"})
    rs["m"][0].outstanding_requests = 2  # full; m-1 has room; m-2 has room but not the adapter
    router, _ = build([PoolSpec("m", "t", capacity=CapacitySettings(max_requests=2))], rs, policy="round_robin")
    route = router.route("m", chat("hi"), 10, 10)
    route.adapter = "lora"
    assert [route(set()).id for _ in range(4)] == ["m-1"] * 4  # type: ignore[union-attr]
    rs["m"][1].outstanding_requests = 2  # both of its replicas full: still one of them, never m-2
    assert {route(set()).id for _ in range(4)} <= {"m-0", "m-1"}  # type: ignore[union-attr]
