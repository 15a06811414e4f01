"""The fair admission queue's asyncio edge: fast path, wake order, expiry, departures.

The clock is a variable the tests move; nothing sleeps. ``settle()`` lets woken tasks run
(one loop iteration each), which is scheduling, not waiting for time to pass.
"""

from __future__ import annotations

import asyncio

import pytest

from common.breaker import BreakerConfig, CircuitBreaker
from replicas.replica import Claim, Replica, ReplicaState
from routing.admission import Admission, Admitted
from routing.band_queue import BandLimits
from routing.capacity import Capacity
from routing.fair_queue import FairQueueConfig, Rejected, RejectReason

FAR = 1e9


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replica(rid: str) -> Replica:
    breaker = CircuitBreaker(BreakerConfig(2, 10.0))
    return Replica(rid, f"http://{rid}", "m", "default", "m", False, breaker, state=ReplicaState.HEALTHY)


def admission(
    replicas: list[Replica], clock: Clock, *, max_requests: int = 1, queue_length: int = 10, **weights: float
) -> Admission:
    return Admission(
        replicas,
        Capacity(max_requests=max_requests),
        FairQueueConfig(quantum_tokens=100, max_queue_length=queue_length, retry_after_s=2.0),
        weights=dict(weights),
        clock=clock,
        poll_interval_s=3600,  # the tests call poll() themselves
    )


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class Served:
    """Requests that got in, in order; each holds its replica slot until ``finish``."""

    def __init__(self, adm: Admission, replica: Replica) -> None:
        self.adm, self.replica = adm, replica
        self.order: list[str] = []
        self.outcomes: dict[str, Admitted | Rejected] = {}

    async def request(self, tenant: str, name: str, deadline: float = FAR, cost: int = 100) -> None:
        outcome = await self.adm.wait(tenant, cost, deadline)
        self.outcomes[name] = outcome
        if isinstance(outcome, Admitted):
            self.replica.outstanding_requests += 1  # the claim, taken without awaiting
            self.order.append(name)

    def finish(self) -> None:
        self.replica.outstanding_requests -= 1
        self.adm.notify()


async def test_fast_path_while_a_replica_has_room() -> None:
    r = replica("a")
    adm = admission([r], Clock(), max_requests=2)
    assert adm.ready(0.0)
    r.outstanding_requests = 2
    assert not adm.ready(0.0)


async def test_disabled_or_unbounded_is_always_ready() -> None:
    r = replica("a")
    r.outstanding_requests = 10**6
    adm = Admission([r], Capacity(max_requests=None), FairQueueConfig(), clock=Clock())
    assert adm.ready(0.0)


async def test_flooding_tenant_does_not_starve_another() -> None:
    r = replica("a")
    r.outstanding_requests = 1  # the one slot is taken
    adm = admission([r], Clock())
    served = Served(adm, r)
    tasks = [asyncio.create_task(served.request("flood", f"f{i}")) for i in range(6)]
    await settle()
    tasks.append(asyncio.create_task(served.request("quiet", "q0")))
    await settle()
    assert adm.queued == 7
    # Free the slot six times (the first time: the request that held it before the test).
    # WDRR visits flood then quiet each round; quantum = cost = 100, one request per visit.
    for _ in range(6):
        served.finish()
        await settle()
    assert served.order[:2] == ["f0", "q0"]
    assert adm.queued == 1 and adm.waking == 0
    for t in tasks:
        t.cancel()


async def test_weights_share_the_slots() -> None:
    r = replica("a")
    r.outstanding_requests = 1
    adm = admission([r], Clock(), heavy=2.0)
    served = Served(adm, r)
    tasks = [asyncio.create_task(served.request("heavy", f"h{i}")) for i in range(4)]
    tasks += [asyncio.create_task(served.request("light", f"l{i}")) for i in range(4)]
    await settle()
    for _ in range(6):
        served.finish()
        await settle()
    # Per round heavy earns 200 tokens (two requests), light 100 (one).
    assert served.order == ["h0", "h1", "l0", "h2", "h3", "l1"]
    for t in tasks:
        t.cancel()


async def test_queue_full_is_rejected_with_retry_after() -> None:
    r = replica("a")
    r.outstanding_requests = 1
    adm = admission([r], Clock(), queue_length=2)
    served = Served(adm, r)
    tasks = [asyncio.create_task(served.request("t", f"r{i}")) for i in range(3)]
    await settle()
    assert served.outcomes["r2"] == Rejected(RejectReason.QUEUE_FULL, 2.0)
    assert RejectReason.QUEUE_FULL.status == 429
    for t in tasks:
        t.cancel()


