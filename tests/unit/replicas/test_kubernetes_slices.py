"""EndpointSlices -> desired replicas, and the retry backoff (pure: no I/O, no cluster).

The slices are written out as the API serves them (discovery.k8s.io/v1 JSON).
"""

from __future__ import annotations

import random
from typing import Any

from gateway.settings import KubernetesSource
from replicas.kubernetes import WatchTiming, backoff_delay, desired_replicas, endpoint_routable, slice_port

VLLM = KubernetesSource(service="vllm", namespace="ns")


def ep(address: str, pod: str | None = None, **conditions: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"addresses": [address], "conditions": conditions}
    if pod is not None:
        out["targetRef"] = {"kind": "Pod", "name": pod, "namespace": "ns"}
    return out


def eps(name: str, endpoints: list[dict[str, Any]], ports: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": {"kubernetes.io/service-name": "vllm"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}] if ports is None else ports,
        "endpoints": endpoints,
    }


def test_ready_endpoints_become_replicas_named_after_their_pods() -> None:
    s = eps("vllm-abc", [ep("10.0.0.1", "vllm-0", ready=True), ep("10.0.0.2", "vllm-1", ready=True)])
    assert desired_replicas([s], VLLM) == {
        "vllm-vllm-0": "http://10.0.0.1:8000",
        "vllm-vllm-1": "http://10.0.0.2:8000",
    }


def test_not_ready_and_terminating_are_left_out() -> None:
    s = eps(
        "vllm-abc",
        [
            ep("10.0.0.1", "up", ready=True),
            ep("10.0.0.2", "loading", ready=False),
            # publishNotReadyAddresses keeps a terminating pod "ready"; it is draining all the same.
            ep("10.0.0.3", "stopping", ready=True, serving=True, terminating=True),
            ep("10.0.0.4", "gone", ready=False, serving=False, terminating=True),
        ],
    )
    assert desired_replicas([s], VLLM) == {"vllm-up": "http://10.0.0.1:8000"}


def test_missing_conditions_mean_ready_and_not_terminating() -> None:
    # The API: "a nil value should be interpreted as true" for ready, false for terminating.
    assert endpoint_routable({"addresses": ["10.0.0.1"]})
    assert endpoint_routable({"addresses": ["10.0.0.1"], "conditions": {}})
    assert endpoint_routable({"addresses": ["10.0.0.1"], "conditions": {"ready": None}})
    assert not endpoint_routable({"addresses": ["10.0.0.1"], "conditions": {"ready": False}})
    assert not endpoint_routable({"addresses": ["10.0.0.1"], "conditions": {"terminating": True}})


def test_without_target_ref_the_address_names_the_replica() -> None:
    s = eps("vllm-abc", [ep("10.0.0.9")])
    assert desired_replicas([s], VLLM) == {"vllm-10.0.0.9": "http://10.0.0.9:8000"}


def test_port_by_name_by_number_and_default_first() -> None:
    ports = [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}]
    s = eps("vllm-abc", [ep("10.0.0.1", "p")], ports=ports)
    assert slice_port(s, None) == 9090  # the slice's first port
    assert slice_port(s, "http") == 8000
    assert slice_port(s, 8000) == 8000
    assert slice_port(s, "8000") == 8000  # port names need a letter: digits are a number
    assert slice_port(s, "grpc") is None
    assert slice_port(s, 7000) is None
    by_name = KubernetesSource(service="vllm", port="http", scheme="https")
    assert desired_replicas([s], by_name) == {"vllm-p": "https://10.0.0.1:8000"}


def test_slices_without_numbered_ports_need_a_configured_number() -> None:
    # A port entry without a number means "all ports"; a headless Service may declare none.
    all_ports = eps("a", [ep("10.0.0.1", "p")], ports=[{"name": "", "protocol": "TCP"}])
    no_ports = eps("b", [ep("10.0.0.2", "q")], ports=[])
    for s in (all_ports, no_ports):
        assert slice_port(s, None) is None
        assert slice_port(s, "http") is None
        assert slice_port(s, 8000) == 8000  # the configured number is the only port there is
    assert desired_replicas([all_ports, no_ports], VLLM) == {}
    numbered = KubernetesSource(service="vllm", port=8000)
    assert desired_replicas([all_ports, no_ports], numbered) == {
        "vllm-p": "http://10.0.0.1:8000",
        "vllm-q": "http://10.0.0.2:8000",
    }


def test_ipv6_addresses_are_bracketed() -> None:
    s = eps("vllm-v6", [ep("fd00::1", "p6")])
    s["addressType"] = "IPv6"
    assert desired_replicas([s], VLLM) == {"vllm-p6": "http://[fd00::1]:8000"}


def test_union_of_slices_with_duplicates_counted_once() -> None:
    # While the controller rebalances, one pod may sit in two slices for a moment.
    a = eps("vllm-a", [ep("10.0.0.1", "p1"), ep("10.0.0.2", "p2")])
    b = eps("vllm-b", [ep("10.0.0.2", "p2"), ep("10.0.0.3", "p3")])
    expected = {
        "vllm-p1": "http://10.0.0.1:8000",
        "vllm-p2": "http://10.0.0.2:8000",
        "vllm-p3": "http://10.0.0.3:8000",
    }
    assert desired_replicas([a, b], VLLM) == expected
    assert list(desired_replicas([b, a], VLLM)) == list(expected)  # order of slices does not matter


def test_same_address_on_other_ports_is_another_replica() -> None:
    # Two slices (two pods' worth of ports) on one address: distinct address:port pairs.
    a = eps("vllm-a", [ep("127.0.0.1", "pa")], ports=[{"name": "http", "port": 8001}])
    b = eps("vllm-b", [ep("127.0.0.1", "pb")], ports=[{"name": "http", "port": 8002}])
    assert desired_replicas([a, b], VLLM) == {"vllm-pa": "http://127.0.0.1:8001", "vllm-pb": "http://127.0.0.1:8002"}


def test_first_address_is_used_and_empty_endpoints_skipped() -> None:
    two = {"addresses": ["10.0.0.1", "10.0.0.7"], "targetRef": {"name": "p"}}
    s = eps("vllm-a", [two, {"addresses": [], "conditions": {"ready": True}}])
    s.pop("endpoints")
    assert desired_replicas([s], VLLM) == {}  # "endpoints": missing (a slice with none yet)
    s["endpoints"] = [two, {"addresses": [], "conditions": {"ready": True}}]
    assert desired_replicas([s], VLLM) == {"vllm-p": "http://10.0.0.1:8000"}


def test_no_slices_no_replicas() -> None:
    assert desired_replicas([], VLLM) == {}


def test_backoff_doubles_is_capped_and_jittered() -> None:
    timing = WatchTiming(backoff_initial_s=0.5, backoff_max_s=30.0)
    rng = random.Random(7)
    assert backoff_delay(0, timing, rng) == 0.0
    # Ceilings 0.5, 1, 2, 4, ... capped at 30; each delay lies in [ceiling/2, ceiling].
    for failures, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (7, 30.0), (10_000, 30.0)]:
        delays = [backoff_delay(failures, timing, rng) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(set(delays)) > 1
