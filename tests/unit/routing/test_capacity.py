"""Replica capacity in request slots: own requests, scraped gauges, token room."""

from __future__ import annotations

from common.breaker import BreakerConfig, CircuitBreaker
from replicas.replica import Replica, ReplicaState
from routing.capacity import UNBOUNDED, Capacity, free_slots, has_room
from routing.policies import LoadModel


def replica(
    rid: str, requests: int = 0, tokens: int = 0, state: ReplicaState = ReplicaState.HEALTHY, **gauges: float
) -> Replica:
    r = Replica(rid, f"http://{rid}", "m", "default", "m", False, CircuitBreaker(BreakerConfig(2, 10.0)), state=state)
    r.outstanding_requests = requests
    r.outstanding_tokens = tokens
    r.observe({f"vllm:{k}": v for k, v in gauges.items()})
    return r


def test_request_slots_from_own_count() -> None:
    cap = Capacity(max_requests=4)
    assert cap.slots(replica("a", requests=1)) == 3
    assert cap.slots(replica("a", requests=4)) == 0
    assert cap.slots(replica("a", requests=9)) == 0


def test_gauges_count_other_pods_work() -> None:
    cap = Capacity(max_requests=10)
    # we have 2 in flight; the replica reports 6 running + 2 waiting -> 8 used -> 2 free
    assert cap.slots(replica("a", requests=2, num_requests_running=6, num_requests_waiting=2)) == 2
    # a stale scrape showing fewer than our own does not hide our own
    assert cap.slots(replica("a", requests=5, num_requests_running=1)) == 5


def test_token_room_in_typical_requests() -> None:
    cap = Capacity(max_requests=None, max_outstanding_tokens=10_000, load=LoadModel(tokens_per_request=1000))
    # 7,500 tokens owed -> 2,500 left -> ceil(2.5) = 3 slots
    assert cap.slots(replica("a", tokens=7_500)) == 3
    assert cap.slots(replica("a", tokens=10_000)) == 0
    # KV past the knee adds pressure: kv 0.9 with knee 0.8 adds 8192 * 0.5 = 4096 tokens
    assert cap.slots(replica("a", tokens=5_000, kv_cache_usage_perc=0.9)) == 1


def test_both_bounds_take_the_smaller() -> None:
    cap = Capacity(max_requests=3, max_outstanding_tokens=100_000, load=LoadModel(tokens_per_request=1000))
    assert cap.slots(replica("a", requests=1, tokens=0)) == 2


def test_unbounded() -> None:
    cap = Capacity(max_requests=None)
    assert not cap.bounded
    assert cap.slots(replica("a", requests=10**6)) == UNBOUNDED


def test_pool_room_skips_unroutable_and_says_none_when_nothing_routable() -> None:
    cap = Capacity(max_requests=2)
    full, free, down = replica("a", requests=2), replica("b", requests=1), replica("c", state=ReplicaState.DOWN)
    assert free_slots([full, free, down], cap, 0.0) == 1
    assert has_room([full, free, down], cap, 0.0)
    assert not has_room([full, down], cap, 0.0)
    assert free_slots([full, down], cap, 0.0) == 0
    # nothing routable: not a capacity matter (the proxy answers 503)
    assert free_slots([down], cap, 0.0) is None
    assert has_room([down], cap, 0.0)


def test_prefill_backlog_leaves_one_slot_until_the_bound() -> None:
    cap = Capacity(max_requests=8, max_prefill_tokens=4096, load=LoadModel(tokens_per_request=500))
    r = replica("a", requests=2)
    assert cap.slots(r) == 1  # room is handed out one request at a time
    r.prefill_requests, r.prefill_tokens = 2, 4000
    assert cap.slots(r) == 1
    r.prefill_tokens = 4096
    assert cap.slots(r) == 0


def test_prefill_backlog_counts_requests_the_replica_reports_waiting() -> None:
    cap = Capacity(max_requests=None, max_prefill_tokens=4096, load=LoadModel(tokens_per_request=1000))
    # 1 of ours before its first token (3,000 tokens) + 2 waiting we did not send (2 x 1,000)
    r = replica("a")
    r.prefill_requests, r.prefill_tokens = 1, 3000
    r.observe({"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 3.0})
    assert cap.prefill_backlog(r) == 5000 and cap.slots(r) == 0
    # our own waiting requests are not counted twice
    r.observe({"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 1.0})
    assert cap.prefill_backlog(r) == 3000 and cap.slots(r) == 1
    assert cap.bounded
