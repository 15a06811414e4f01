"""Fleet.sync: idempotent updates per discovery source (no processes, no network)."""

from __future__ import annotations

from pathlib import Path

from gateway.settings import HealthSettings, ModelSettings, ReplicaSettings, RestartSettings
from replicas.fleet import Fleet
from replicas.replica import ReplicaState


def fleet() -> Fleet:
    model = ModelSettings(
        name="m",
        replicas=[
            ReplicaSettings(url="http://static:8000"),
            ReplicaSettings(kubernetes={"service": "a"}),  # type: ignore[arg-type]
            ReplicaSettings(kubernetes={"service": "b"}),  # type: ignore[arg-type]
        ],
    )
    return Fleet([model], HealthSettings(), restart=RestartSettings(), log_dir=Path("/tmp"))


def ids(f: Fleet) -> list[str]:
    return [r.id for r in f.by_model["m"]]


def test_sources_only_touch_their_own_replicas() -> None:
    f = fleet()
    assert ids(f) == ["m-0"]
    assert f.sync("m", {"a-1": "http://10.0.0.1:8000", "a-2": "http://10.0.0.2:8000"}, source=0) == (
        ["a-1", "a-2"],
        [],
    )
    assert f.sync("m", {"b-1": "http://10.0.1.1:8000"}, source=1) == (["b-1"], [])
    assert ids(f) == ["m-0", "a-1", "a-2", "b-1"]
    # source 0 loses a pod: only a-2 goes; the static replica and source 1's stay
    assert f.sync("m", {"a-1": "http://10.0.0.1:8000"}, source=0) == ([], ["a-2"])
    assert ids(f) == ["m-0", "a-1", "b-1"]


def test_sync_is_idempotent_and_new_replicas_start_unrouted() -> None:
    f = fleet()
    desired = {"a-1": "http://10.0.0.1:8000/"}
    f.sync("m", desired, source=0)
    replica = f.get("a-1")
    assert replica is not None and replica.state is ReplicaState.STARTING
    assert replica.base_url == "http://10.0.0.1:8000"
    replica.state = ReplicaState.HEALTHY
    assert f.sync("m", desired, source=0) == ([], [])
    assert f.get("a-1") is replica  # same object, state kept


def test_moved_pod_is_replaced() -> None:
    f = fleet()
    f.sync("m", {"a-1": "http://10.0.0.1:8000"}, source=0)
    old = f.get("a-1")
    assert f.sync("m", {"a-1": "http://10.0.0.9:8000"}, source=0) == (["a-1"], [])
    new = f.get("a-1")
    assert new is not old and new is not None and new.base_url == "http://10.0.0.9:8000"
    assert ids(f) == ["m-0", "a-1"]


def test_discovered_pods_publishing_kv_events_are_told_as_they_come_and_go() -> None:
    """A source with ``kv_events_port`` names each pod's publisher at the pod's own address."""
    from replicas.config import EventsEndpoint

    model = ModelSettings(
        name="m",
        replicas=[
            ReplicaSettings(
                kubernetes={"service": "a", "kv_events_port": 5557, "kv_events_replay_port": 5558},  # type: ignore[arg-type]
                kv_events_topic="kv",
            ),
            ReplicaSettings(kubernetes={"service": "b"}),  # type: ignore[arg-type]
        ],
    )
    f = Fleet([model], HealthSettings(), restart=RestartSettings(), log_dir=Path("/tmp"))
    assert f.kv_models == {"m"} and f.kv_endpoints == {}
    told: list[tuple[str, EventsEndpoint | None]] = []
    f.bind_kv_events(lambda rid, where: told.append((rid, where)))
    f.sync("m", {"a-1": "http://10.0.0.1:8000", "a-2": "http://[fd00::2]:8000"}, source=0)
    f.sync("m", {"b-1": "http://10.0.1.1:8000"}, source=1)  # its pods publish nothing the gateway reads
    first = EventsEndpoint("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", "kv")
    second = EventsEndpoint("tcp://[fd00::2]:5557", "tcp://[fd00::2]:5558", "kv")
    assert told == [("a-1", first), ("a-2", second)]
    assert f.kv_endpoints == {"a-1": first, "a-2": second}
    # A pod that moves is told gone then at its new address; one that goes, gone.
    told.clear()
    f.sync("m", {"a-1": "http://10.0.0.9:8000"}, source=0)
    moved = EventsEndpoint("tcp://10.0.0.9:5557", "tcp://10.0.0.9:5558", "kv")
    assert told == [("a-1", None), ("a-2", None), ("a-1", moved)]
    assert f.kv_endpoints == {"a-1": moved}


def test_a_kubernetes_source_takes_its_events_as_ports_not_endpoints() -> None:
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"kubernetes\.kv_events_port"):
        ReplicaSettings(kubernetes={"service": "a"}, kv_events="tcp://10.0.0.1:5557")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="kv_events_replay_port needs kv_events_port"):
        ReplicaSettings(kubernetes={"service": "a", "kv_events_replay_port": 5558})  # type: ignore[arg-type]
