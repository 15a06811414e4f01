"""Health-state transitions and /metrics parsing (no network: the probe result is given)."""

from __future__ import annotations

from replicas.health import HealthChecker, parse_vllm_metrics
from replicas.replica import Breaker, Replica, ReplicaState

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 1200.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 0.0
vllm:gpu_cache_usage_perc{engine="0"} 0.9
python_gc_objects_collected_total{generation="0"} 5.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} NaN-garbage
"""


def test_parse_sums_engines_and_keeps_known_names() -> None:
    assert parse_vllm_metrics(VLLM_METRICS) == {
        "vllm:num_requests_running": 5.0,
        "vllm:num_requests_waiting": 1.0,
        "vllm:kv_cache_usage_perc": 0.25,
        "vllm:prefix_cache_hits_total": 1200.0,
    }


def make() -> tuple[HealthChecker, Replica]:
    checker = HealthChecker(None, interval_s=1.0, timeout_s=1.0, failures_to_down=3)  # type: ignore[arg-type]
    return checker, Replica("r", "http://r", "m", "t", "m", True, Breaker(3, 5.0))


def test_starting_becomes_healthy_on_first_good_probe() -> None:
    checker, r = make()
    checker._apply(r, False)
    assert r.state is ReplicaState.STARTING
    checker._apply(r, True)
    assert r.state is ReplicaState.HEALTHY


def test_down_after_consecutive_failures_and_back() -> None:
    checker, r = make()
    checker._apply(r, True)
    checker._apply(r, False)
    checker._apply(r, False)
    assert r.state is ReplicaState.HEALTHY
    checker._apply(r, False)
    assert r.state is ReplicaState.DOWN
    assert r.probe_failures == 3
    checker._apply(r, True)
    assert r.state is ReplicaState.HEALTHY


def test_draining_and_failed_are_left_alone() -> None:
    checker, r = make()
    for state in (ReplicaState.DRAINING, ReplicaState.FAILED):
        r.state = state
        checker._apply(r, True)
        assert r.state is state


def test_breaker_reopens_after_failed_trial() -> None:
    b = Breaker(threshold=2, cooldown_s=5.0)
    assert not b.record_failure(0.0)
    assert b.record_failure(0.0)  # opened
    assert not b.allows(4.9)
    assert b.allows(5.0)  # half-open: one trial
    assert b.record_failure(5.0)  # the trial failed: open again from now
    assert not b.allows(9.9)
    b.record_success()
    assert b.allows(9.9) and not b.is_open