async def test_waiting_past_the_deadline_is_rejected() -> None:
    clock = Clock()
    r = replica("a")
    r.outstanding_requests = 1
    adm = admission([r], clock)
    served = Served(adm, r)
    early = asyncio.create_task(served.request("t", "early", deadline=5.0))
    late = asyncio.create_task(served.request("t", "late", deadline=50.0))
    await settle()
    clock.now = 5.0
    adm.poll()
    await settle()
    assert served.outcomes["early"] == Rejected(RejectReason.WAIT_EXCEEDED, 2.0)
    assert "late" not in served.outcomes and adm.queued == 1
    r.outstanding_requests = 0
    adm.notify()
    await settle()
    assert served.order == ["late"]
    await asyncio.gather(early, late)


async def test_client_leaving_while_queued_frees_its_place() -> None:
    r = replica("a")
    r.outstanding_requests = 1
    adm = admission([r], Clock())
    served = Served(adm, r)
    gone = asyncio.create_task(served.request("t", "gone"))
    stays = asyncio.create_task(served.request("t", "stays"))
    await settle()
    gone.cancel()
    await settle()
    assert adm.queued == 1 and adm.depths() == {"t": 1}
    r.outstanding_requests = 0
    adm.notify()
    await settle()
    assert served.order == ["stays"]
    assert adm.queued == 0 and adm.waking == 0
    assert adm.ready(0.0) is False  # stays holds the only slot
    served.finish()
    assert adm.ready(0.0)
    await stays
    with pytest.raises(asyncio.CancelledError):
        await gone


async def test_client_leaving_after_being_woken_hands_the_slot_on() -> None:
    r = replica("a")
    r.outstanding_requests = 1
    adm = admission([r], Clock())
    served = Served(adm, r)
    first = asyncio.create_task(served.request("t", "first"))
    second = asyncio.create_task(served.request("t", "second"))
    await settle()
    r.outstanding_requests = 0
    adm.notify()  # wakes "first": its future is resolved, the task has not run yet
    assert adm.waking == 1
    first.cancel()  # ... and its client leaves before it runs
    await settle()
    assert served.order == ["second"]
    assert adm.waking == 0 and adm.queued == 0
    await second


async def test_a_woken_request_keeps_newcomers_off_the_fast_path() -> None:
    r = replica("a")
    r.outstanding_requests = 1
    adm = admission([r], Clock())
    served = Served(adm, r)
    task = asyncio.create_task(served.request("t", "queued"))
    await settle()
    r.outstanding_requests = 0
    adm.notify()
    assert not adm.ready(0.0)  # the free slot is promised to the woken request
    await settle()
    assert served.order == ["queued"]
    await task


async def test_nothing_routable_lets_waiters_through() -> None:
    r = replica("a")
    r.outstanding_requests = 1
    adm = admission([r], Clock())
    served = Served(adm, r)
    task = asyncio.create_task(served.request("t", "w"))
    await settle()
    r.state = ReplicaState.DOWN
    adm.poll()
    await settle()
    assert served.order == ["w"]  # on to the proxy, which answers 503 or uses a fallback
    await task


async def test_close_refuses_everyone_waiting() -> None:
    r = replica("a")
    r.outstanding_requests = 1
    adm = admission([r], Clock())
    served = Served(adm, r)
    task = asyncio.create_task(served.request("t", "w"))
    await settle()
    adm.close()
    await task
    assert served.outcomes["w"] == Rejected(RejectReason.WAIT_EXCEEDED, 2.0)


async def test_a_first_token_lets_the_next_request_in() -> None:
    """With a prefill bound, the room a streamed request held goes on at its first token."""
    r = replica("a")
    adm = Admission(
        [r],
        Capacity(max_requests=None, max_prefill_tokens=1000),
        FairQueueConfig(quantum_tokens=100),
        clock=Clock(),
        poll_interval_s=3600,
    )
    first = Claim(r, 1500, 10, 0.0, streamed=True, on_prefilled=adm.notify)
    assert not adm.ready(0.0)
    waiter = asyncio.create_task(adm.wait("t", 100, FAR))
    await settle()
    assert adm.queued == 1
    first.prefilled()  # the replica still decodes it, but its prefill is done
    await settle()
    assert isinstance(waiter.result(), Admitted)
    first.release()


def test_a_claim_reports_the_end_of_its_prefill_once_with_or_without_a_first_token() -> None:
    r = replica("a")
    ended: list[str] = []
    failed = Claim(r, 1500, 10, 0.0, streamed=True, on_prefilled=lambda: ended.append("failed"))
    failed.release()  # the replica failed before the first token
    failed.release()
    done = Claim(r, 1500, 10, 0.0, streamed=True, on_prefilled=lambda: ended.append("done"))
    done.prefilled()
    done.release()
    assert ended == ["failed", "done"]
    assert (r.prefill_requests, r.prefill_tokens, r.outstanding_requests, r.outstanding_tokens) == (0, 0, 0, 0)


