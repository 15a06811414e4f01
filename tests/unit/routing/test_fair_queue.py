"""Weighted deficit round-robin: order, bounds, expiry and fairness properties."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from routing.fair_queue import FairQueue, FairQueueConfig, Rejected, RejectReason, Ticket

FAR = 1e9  # a deadline that never passes in these tests


def drain(q: FairQueue[str], now: float = 0.0) -> list[str]:
    out: list[str] = []
    while (item := q.pop(now)) is not None:
        out.append(item)
    return out


def test_equal_weights_alternate_per_quantum() -> None:
    q: FairQueue[str] = FairQueue(FairQueueConfig(quantum_tokens=100))
    for i in range(3):
        q.push("a", f"a{i}", 100, 0.0, FAR)
        q.push("b", f"b{i}", 100, 0.0, FAR)
    assert drain(q) == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_weights_share_tokens_not_requests() -> None:
    # a weight 2, b weight 1, quantum 100: per round a gets 200 tokens, b 100.
    q: FairQueue[str] = FairQueue(FairQueueConfig(quantum_tokens=100), weights={"a": 2.0})
    for i in range(4):
        q.push("a", f"a{i}", 100, 0.0, FAR)
    q.push("b", "b-big", 200, 0.0, FAR)  # needs two rounds of b's credit
    q.push("b", "b-small", 100, 0.0, FAR)
    # round 1: a0 a1 (200), b has 100 < 200; round 2: a2 a3, b has 200 -> b-big; round 3: b-small.
    assert drain(q) == ["a0", "a1", "a2", "a3", "b-big", "b-small"]


def test_queue_length_bound_rejects_with_429() -> None:
    q: FairQueue[str] = FairQueue(FairQueueConfig(max_queue_length=2, retry_after_s=2.5))
    assert isinstance(q.push("a", "1", 10, 0.0, FAR), Ticket)
    assert isinstance(q.push("a", "2", 10, 0.0, FAR), Ticket)
    rejected = q.push("a", "3", 10, 0.0, FAR)
    assert rejected == Rejected(RejectReason.QUEUE_FULL, 2.5)
    assert RejectReason.QUEUE_FULL.status == 429
    # The bound is per tenant: another tenant still gets in.
    assert isinstance(q.push("b", "1", 10, 0.0, FAR), Ticket)


def test_expire_returns_items_past_their_wait_with_503() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a", "soon", 10, now=0.0, deadline=1.0)
    q.push("a", "later", 10, now=0.0, deadline=5.0)
    q.push("b", "b-soon", 10, now=0.0, deadline=2.0)
    assert q.next_deadline() == 1.0
    assert q.expire(0.5) == []
    assert q.expire(2.0) == ["soon", "b-soon"]
    assert len(q) == 1 and RejectReason.WAIT_EXCEEDED.status == 503
    assert drain(q, 3.0) == ["later"]


def test_pop_never_serves_an_expired_item() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a", "stale", 10, now=0.0, deadline=1.0)
    q.push("a", "fresh", 10, now=0.0, deadline=9.0)
    assert q.pop(2.0) == "fresh"
    assert q.expire(2.0) == ["stale"]  # set aside by pop, handed back here


def test_cancel_removes_a_waiting_request() -> None:
    q: FairQueue[str] = FairQueue()
    t = q.push("a", "gone", 10, 0.0, FAR)
    q.push("a", "kept", 10, 0.0, FAR)
    assert isinstance(t, Ticket) and q.cancel(t) and not q.cancel(t)
    assert drain(q) == ["kept"] and q.queued("a") == 0


def test_idle_tenant_does_not_bank_credit() -> None:
    q: FairQueue[str] = FairQueue(FairQueueConfig(quantum_tokens=100))
    q.push("a", "a0", 10, 0.0, FAR)
    assert drain(q) == ["a0"]  # a leaves with 90 unused credit, which is dropped
    for i in range(3):
        q.push("a", f"a{i + 1}", 100, 0.0, FAR)
        q.push("b", f"b{i}", 100, 0.0, FAR)
    assert drain(q)[:2] == ["a1", "b0"]


def test_costs_far_above_quantum_still_progress() -> None:
    q: FairQueue[str] = FairQueue(FairQueueConfig(quantum_tokens=1))
    q.push("a", "huge", 1_000_000, 0.0, FAR)
    q.push("b", "huger", 3_000_000, 0.0, FAR)
    assert drain(q) == ["huge", "huger"]


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.integers(1, 5), min_size=2, max_size=4),
    costs=st.lists(st.integers(1, 400), min_size=1, max_size=20),
)
def test_backlogged_shares_converge_to_weight_shares(weights: list[int], costs: list[int]) -> None:
    quantum = 256
    names = [f"t{i}" for i in range(len(weights))]
    q: FairQueue[int] = FairQueue(FairQueueConfig(quantum_tokens=quantum, max_queue_length=10_000))
    for name, w in zip(names, weights, strict=True):
        q.set_weight(name, float(w))
    pushed = {n: 0 for n in names}

    def refill() -> None:  # keep every tenant backlogged
        for i, name in enumerate(names):
            while q.queued(name) < 3:
                cost = costs[(pushed[name] + i) % len(costs)]
                q.push(name, i * 1_000_000 + cost, cost, 0.0, FAR)
                pushed[name] += 1

    served = {n: 0 for n in names}
    refill()
    for _ in range(3000):
        item = q.pop(0.0)
        assert item is not None
        served[names[item // 1_000_000]] += item % 1_000_000
        refill()
    total = sum(served.values())
    for name, w in zip(names, weights, strict=True):
        ideal = total * w / sum(weights)
        # DRR bound: within one quantum-round plus one maximum request of the ideal share.
        slack = quantum * sum(weights) + 2 * max(costs)
        assert abs(served[name] - ideal) <= slack, (served, weights)


@settings(max_examples=60, deadline=None)
@given(
    flood=st.integers(10, 500),
    flood_cost=st.integers(1, 300),
    victim_cost=st.integers(1, 300),
    flood_weight=st.integers(1, 8),
)
def test_flood_delays_another_tenant_by_at_most_one_round(
    flood: int, flood_cost: int, victim_cost: int, flood_weight: int
) -> None:
    quantum = 300  # at least the largest request, so every visit serves the head
    q: FairQueue[str] = FairQueue(FairQueueConfig(quantum_tokens=quantum, max_queue_length=1000))
    q.set_weight("flood", float(flood_weight))
    for i in range(flood):
        q.push("flood", f"f{i}", flood_cost, 0.0, FAR)
    q.pop(0.0)  # the flooder is mid-round when the victim arrives
    q.push("victim", "v", victim_cost, 0.0, FAR)
    order = drain(q)
    # In one round the flooder sends at most (its quantum + carried deficit) / cost requests.
    one_round = (2 * quantum * flood_weight) // flood_cost + 1
    assert order.index("v") <= one_round


def test_held_tenants_keep_their_place_and_earn_nothing() -> None:
    q: FairQueue[str] = FairQueue(FairQueueConfig(quantum_tokens=100))
    for i in range(2):
        q.push("a", f"a{i}", 100, 0.0, FAR)
        q.push("b", f"b{i}", 100, 0.0, FAR)
    hold_a = lambda tenant: tenant == "a"  # noqa: E731
    assert q.pop(0.0, hold_a) == "b0"
    assert q.pop(0.0, hold_a) == "b1"
    assert q.pop(0.0, hold_a) is None  # only a is left, and it is held
    assert q.queued("a") == 2
    assert drain(q) == ["a0", "a1"]


def test_a_held_tenant_does_not_stop_others_earning_credit() -> None:
    q: FairQueue[str] = FairQueue(FairQueueConfig(quantum_tokens=100))
    q.push("a", "a0", 100, 0.0, FAR)
    q.push("b", "b-big", 450, 0.0, FAR)  # five rounds of b's credit
    assert q.pop(0.0, lambda tenant: tenant == "a") == "b-big"
    assert q.pop(0.0, lambda tenant: True) is None
    assert drain(q) == ["a0"]
