"""Coalescing: one leader per key, followers share its answer, hand over, or go alone."""

from __future__ import annotations

import asyncio

from cache.coalesce import Coalescer, Follower, Leader, Wake
from cache.config import CacheServiceSettings
from cache.memory_store import MemoryStore
from cache.service import ResponseCache
from dialects.answer import CachedCompletion

ANSWER = CachedCompletion("chat", "m", "shared", "stop", 3, 2)
KEY = "t1:" + "ab" * 32


def leader_of(ticket: Leader | Follower) -> Leader:
    assert isinstance(ticket, Leader)
    return ticket


def follower_of(ticket: Leader | Follower) -> Follower:
    assert isinstance(ticket, Follower)
    return ticket


async def test_first_leads_others_follow_and_share_the_answer() -> None:
    coalescer = Coalescer(linger_s=0)
    leader = leader_of(coalescer.join(KEY))
    followers = [follower_of(coalescer.join(KEY)) for _ in range(3)]
    assert leader.followers == coalescer.waiting(KEY) == 3
    waits = [asyncio.create_task(f.wait(5)) for f in followers]
    await asyncio.sleep(0)
    leader.publish(ANSWER)
    assert await asyncio.gather(*waits) == [ANSWER] * 3
    assert len(coalescer) == 0  # no linger: the next request leads a new flight
    assert isinstance(coalescer.join(KEY), Leader)


async def test_other_keys_are_other_flights() -> None:
    coalescer = Coalescer()
    assert isinstance(coalescer.join("t1:" + "0" * 64), Leader)
    assert isinstance(coalescer.join("t2:" + "0" * 64), Leader)  # same digest, other tenant


async def test_a_published_answer_lingers_for_late_joiners() -> None:
    coalescer = Coalescer(linger_s=0.05)
    leader_of(coalescer.join(KEY)).publish(ANSWER)
    assert await follower_of(coalescer.join(KEY)).wait(0) == ANSWER
    await asyncio.sleep(0.08)
    assert isinstance(coalescer.join(KEY), Leader)


async def test_follower_timeout_and_cancellation_leave_the_flight_alone() -> None:
    coalescer = Coalescer(linger_s=0)
    leader = leader_of(coalescer.join(KEY))
    impatient = follower_of(coalescer.join(KEY))
    assert await impatient.wait(0.01) is Wake.TIMEOUT
    leaving = asyncio.create_task(follower_of(coalescer.join(KEY)).wait(5))
    patient = asyncio.create_task(follower_of(coalescer.join(KEY)).wait(5))
    await asyncio.sleep(0)
    leaving.cancel()
    await asyncio.sleep(0)
    assert leaving.cancelled()
    leader.publish(ANSWER)
    assert await patient == ANSWER


async def test_leader_failure_sends_followers_upstream_alone() -> None:
    coalescer = Coalescer(linger_s=0)
    leader = leader_of(coalescer.join(KEY))
    follower = follower_of(coalescer.join(KEY))
    try:
        with leader:
            raise RuntimeError("upstream 502")
    except RuntimeError:
        pass
    assert await follower.wait(1) is Wake.SOLO
    assert len(coalescer) == 0


async def test_leaving_without_publishing_is_solo() -> None:
    coalescer = Coalescer()
    with leader_of(coalescer.join(KEY)):
        follower_task = asyncio.create_task(follower_of(coalescer.join(KEY)).wait(1))
        # e.g. the answer was a 4xx, or too large to share
    assert await follower_task is Wake.SOLO


async def test_cancelled_leader_hands_over_to_one_follower() -> None:
    cache = ResponseCache(MemoryStore())
    upstream_calls = 0
    started = asyncio.Event()

    async def request(hold: float) -> CachedCompletion:
        nonlocal upstream_calls
        got = await cache.coalesce(KEY, wait_s=5)
        if isinstance(got, CachedCompletion):
            return got
        with got:
            upstream_calls += 1
            started.set()
            await asyncio.sleep(hold)
            got.publish(ANSWER)
        return ANSWER

    first = asyncio.create_task(request(hold=10))  # its client will leave
    await started.wait()
    others = [asyncio.create_task(request(hold=0.01)) for _ in range(4)]
    await asyncio.sleep(0.01)
    first.cancel()
    assert await asyncio.gather(*others) == [ANSWER] * 4
    assert (await asyncio.gather(first, return_exceptions=True))[0].__class__ is asyncio.CancelledError
    assert upstream_calls == 2  # the cancelled leader, then exactly one successor
    assert cache.metrics.sample("fleetgate_cache_coalesced_total", result="handoff") == 4
    assert cache.metrics.sample("fleetgate_cache_coalesced_total", result="hit") == 3


async def test_n_identical_requests_go_upstream_once() -> None:
    cache = ResponseCache(MemoryStore())
    upstream_calls = 0

    async def request() -> CachedCompletion:
        nonlocal upstream_calls
        got = await cache.coalesce(KEY, wait_s=5)
        if isinstance(got, CachedCompletion):
            return got
        with got:
            upstream_calls += 1
            await asyncio.sleep(0.02)
            got.publish(ANSWER)
        return ANSWER

    assert await asyncio.gather(*(request() for _ in range(10))) == [ANSWER] * 10
    assert upstream_calls == 1
    assert cache.metrics.sample("fleetgate_cache_coalesced_total", result="hit") == 9


async def test_solo_leaders_when_coalescing_is_off_or_the_wait_runs_out() -> None:
    off = ResponseCache(MemoryStore(), CacheServiceSettings(coalesce=False))
    first, second = await off.coalesce(KEY, 1), await off.coalesce(KEY, 1)
    assert isinstance(first, Leader) and first.solo and isinstance(second, Leader) and second.solo
    first.publish(ANSWER)  # a no-op, not an error

    cache = ResponseCache(MemoryStore())
    leader = await cache.coalesce(KEY, 1)
    assert isinstance(leader, Leader) and not leader.solo
    waited = await cache.coalesce(KEY, wait_s=0.01)
    assert isinstance(waited, Leader) and waited.solo
    assert cache.metrics.sample("fleetgate_cache_coalesced_total", result="timeout") == 1
