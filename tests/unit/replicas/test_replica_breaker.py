"""A replica's breaker as routing and the proxy drive it: one trial, handed back by its claim."""

from __future__ import annotations

import random

from common.breaker import BreakerConfig, BreakerState, CircuitBreaker
from replicas.replica import Claim, Replica, ReplicaState
from routing.policies import LeastOutstandingTokens, LeastRequests, RoundRobin, RouteRequest


def replica(rid: str, tokens: int = 0) -> Replica:
    config = BreakerConfig(failures=2, cooldown_s=10.0, trial_timeout_s=None)
    r = Replica(rid, f"http://{rid}", "m", "t", "m", False, CircuitBreaker(config), state=ReplicaState.HEALTHY)
    r.outstanding_tokens = tokens
    return r


def opened(r: Replica, now: float) -> Replica:
    r.breaker.record_failure(now)
    r.breaker.record_failure(now)
    assert r.breaker.state is BreakerState.OPEN
    return r


def test_after_the_cool_down_one_request_is_the_trial_and_no_other_follows() -> None:
    back = opened(replica("back"), 0.0)  # the emptiest replica, just past its cool-down
    busy = replica("busy", tokens=5_000)
    policy = LeastOutstandingTokens(random.Random(1))
    first = policy.pick([back, busy], RouteRequest(), 10.0).replica
    assert first is back
    trial = Claim(back, 100, 10, 10.0)
    assert back.breaker.state is BreakerState.HALF_OPEN
    # A burst of least-loaded picks while the trial is in flight: none goes to it.
    for t in (10.0, 10.1, 11.0, 100.0):
        assert policy.pick([back, busy], RouteRequest(), t).replica is busy
        assert not back.routable(t)
    assert back.snapshot(11.0)["breaker_open"] is True
    back.breaker.record_success()  # the proxy saw the trial through
    trial.release()
    assert back.routable(100.0)
    assert policy.pick([back, busy], RouteRequest(), 100.0).replica is back


def test_failed_trial_keeps_it_out_for_another_cool_down() -> None:
    r = opened(replica("r"), 0.0)
    claim = Claim(r, 100, 10, 10.0)
    r.breaker.record_failure(10.5)
    claim.release()
    assert not r.routable(20.4)
    assert r.routable(20.5)


def test_trial_released_without_an_outcome_frees_the_slot() -> None:
    # The client left (cancelled) or the deadline passed: the proxy records nothing.
    r = opened(replica("r"), 0.0)
    other = replica("other", tokens=5_000)
    claim = Claim(r, 100, 10, 10.0, streamed=True)
    assert not r.routable(10.0)
    claim.release()
    assert r.routable(10.0)  # not stuck half-open: the next request is the trial
    assert RoundRobin().pick([r, other], RouteRequest(), 10.0).replica is r
    Claim(r, 100, 10, 10.0)
    assert not r.routable(10.0)


def test_claims_on_a_closed_breaker_take_no_trial() -> None:
    r = replica("r")
    claims = [Claim(r, 10, 10, 0.0) for _ in range(3)]
    assert r.breaker.trial is None and r.routable(0.0)
    for claim in claims:
        claim.release()
    assert (r.outstanding_requests, r.outstanding_tokens) == (0, 0)


def test_a_request_sent_before_the_breaker_opened_does_not_free_the_trial() -> None:
    r = replica("r")
    straggler = Claim(r, 1, 1, 0.0)  # sent while closed, still running
    opened(r, 1.0)
    trial = Claim(r, 1, 1, 11.0)
    straggler.release()  # ends without an outcome (its client left)
    assert not r.routable(11.0)
    trial.release()
    assert LeastRequests(random.Random(1)).pick([r], RouteRequest(), 11.0).replica is r
