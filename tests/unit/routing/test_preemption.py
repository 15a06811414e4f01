"""Preemption between bands (``routing.preemption``): which bands preempt, where a
preemptible band's work goes, how often a stream may move; and what the admission, the
capacity, the claims and the routes make of it."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry

from replicas.replica import Claim, ReplicaState
from routing.admission import Admission
from routing.band_queue import BandLimits
from routing.bands import Bands
from routing.capacity import Capacity
from routing.config import DEFAULT_MAX_PREEMPTIONS, BandSettings, RoutingSettings
from routing.fair_queue import FairQueueConfig
from routing.metrics import RoutingMetrics
from routing.preemption import avoiding, has_haven, has_refuge, may_preempt, preempting_bands
from routing.router import PoolSpec, Router
from tests.unit.routing.test_router import chat, replica

BANDS = (BandLimits("interactive"), BandLimits("standard"), BandLimits("batch", preemptible=True))


def test_only_a_non_preemptible_band_above_a_preemptible_one_preempts() -> None:
    assert preempting_bands([False, False, True]) == (True, True, False)
    assert preempting_bands([False, False, False]) == (False, False, False)
    # A preemptible band does not preempt the one below it; a band below every preemptible
    # one has nothing to preempt.
    assert preempting_bands([False, True, True, False]) == (True, False, False, False)
    assert preempting_bands([True]) == (False,)


def test_a_preemptible_band_avoids_replicas_running_preempting_work() -> None:
    a, b, c = replica("m", 0), replica("m", 1), replica("m", 2)
    assert avoiding([a, b, c], {"m-2"}) is None  # nothing to avoid: the pick is as without bands
    b.preempting = 1
    assert avoiding([a, b, c], {"m-2"}) == {"m-1", "m-2"}


def test_a_stream_moves_only_where_another_replica_can_take_it() -> None:
    a, b = replica("m", 0), replica("m", 1)
    assert has_refuge(a, [a, b], 0.0) and has_haven(a, [a, b], 0.0)
    b.preempting = 1
    assert has_refuge(a, [a, b], 0.0)  # it may still go there when nothing better is left
    assert not has_haven(a, [a, b], 0.0)  # but a stream that just started is not moved there
    down = replica("m", 1, ReplicaState.DOWN)
    assert not has_refuge(a, [a, down], 0.0) and not has_refuge(a, [a], 0.0)


def test_a_stream_is_preempted_at_most_its_bands_bound() -> None:
    assert may_preempt(0, 2) and may_preempt(1, 2)
    assert not may_preempt(2, 2)  # it stays now, and finishes where it is
    assert not may_preempt(0, None)  # not a preemptible band


def test_bands_carry_preemptible_and_the_bound() -> None:
    bands = Bands.from_settings(
        [BandSettings(name="interactive"), BandSettings(name="batch", preemptible=True, max_preemptions=3)]
    )
    assert bands.limits[1].preemptible and not bands.limits[0].preemptible
    assert bands.max_preemptions == (None, 3)
    assert BandSettings(name="b", preemptible=True).max_preemptions == DEFAULT_MAX_PREEMPTIONS


def test_claims_count_preempting_work_until_released() -> None:
    r = replica("m", 0)
    claims = [Claim(r, 10, 10, 0.0, preempting=True), Claim(r, 10, 10, 0.0, streamed=True, preempting=True)]
    plain = Claim(r, 10, 10, 0.0)
    assert r.preempting == 2
    claims[0].release()
    claims[0].release()  # twice: counted once
    claims[1].release()
    plain.release()
    assert r.preempting == 0


def test_a_replica_running_preempting_work_has_no_room_for_a_preemptible_band() -> None:
    r = replica("m", 0)
    yields = Capacity(max_requests=4, yields=True)
    assert yields.slots(r) == 4
    r.preempting = 1
    r.outstanding_requests = 1
    assert yields.slots(r) == 0
    assert Capacity(max_requests=4).slots(r) == 3  # the other bands see the room as before


def test_admission_knows_which_bands_preempt_and_yield() -> None:
    r = replica("m", 0)
    adm = Admission([r], Capacity(max_requests=4), FairQueueConfig(), clock=lambda: 0.0, bands=BANDS)
    assert [adm.preempting(b) for b in range(3)] == [True, True, False]
    assert [adm.preemptible(b) for b in range(3)] == [False, False, True]
    r.preempting = 1
    r.outstanding_requests = 1
    assert adm.ready(0.0, 0) and not adm.ready(0.0, 2)


def build(n: int) -> Router:
    settings = RoutingSettings(policy="least_requests")
    return Router.build(
        settings,
        [PoolSpec("m", "t")],
        {"m": [replica("m", i) for i in range(n)]},
        rng=random.Random(1),
        clock=lambda: 0.0,
        metrics=RoutingMetrics(CollectorRegistry(), settings.policy),
        bands=BANDS,
    )


def test_a_preemptible_bands_route_avoids_preempting_work_while_it_can() -> None:
    router = build(3)
    a, b, c = router.pools["m"].replicas
    b.preempting = c.preempting = 1
    b.outstanding_requests = c.outstanding_requests = 1
    a.outstanding_requests = 5  # the busiest, yet the one free of higher-band work
    batch = router.route("m", chat("an item"), 10, 10)
    batch.band = 2
    assert batch(set()) is a
    # A preempted stream's continuation leaving a: the least loaded of the others, since
    # every other replica runs higher-band work.
    assert batch({"m-0"}) in (b, c)
    standard = router.route("m", chat("a job"), 10, 10)
    standard.band = 1
    assert standard(set()) in (b, c)  # other bands route as before


def test_a_routes_claim_preempts_by_its_band() -> None:
    router = build(1)
    (r,) = router.pools["m"].replicas
    route = router.route("m", chat("hi"), 10, 10)
    claims = []
    for band in (0, 1, 2):
        route.band = band
        claims.append(route.claim(r, streamed=True))
    assert [c.preempting for c in claims] == [True, True, False]
    assert r.preempting == 2
