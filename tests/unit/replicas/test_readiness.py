"""When the fleet's state is known (``replicas.readiness``): replicas in, a verdict out."""

from __future__ import annotations

from pathlib import Path

from common.breaker import BreakerConfig, CircuitBreaker
from gateway.settings import HealthSettings, ModelSettings, ReplicaSettings, RestartSettings
from replicas.fleet import Fleet
from replicas.readiness import fleet_state_known, model_state_known
from replicas.replica import ProbeKind, ProbeResult, Replica, ReplicaState

OK = ProbeResult("/health", 200)
REFUSED = ProbeResult("/health", None, "ClientConnectorError: Connect call failed")


def replica(
    *,
    managed: bool = False,
    state: ReplicaState = ReplicaState.STARTING,
    last: ProbeResult | None = None,
    probe: ProbeKind = "health",
) -> Replica:
    r = Replica("r", "http://r", "m", "t", "m", managed, CircuitBreaker(BreakerConfig(3, 5.0)), state=state)
    r.probe, r.last_probe = probe, last
    return r


def test_external_replicas_are_known_once_probed_up_or_down() -> None:
    assert not model_state_known([replica(last=OK, state=ReplicaState.HEALTHY), replica()])
    assert model_state_known([replica(last=OK, state=ReplicaState.HEALTHY), replica(last=REFUSED)])
    # Down on its first probe is known too: readiness waits for news, not for good news.
    assert model_state_known([replica(last=REFUSED)])
    # A replica that is not probed is known as it is (routable at once).
    assert model_state_known([replica(probe="none", state=ReplicaState.HEALTHY)])


def test_a_timeout_seen_late_is_no_verdict() -> None:
    assert not model_state_known([replica(last=ProbeResult("/health", None, "late"))])
    assert model_state_known([replica(last=ProbeResult("/health", None, "timeout"))])


def test_managed_replicas_are_known_once_one_is_healthy_or_all_failed() -> None:
    starting = replica(managed=True, last=REFUSED)
    healthy = replica(managed=True, last=OK, state=ReplicaState.HEALTHY)
    failed = replica(managed=True, state=ReplicaState.FAILED)
    # Probed, but refused while vLLM loads: not known until it answers.
    assert not model_state_known([starting, starting])
    assert model_state_known([starting, healthy])
    assert not model_state_known([starting, failed])
    assert model_state_known([failed, failed])
    # A healthy external replica of the same model serves it already.
    assert model_state_known([starting, replica(last=OK, state=ReplicaState.HEALTHY)])


def test_every_model_and_every_discovery_source_counts() -> None:
    up = [replica(managed=True, last=OK, state=ReplicaState.HEALTHY)]
    loading = [replica(managed=True, last=REFUSED)]
    assert fleet_state_known({"a": up, "b": up}, unlisted_sources=0)
    assert not fleet_state_known({"a": up, "b": loading}, unlisted_sources=0)
    assert not fleet_state_known({"a": up}, unlisted_sources=1)
    # A discovery source that listed no pod: known (and empty).
    assert fleet_state_known({"a": []}, unlisted_sources=0)


def test_the_fleet_waits_for_each_discovery_sources_first_list() -> None:
    model = ModelSettings(
        name="m",
        replicas=[
            ReplicaSettings(kubernetes={"service": "a"}),
            ReplicaSettings(kubernetes={"service": "b"}),
        ],
    )
    fleet = Fleet([model], HealthSettings(), restart=RestartSettings(), log_dir=Path("/tmp"))
    assert not fleet.state_known
    fleet.sync("m", {}, source=0)  # an empty list is a list
    assert not fleet.state_known
    fleet.sync("m", {"b-1": "http://10.0.0.1:8000"}, source=1)
    assert not fleet.state_known  # b-1 is not probed yet
    pod = fleet.get("b-1")
    assert pod is not None
    pod.last_probe = OK
    assert fleet.state_known
