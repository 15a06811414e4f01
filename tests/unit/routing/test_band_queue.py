"""Priority bands over the fair queue: strict order between bands, WDRR inside one, band bounds, expiry."""

from __future__ import annotations

from routing.band_queue import BandedQueue, BandLimits, BandTicket
from routing.fair_queue import FairQueueConfig, Rejected, RejectReason

FAR = 1e9
BANDS = (BandLimits("interactive"), BandLimits("standard"), BandLimits("batch"))


def drain(q: BandedQueue[str], now: float = 0.0) -> list[str]:
    out: list[str] = []
    while (popped := q.pop(now)) is not None:
        out.append(popped[1])
    return out


def test_higher_bands_are_served_first_whatever_the_arrival_order() -> None:
    q: BandedQueue[str] = BandedQueue(BANDS, FairQueueConfig(quantum_tokens=100))
    q.push(2, "bulk", "b0", 100, 0.0, FAR)
    q.push(2, "bulk", "b1", 100, 0.0, FAR)
    q.push(1, "api", "s0", 100, 1.0, FAR)
    q.push(0, "chat", "i0", 100, 2.0, FAR)
    assert q.top() == 0 and len(q) == 4
    assert q.pop(3.0) == (0, "i0")
    # A newcomer of a higher band overtakes everything queued below it.
    q.push(0, "chat", "i1", 100, 3.0, FAR)
    assert drain(q, 3.0) == ["i1", "s0", "b0", "b1"]
    assert q.top() is None and len(q) == 0


def test_tenants_share_a_band_by_weight() -> None:
    # Inside the batch band, a (weight 2) and b (weight 1) alternate two to one, as in
    # FairQueue; the interactive request still goes first.
    q: BandedQueue[str] = BandedQueue(BANDS, FairQueueConfig(quantum_tokens=100), weights={"a": 2.0})
    for i in range(4):
        q.push(2, "a", f"a{i}", 100, 0.0, FAR)
    for i in range(2):
        q.push(2, "b", f"b{i}", 100, 0.0, FAR)
    q.push(0, "c", "c0", 100, 0.0, FAR)
    assert drain(q) == ["c0", "a0", "a1", "b0", "a2", "a3", "b1"]


def test_a_band_bound_sheds_that_band_only_with_429() -> None:
    bands = (BandLimits("interactive"), BandLimits("batch", max_queued=2))
    q: BandedQueue[str] = BandedQueue(bands, FairQueueConfig(retry_after_s=3.0))
    assert isinstance(q.push(1, "x", "1", 10, 0.0, FAR), BandTicket)
    assert isinstance(q.push(1, "y", "2", 10, 0.0, FAR), BandTicket)
    # The bound counts the band's requests, all tenants together.
    assert q.push(1, "z", "3", 10, 0.0, FAR) == Rejected(RejectReason.BAND_FULL, 3.0)
    assert RejectReason.BAND_FULL.status == 429
    # The interactive band has no bound of its own.
    for i in range(5):
        assert isinstance(q.push(0, "z", f"i{i}", 10, 0.0, FAR), BandTicket)
    # A batch request that leaves makes room for another.
    q.pop(0.0)
    assert isinstance(q.push(1, "z", "3", 10, 0.0, FAR), Rejected)
    assert drain(q) == ["i1", "i2", "i3", "i4", "1", "2"]
    assert isinstance(q.push(1, "z", "3", 10, 0.0, FAR), BandTicket)


def test_the_tenant_bound_applies_inside_each_band() -> None:
    q: BandedQueue[str] = BandedQueue(BANDS, FairQueueConfig(max_queue_length=1))
    assert isinstance(q.push(2, "a", "1", 10, 0.0, FAR), BandTicket)
    assert q.push(2, "a", "2", 10, 0.0, FAR) == Rejected(RejectReason.QUEUE_FULL, 1.0)
    assert isinstance(q.push(0, "a", "3", 10, 0.0, FAR), BandTicket)


def test_expiry_in_any_band_and_the_next_deadline() -> None:
    q: BandedQueue[str] = BandedQueue(BANDS)
    q.push(0, "a", "i-late", 10, 0.0, 9.0)
    q.push(2, "b", "b-soon", 10, 0.0, 2.0)
    q.push(1, "c", "s-mid", 10, 0.0, 5.0)
    assert q.next_deadline() == 2.0
    assert q.expire(1.0) == []
    assert q.expire(5.0) == [(1, "s-mid"), (2, "b-soon")]
    assert len(q) == 1 and q.queued(1) == 0 and q.queued(2) == 0
    assert q.next_deadline() == 9.0


def test_a_band_whose_items_all_expired_hands_the_turn_down() -> None:
    q: BandedQueue[str] = BandedQueue(BANDS)
    q.push(0, "a", "i", 10, 0.0, 1.0)
    q.push(2, "b", "b", 10, 0.0, FAR)
    # pop finds the interactive head past its deadline: it is set aside, the batch one served.
    assert q.pop(2.0) == (2, "b")
    assert q.expire(2.0) == [(0, "i")]
    assert len(q) == 0


def test_held_tenants_of_the_top_band_keep_lower_bands_waiting() -> None:
    q: BandedQueue[str] = BandedQueue(BANDS)
    q.push(0, "a", "i", 10, 0.0, FAR)
    q.push(2, "b", "b", 10, 0.0, FAR)
    # The interactive tenant is held back (its prefill share): its slot stays free for its
    # band, the batch band does not take it.
    assert q.pop(0.0, held=lambda t: t == "a") is None
    assert q.pop(0.0) == (0, "i")
    assert q.pop(0.0, held=lambda t: t == "a") == (2, "b")


def test_cancel_and_depths() -> None:
    q: BandedQueue[str] = BandedQueue(BANDS)
    t1 = q.push(2, "a", "1", 10, 0.0, FAR)
    q.push(0, "a", "2", 10, 0.0, FAR)
    q.push(0, "b", "3", 10, 0.0, FAR)
    assert isinstance(t1, BandTicket)
    assert q.depths() == {"a": 2, "b": 1}
    assert q.band_depths() == {"interactive": {"a": 1, "b": 1}, "standard": {}, "batch": {"a": 1}}
    assert q.cancel(t1) and not q.cancel(t1)
    assert q.queued(2) == 0 and q.top() == 0
    assert q.tenants_in(0) == {"a", "b"}
    assert drain(q) == ["2", "3"]


def test_weights_apply_in_every_band() -> None:
    q: BandedQueue[str] = BandedQueue(BANDS, FairQueueConfig(quantum_tokens=100))
    q.set_weight("a", 3.0)
    assert q.weight("a") == 3.0
    for i in range(3):
        q.push(1, "a", f"a{i}", 100, 0.0, FAR)
    q.push(1, "b", "b0", 100, 0.0, FAR)
    assert drain(q) == ["a0", "a1", "a2", "b0"]
