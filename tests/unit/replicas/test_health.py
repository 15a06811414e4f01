"""Health-state transitions and /metrics parsing (no network: the probe result is given)."""

from __future__ import annotations

from collections.abc import Callable

from common.breaker import BreakerConfig, BreakerState, CircuitBreaker
from replicas.health import HealthChecker, Probe, counts_against, fallback_probe, outcome_of, parse_vllm_metrics
from replicas.replica import GAUGE_KV_CAPACITY_TOKENS, ProbeResult, Replica, ReplicaState

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


def test_the_kv_cache_size_comes_from_the_cache_config_info_labels() -> None:
    """vLLM's info series (labels as vLLM 0.32 writes them); "None" blocks: not profiled yet."""
    text = (
        'vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",'
        'hash_block_size="None",mamba_block_size="None",num_gpu_blocks="210",num_gpu_blocks_override="210",'
        'engine="0"} 1.0\n'
        'vllm:cache_config_info{block_size="128",num_gpu_blocks="None",engine="1"} 1.0\n'
    )
    assert parse_vllm_metrics(text) == {GAUGE_KV_CAPACITY_TOKENS: 210 * 128}


def make(on_down: Callable[[Replica], None] | None = None) -> tuple[HealthChecker, Replica]:
    checker = HealthChecker(
        None,  # type: ignore[arg-type]
        interval_s=1.0,
        timeout_s=1.0,
        failures_to_down=3,
        progress_window_s=10.0,
        on_down=on_down,
    )
    return checker, Replica("r", "http://r", "m", "t", "m", True, CircuitBreaker(BreakerConfig(3, 5.0)))


def test_starting_becomes_healthy_on_first_good_probe() -> None:
    checker, r = make()
    checker._apply(r, Probe.FAILED, 0.0)
    assert r.state is ReplicaState.STARTING
    checker._apply(r, Probe.OK, 0.0)
    assert r.state is ReplicaState.HEALTHY


def test_down_after_consecutive_failures_and_back() -> None:
    checker, r = make()
    checker._apply(r, Probe.OK, 0.0)
    checker._apply(r, Probe.FAILED, 0.0)
    checker._apply(r, Probe.FAILED, 0.0)
    assert r.state is ReplicaState.HEALTHY
    checker._apply(r, Probe.FAILED, 0.0)
    assert r.state is ReplicaState.DOWN
    assert r.probe_failures == 3
    checker._apply(r, Probe.OK, 0.0)
    assert r.state is ReplicaState.HEALTHY


def test_on_down_hears_of_each_fall_once() -> None:
    fallen: list[str] = []
    checker, r = make(lambda replica: fallen.append(replica.id))
    checker._apply(r, Probe.OK, 0.0)
    for _ in range(5):
        checker._apply(r, Probe.TIMEOUT, 100.0)
    assert r.state is ReplicaState.DOWN and fallen == ["r"]
    checker._apply(r, Probe.OK, 101.0)
    for _ in range(3):
        checker._apply(r, Probe.FAILED, 102.0)
    assert fallen == ["r", "r"]


def test_draining_and_failed_are_left_alone() -> None:
    checker, r = make()
    for state in (ReplicaState.DRAINING, ReplicaState.FAILED):
        r.state = state
        checker._apply(r, Probe.OK, 0.0)
        assert r.state is state


def test_breaker_reopens_after_failed_trial() -> None:
    b = CircuitBreaker(BreakerConfig(failures=2, cooldown_s=5.0))
    assert not b.record_failure(0.0)
    assert b.record_failure(0.0)  # opened
    assert not b.allow(4.9)
    assert b.allow(5.0)  # half-open: one trial
    b.record_failure(5.0)
    assert b.state is BreakerState.OPEN  # the trial failed: open again from now
    assert not b.allow(9.9)
    b.record_success()
    assert b.allow(9.9) and not b.degraded


def test_a_timeout_counts_unless_the_replica_is_streaming_to_us() -> None:
    _, r = make()
    # Idle, or never heard from: the timeout counts.
    assert counts_against(r, Probe.TIMEOUT, 100.0, 10.0)
    r.last_progress_at = 95.0
    assert counts_against(r, Probe.TIMEOUT, 100.0, 10.0)  # nothing in flight
    r.outstanding_requests = 2
    assert not counts_against(r, Probe.TIMEOUT, 100.0, 10.0)  # bytes 5 s ago on a request in flight
    assert not counts_against(r, Probe.TIMEOUT, 105.0, 10.0)  # 10 s: still inside the window
    assert counts_against(r, Probe.TIMEOUT, 105.5, 10.0)  # in flight but silent: passive agrees
    # An explicit refusal always counts; a good probe never does.
    assert counts_against(r, Probe.FAILED, 96.0, 10.0)
    assert not counts_against(r, Probe.OK, 500.0, 10.0)


def test_a_busy_replica_survives_probe_timeouts_a_silent_one_does_not() -> None:
    checker, r = make()
    checker._apply(r, Probe.OK, 0.0)
    r.outstanding_requests = 4
    for t in range(1, 20):  # probes time out every second while tokens keep arriving
        r.last_progress_at = t - 0.2
        checker._apply(r, Probe.TIMEOUT, float(t))
    assert r.state is ReplicaState.HEALTHY
    assert r.excused_probe_timeouts == 19 and r.probe_failures == 0
    # The streams stall: three more timeouts past the window take it down.
    for t in (30.0, 31.0, 32.0):
        checker._apply(r, Probe.TIMEOUT, t)
    assert r.state is ReplicaState.DOWN and r.probe_failures == 3


def test_a_probe_result_says_why_in_a_bounded_set() -> None:
    cases = {
        ProbeResult("/health", 200): ("ok", Probe.OK),
        ProbeResult("/health", 401): ("http_401", Probe.FAILED),
        ProbeResult("/v1/models", 404): ("http_404", Probe.FAILED),
        ProbeResult("/health", 429): ("http_4xx", Probe.FAILED),
        ProbeResult("/health", 503): ("http_5xx", Probe.FAILED),
        ProbeResult("/health", 204): ("http_other", Probe.FAILED),
        ProbeResult("/health", None, "timeout"): ("timeout", Probe.TIMEOUT),
        ProbeResult("/health", None, "late"): ("late", Probe.LATE),
        ProbeResult("/health", None, "ClientConnectorError: refused"): ("error", Probe.FAILED),
    }
    for result, (reason, outcome) in cases.items():
        assert (result.reason, outcome_of(result)) == (reason, outcome), result


def test_only_a_404_from_health_of_an_external_replica_falls_back_to_models() -> None:
    _, managed = make()
    external = Replica("x", "http://x", "m", "t", "m", False, CircuitBreaker(BreakerConfig(3, 5.0)))
    assert fallback_probe(external, ProbeResult("/health", 404)) == "models"
    for result in (
        ProbeResult("/health", 503),
        ProbeResult("/health", 401),
        ProbeResult("/health", None, "timeout"),
        ProbeResult("/health", None, "ClientConnectorError: refused"),
    ):
        assert fallback_probe(external, result) is None, result
    assert fallback_probe(managed, ProbeResult("/health", 404)) is None  # vLLM and the simulator have /health
    external.probe = "models"
    assert fallback_probe(external, ProbeResult("/v1/models", 404)) is None  # nothing further to try
