"""Stall detection: a replica holding streams of which none received a byte for stall_after_s."""

from __future__ import annotations

from common.breaker import BreakerConfig, CircuitBreaker
from replicas.replica import DEFAULT_STALL_AFTER_S, Claim, ProbeResult, Replica, ReplicaState


def replica(**fields: object) -> Replica:
    breaker = CircuitBreaker(BreakerConfig(failures=5, cooldown_s=5.0, trial_timeout_s=None))
    return Replica("r", "http://r", "m", "t", "m", False, breaker, state=ReplicaState.HEALTHY, **fields)  # type: ignore[arg-type]


def test_a_replica_without_streams_is_never_stalled() -> None:
    r = replica(stall_after_s=5.0)
    r.last_progress_at = 0.0
    assert not r.stalled(1000.0)
    Claim(r, 100, 10, 10.0)  # not streamed: shows no progress until whole, so not judged
    assert not r.stalled(1000.0)


def test_streams_silent_for_stall_after_s_make_it_stalled_until_a_byte_arrives() -> None:
    r = replica(stall_after_s=5.0)
    claim = Claim(r, 100, 10, 10.0, streamed=True)
    assert not r.stalled(14.9)
    assert r.stalled(15.0)  # 10.0 + 5.0: no byte since the stream began
    r.last_progress_at = 20.0  # a chunk on any of its streams
    assert not r.stalled(24.9)
    assert r.stalled(25.0)
    claim.release()
    assert not r.stalled(100.0) and r.streams == 0


def test_old_progress_of_an_idle_replica_does_not_count_against_its_next_stream() -> None:
    r = replica(stall_after_s=5.0)
    r.last_progress_at = 0.0  # its last stream ended long ago
    Claim(r, 100, 10, 100.0, streamed=True)
    assert not r.stalled(104.0)
    assert r.stalled(105.0)
    # A second stream joining does not move the clock: the replica already held one.
    Claim(r, 100, 10, 104.0, streamed=True)
    assert r.stalled(105.0) and r.streams == 2


def test_episodes_are_counted_once_as_they_begin_and_noted_as_they_end() -> None:
    r = replica(stall_after_s=2.0)
    Claim(r, 100, 10, 0.0, streamed=True)
    assert r.track_stall(1.0) is None
    assert r.track_stall(2.0) == "began" and r.stalled_since == 2.0
    assert r.track_stall(3.0) is None  # the same episode
    r.last_progress_at = 3.5
    assert r.track_stall(4.0) == "ended" and r.stalled_since is None
    assert r.track_stall(5.5) == "began"
    assert r.stall_episodes == 2
    snapshot = r.snapshot(5.5)
    assert snapshot["stalled"] is True and snapshot["stall_episodes"] == 2


def test_the_default_threshold() -> None:
    assert replica().stall_after_s == DEFAULT_STALL_AFTER_S == 5.0


def test_alive_is_what_the_health_checks_vouch_for() -> None:
    r = replica()
    assert r.alive()  # healthy: its probes pass (or time out while it still sends bytes)
    for state in (ReplicaState.DOWN, ReplicaState.FAILED, ReplicaState.STARTING):
        r.state = state
        assert not r.alive(), state
    r.state = ReplicaState.DRAINING  # probed, never taken down: its last probe decides
    assert r.alive()
    r.last_probe = ProbeResult("/health", None, "timeout")
    assert r.alive()
    r.last_probe = ProbeResult("/health", None, "ClientConnectorError: refused")
    assert not r.alive()
    r.last_probe = ProbeResult("/health", 503)
    assert not r.alive()
    unprobed = replica(probe="none")
    assert not unprobed.alive()  # no witness at all