@pytest.mark.parametrize("share", [True, False])
async def test_a_tenant_at_its_share_of_prefill_slots_is_held_while_another_is_active(share: bool) -> None:
    """Four replicas, one prefill slot each: two active tenants of equal weight get two each.

    With ``share_prefill`` off the queue is work-conserving: the flood refills every slot."""
    rs = [replica(f"r{i}") for i in range(4)]
    adm = Admission(
        rs,
        Capacity(max_requests=None, max_prefill_tokens=4096),
        FairQueueConfig(quantum_tokens=100),
        clock=Clock(),
        poll_interval_s=3600,
        share_prefill=share,
    )
    prefilling: dict[str, list[Claim]] = {"flood": [], "quiet": []}
    free = list(rs)

    async def request(tenant: str) -> None:
        outcome = await adm.wait(tenant, 100, FAR)
        assert isinstance(outcome, Admitted)
        adm.prefill_started(tenant)
        # An 8,000-token prompt: its replica is at the bound until the first token.
        prefilling[tenant].append(Claim(free.pop(), 8000, 10, 0.0, streamed=True))

    def first_token(tenant: str) -> None:
        claim = prefilling[tenant].pop(0)
        claim.prefilled()
        free.append(claim.replica)
        adm.prefill_ended(tenant)

    # Alone, the flood takes every slot (and more wait).
    tasks = [asyncio.create_task(request("flood")) for _ in range(8)]
    await settle()
    assert len(prefilling["flood"]) == 4 and adm.queued == 4
    # Another tenant arrives and waits; the next freed slot is its, and the flood, now at
    # or over its share of two, is not refilled as its prefills end.
    tasks.append(asyncio.create_task(request("quiet")))
    await settle()
    first_token("flood")
    await settle()
    if share:
        assert (len(prefilling["flood"]), len(prefilling["quiet"])) == (3, 1)
    # Two more end: the first freed slot is not refilled (3 -> 2, at its share), the
    # second is (1 -> 2): one slot stays free for the other tenant's next request.
    first_token("flood")
    await settle()
    first_token("flood")
    await settle()
    if share:
        assert (len(prefilling["flood"]), len(prefilling["quiet"]), len(free)) == (2, 1, 1)
    else:  # every freed slot refilled at once
        assert len(free) == 0 and len(prefilling["flood"]) >= 3
    # Once the other tenant's prefill is over it is no longer active: the flood gets them all.
    while prefilling["quiet"]:
        first_token("quiet")
    await settle()
    assert (len(prefilling["flood"]), len(free)) == (4, 0)
    for t in tasks:
        t.cancel()
    await settle()


def banded(replicas: list[Replica], clock: Clock, *, max_requests: int = 1, **kwargs: object) -> Admission:
    return Admission(
        replicas,
        Capacity(max_requests=max_requests),
        FairQueueConfig(quantum_tokens=100, max_queue_length=10, retry_after_s=2.0),
        clock=clock,
        poll_interval_s=3600,
        bands=(BandLimits("interactive"), BandLimits("standard"), BandLimits("batch", max_queued=3)),
        **kwargs,  # type: ignore[arg-type]
    )


async def test_a_saturated_pool_serves_a_higher_band_before_earlier_lower_band_requests() -> None:
    r = replica("a")
    clock = Clock()
    adm = banded([r], clock)
    order: list[str] = []

    async def request(band: int, tenant: str, name: str) -> None:
        outcome = await adm.wait(tenant, 100, FAR, band)
        assert isinstance(outcome, Admitted)
        r.outstanding_requests += 1
        order.append(name)

    r.outstanding_requests = 1  # the one slot is taken
    tasks = [asyncio.create_task(request(2, "bulk", f"batch{i}")) for i in range(3)]
    await settle()
    tasks += [asyncio.create_task(request(0, "chat", "chat0")), asyncio.create_task(request(1, "api", "api0"))]
    await settle()
    assert adm.queued == 5 and adm.band_depths()["batch"] == {"bulk": 3}
    for _ in range(5):
        r.outstanding_requests -= 1
        adm.notify()
        await settle()
    assert order == ["chat0", "api0", "batch0", "batch1", "batch2"]
    await asyncio.gather(*tasks)


async def test_a_full_lower_band_is_refused_with_429_while_higher_bands_queue() -> None:
    r = replica("a")
    adm = banded([r], Clock())
    r.outstanding_requests = 1
    tasks = [asyncio.create_task(adm.wait("bulk", 100, FAR, 2)) for _ in range(3)]
    await settle()
    refused = await adm.wait("other", 100, FAR, 2)
    assert refused == Rejected(RejectReason.BAND_FULL, 2.0)
    chat = asyncio.create_task(adm.wait("chat", 100, FAR, 0))
    await settle()
    assert adm.queued == 4 and not chat.done()
    r.outstanding_requests = 0
    adm.notify()
    await settle()
    assert isinstance(chat.result(), Admitted)
    for t in tasks:
        t.cancel()
    await settle()
    assert adm.queued == 0


async def test_the_prefill_share_is_counted_inside_the_band_being_served() -> None:
    """Two replicas, one prefill slot each. A batch tenant still in its prefill holds no share
    of the interactive band's slots: an interactive tenant alone in its band takes both."""
    rs = [replica(f"r{i}") for i in range(2)]
    adm = Admission(
        rs,
        Capacity(max_requests=None, max_prefill_tokens=4096),
        FairQueueConfig(quantum_tokens=100),
        clock=Clock(),
        poll_interval_s=3600,
        bands=(BandLimits("interactive"), BandLimits("batch")),
    )
    free = list(rs)
    claims: list[tuple[str, int, Claim]] = []

    async def request(tenant: str, band: int) -> None:
        outcome = await adm.wait(tenant, 100, FAR, band)
        assert isinstance(outcome, Admitted)
        adm.prefill_started(tenant, band)
        claims.append((tenant, band, Claim(free.pop(), 8000, 10, 0.0, streamed=True)))

    def first_token(index: int) -> None:
        tenant, band, claim = claims.pop(index)
        claim.prefilled()
        free.append(claim.replica)
        adm.prefill_ended(tenant, band)

    batch = [asyncio.create_task(request("bulk", 1)) for _ in range(4)]
    await settle()
    assert [c[0] for c in claims] == ["bulk", "bulk"] and adm.queued == 2
    chat = [asyncio.create_task(request("chat", 0)) for _ in range(2)]
    await settle()
    # Each batch prefill that ends hands its slot to the interactive tenant, not to the
    # batch backlog, and the interactive tenant is not held at a share with the batch one.
    first_token(0)
    await settle()
    first_token(0)
    await settle()
    assert sorted(c[0] for c in claims) == ["chat", "chat"] and adm.queued == 2
    first_token(0)
    first_token(0)
    await settle()
    assert [c[0] for c in claims] == ["bulk", "bulk"] and adm.queued == 0
    await asyncio.gather(*chat)
    await asyncio.gather(*batch)


async def test_a_band_held_to_a_share_of_capacity_leaves_room_for_higher_bands() -> None:
    """Four request slots; the batch band may fill half of them. The other two stay free:
    an interactive request goes straight on while batch requests wait."""
    r = replica("a")
    adm = Admission(
        [r],
        Capacity(max_requests=4),
        FairQueueConfig(quantum_tokens=100),
        clock=Clock(),
        poll_interval_s=3600,
        bands=(BandLimits("interactive"), BandLimits("batch", capacity_share=0.5)),
    )
    assert adm.ready(0.0, 1)
    r.outstanding_requests = 2  # two batch requests running: the band's share (4 x 0.5)
    assert not adm.ready(0.0, 1)
    batch = [asyncio.create_task(adm.wait("bulk", 100, FAR, 1)) for _ in range(3)]
    await settle()
    assert adm.queued == 3 and not any(t.done() for t in batch)
    # The batch backlog does not close the interactive band's fast path.
    assert adm.ready(0.0, 0)
    r.outstanding_requests = 3  # an interactive request took a reserved slot
    # One batch request ends: 2 of 4 slots still in use, the batch band's share is 2, so
    # nothing more of it starts.
    r.outstanding_requests = 2
    adm.notify()
    await settle()
    assert adm.queued == 3
    r.outstanding_requests = 1  # the interactive one ended too: one batch slot free
    adm.notify()
    await settle()
    assert adm.queued == 2 and sum(t.done() for t in batch) == 1
    for t in batch:
        t.cancel()
    await settle()
    assert adm.queued == 0


async def test_a_lower_bands_backlog_does_not_degrade_a_higher_bands_fast_path() -> None:
    r = replica("a")
    adm = banded([r], Clock(), max_requests=1)
    r.outstanding_requests = 1
    waiting = asyncio.create_task(adm.wait("bulk", 100, FAR, 2))
    await settle()
    r.outstanding_requests = 0  # a slot frees, before the timer's next look at the queue
    # An interactive newcomer may take it straight away: nothing waits in its band or above.
    assert adm.ready(0.0, 0)
    # A newcomer of the batch band may not: it would overtake the one waiting.
    assert not adm.ready(0.0, 2)
    adm.notify()
    await settle()
    assert isinstance(waiting.result(), Admitted)
