"""Homes for the prompt prefixes in use: each replica's cache gets an even share, and every pod agrees.

A plain hash of a prompt prefix to a replica (rendezvous or modulo) splits a few dozen
shared system prompts unevenly: with 32 prompts over 2 replicas, one replica gets 19 or
more about one time in three. When each replica's KV cache holds little more than its half
of the prompts, the replica with the larger share thrashes while the other has room.

``AnchorPlacement`` balances the split and keeps it a function of what every gateway pod
can see alike. The prefixes *in use* are those (their anchor keys) placed at least
``active_after`` times, the last time within ``window_s``. A placement pass homes each on
the first replica of its rendezvous order (``rendezvous_weight``), at most
``ceil(factor * mean + slack * sqrt(mean))`` per replica (``mean``: prefixes in use per
replica; ``sqrt(mean)`` is about the spread a hash leaves; the default slack, 0, splits
them evenly, since a replica whose cache holds little more than its even share thrashes
with a couple of prefixes more): a replica with more keeps
those that weigh most for it, and the rest take the next replica of their order with
room. This is consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam,
2018) over the working set, every prefix counted once, arranged so that only a full
replica's excess moves. The result depends only on the set of prefixes in use and the set
of replicas, not on the order requests arrived in, so two pods that see the same prefixes
compute the same homes; each pod sees requests for all the prefixes in use over time, so
their sets converge. Counting prefixes rather than their tokens keeps that so when two
pods saw different prompts with one prefix.

A pass runs when the replicas change, at most every ``refresh_s`` while the set of
prefixes in use changes, and at least every ``window_s`` (to forget prefixes out of use).
In between, a prefix the last pass did not home goes to its first choice and, once in use,
stays there until the next pass: where that pass most likely puts it (a full replica sheds
its least attached prefixes, not necessarily the newest), and the same on every pod
whatever order its requests came in (the next replica with room would depend on what each
pod has seen so far, and pods would disagree until their sets converge). In a steady
working set nothing moves; a prefix entering or leaving the set moves about one other at
most. A pass costs O(prefixes in use x replicas) on the request that triggers it.

A hot prefix gets more than one home. Homes balance how many prefixes each replica caches,
not their traffic: with 16 prompts of Zipf popularity over two replicas, one replica took
74% of the requests, and at a dozen concurrent conversations the load bound never spilled.
So each prefix in use carries a decayed count of the conversations it opened (time
constant ``rate_window_s``): first turns only, since a conversation's later turns come as
fast as its replica answers them, and counting those made a slow, crowded home's prefixes
look rare and drew more of a hot prefix onto it. Its share of the pool's count says how
many replicas it needs: one while it carries at most ``hot_share`` of a replica's fair
share (``1 / n`` of the traffic), then ``ceil(share * n / hot_share)``, up to every
replica (``spread``). Its
extra homes are the next replicas of its rendezvous order, so they too are the same on
every pod; a pod's shares are its own, but pods behind one Service see the same mix of
prompts, and the count is a function of the share alone (no memory of how it got there:
hysteresis made two pods that saw the same traffic in another order disagree), so pods
disagree only while a share sits at a step, and then only on whether the last extra home
takes a part. Which of a prefix's homes serves a request is
the policy's choice (``routing.policies.PrefixAffinity``).

Homes pay only for prefixes that come back. The placement follows how many of the pool's
new prefixes do (``reuse``): where fewer than half do (retrieval over unique documents,
one-off prompts), a prefix seen once has no home, and the policy places it by load.

Pure and synchronous: time is passed in; one per pool.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

_MASK64 = (1 << 64) - 1
# Reuse of new prefixes: a new prefix counts as reused when it is placed a second time, and
# as a one-off when REUSE_HORIZON newer prefixes came before it did; moving counts over
# about the last 256 of them, starting from 4 reused; below half reused, a prefix seen once
# is placed by load, not homed.
_REUSE_HORIZON = 64
_REUSE_DECAY = 1.0 - 1.0 / 256
_REUSE_PRIOR = 4.0
_REUSE_THRESHOLD = 0.5


def mix64(x: int) -> int:
    """SplitMix64's finaliser: a fast, well-mixed 64-bit hash of ``x``."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def hash64(text: str) -> int:
    """A 64-bit hash of ``text`` (BLAKE2b): stable across processes and pods."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def address_seed(address: str) -> int:
    """A replica's 64-bit identity for rendezvous hashing: a hash of its address."""
    return hash64(address)


def rendezvous_weight(anchor: int, seed: int) -> int:
    """Highest random weight (Thaler and Ravishankar, 1998): the replica with the largest weight is first."""
    return mix64(anchor ^ seed)


# The least part of its fair share a hot prefix's home takes, however loaded (``_split``).
_MIN_PART = 0.05
# A hot prefix is spread only once the pool's decayed count of opened conversations
# reaches this: the shares of the first few say little yet.
_MIN_EVIDENCE = 32.0


@dataclass(slots=True)
class _Anchor:
    seen: int
    last_seen: float
    # The replicas in the anchor's rendezvous order (for the members it was computed with).
    order: tuple[str, ...] = field(default=())
    # The conversations it opened, decayed with time constant ``rate_window_s`` as of ``counted_at``.
    weight: float = 0.0
    counted_at: float = 0.0


class AnchorPlacement:
    """Balanced homes for the prompt prefixes in use, computed alike by every gateway pod."""

    __slots__ = (
        "_anchors",
        "_dirty",
        "_homes",
        "_members",
        "_one_off",
        "_parts",
        "_parts_at",
        "_passed_at",
        "_pending",
        "_reused",
        "_seeds",
        "_total",
        "_total_at",
        "active_after",
        "factor",
        "hot_share",
        "max_anchors",
        "rate_window_s",
        "refresh_s",
        "slack",
        "window_s",
    )

    def __init__(
        self,
        *,
        factor: float = 1.0,
        slack: float = 0.0,
        active_after: int = 2,
        window_s: float = 600.0,
        refresh_s: float = 2.0,
        max_anchors: int = 16384,
        hot_share: float = 0.5,
        rate_window_s: float = 60.0,
    ) -> None:
        if factor < 1.0 or slack < 0 or active_after < 1 or max_anchors < 1:
            raise ValueError("factor >= 1, slack >= 0, active_after >= 1 and max_anchors >= 1 are required")
        if hot_share <= 0 or rate_window_s <= 0:
            raise ValueError("hot_share and rate_window_s must be positive")
        self.factor = factor
        self.slack = slack
        self.active_after = active_after
        self.window_s = window_s
        self.refresh_s = refresh_s
        self.max_anchors = max_anchors
        self.hot_share = hot_share
        self.rate_window_s = rate_window_s
        # Every placement, decayed like each anchor's weight (as of ``_total_at``).
        self._total, self._total_at = 0.0, -math.inf
        # The hot prefixes' parts per home (``_split``), and when they were worked out.
        self._parts: dict[int, dict[str, float]] = {}
        self._parts_at: float | None = None
        # Every remembered anchor, least recently placed first.
        self._anchors: OrderedDict[int, _Anchor] = OrderedDict()
        self._homes: dict[int, str] = {}
        self._members: tuple[str, ...] = ()
        self._seeds: dict[str, int] = {}
        self._dirty = False
        self._passed_at = -math.inf
        # The newest prefixes seen once, and decayed counts of new prefixes that came back
        # and of those that did not (with a prior of reuse, so a pool starts by homing).
        self._pending: deque[int] = deque()
        self._reused, self._one_off = _REUSE_PRIOR, 0.0

    def __len__(self) -> int:
        return len(self._anchors)

    def homes(self) -> dict[int, str]:
        """The homes of the last pass: anchor -> replica address."""
        return dict(self._homes)

    def reuse(self) -> float:
        """The share of recent new prefixes that came back (were placed again): 1 for chat, 0 for one-offs."""
        return self._reused / (self._reused + self._one_off)

    def _resolved(self, reused: bool) -> None:
        self._reused *= _REUSE_DECAY
        self._one_off *= _REUSE_DECAY
        if reused:
            self._reused += 1.0
        else:
            self._one_off += 1.0

    def share(self, anchor: int, now: float) -> float:
        """``anchor``'s share of the pool's recently opened conversations (0 for one not remembered)."""
        entry = self._anchors.get(anchor)
        if entry is None or self._total <= 0:
            return 0.0
        return self._decayed(entry.weight, entry.counted_at, now) / self._decayed(self._total, self._total_at, now)

    def _decayed(self, weight: float, since: float, now: float) -> float:
        return weight * math.exp(-max(0.0, now - since) / self.rate_window_s)

    def homes_of(
        self, anchor: int, members: Sequence[str], now: float, *, seen: bool = True, opens: bool = True
    ) -> dict[str, float]:
        """Every home of ``anchor`` among ``members`` with the part of its traffic each should
        take, its first home (``home``) first; empty where ``home`` is None. More than one
        for a hot prefix: the next replicas of its order, each taking what the traffic of
        the prefixes homed on it leaves of its fair share (``_parts``)."""
        home = self.home(anchor, members, now, seen=seen, opens=opens)
        if home is None:
            return {}
        if self.spread(anchor, now) <= 1:
            return {home: 1.0}
        if self._parts_at is None or now - self._parts_at >= self.refresh_s or anchor not in self._parts:
            self._split(now)
        return self._parts.get(anchor) or {home: 1.0}

    def _hot_homes(self, anchor: int, home: str, now: float) -> tuple[str, ...]:
        entry = self._anchors[anchor]
        if not entry.order:
            entry.order = self.order(anchor, self._members)
        return (home, *[m for m in entry.order if m != home][: self.spread(anchor, now) - 1])

    def _split(self, now: float) -> None:
        """Each hot prefix's parts: its homes fill what the others leave of their fair share.

        The traffic of the prefixes with one home is summed per replica; then each hot
        prefix, in key order, gives each of its homes a part in proportion to the room left
        there (a fair share, ``1 / n`` of the traffic, less what is on it already; at least
        ``_MIN_PART`` of a fair share, so no home is left out), and that part counts on the
        home for the next hot prefix. Counting prefixes balances the caches; this balances
        the load, where one hot prompt beside several warm ones on one replica made it take
        two thirds of the requests. Shares come from this pod's traffic, so two pods' parts
        differ by their sampling noise, and a session moves only where its part moved
        (weighted rendezvous, ``routing.policies.PrefixAffinity``).
        """
        fair = 1.0 / max(1, len(self._members))
        load = dict.fromkeys(self._members, 0.0)
        hot: list[tuple[int, str]] = []
        for anchor, home in self._homes.items():
            if anchor not in self._anchors or home not in load:
                continue
            if self.spread(anchor, now) > 1:
                hot.append((anchor, home))
            else:
                load[home] += self.share(anchor, now)
        parts: dict[int, dict[str, float]] = {}
        for anchor, home in sorted(hot):
            homes = self._hot_homes(anchor, home, now)
            room = [max(fair - load[h], _MIN_PART * fair) for h in homes]
            share, total = self.share(anchor, now), sum(room)
            parts[anchor] = {h: r / total for h, r in zip(homes, room, strict=True)}
            for h, part in parts[anchor].items():
                load[h] += share * part
        self._parts, self._parts_at = parts, now

    def spread(self, anchor: int, now: float) -> int:
        """How many replicas ``anchor``'s traffic calls for: ``ceil(share * n / hot_share)``, 1 to n."""
        replicas = len(self._members)
        if replicas <= 1 or self._decayed(self._total, self._total_at, now) < _MIN_EVIDENCE:
            return 1
        return max(1, min(replicas, math.ceil(self.share(anchor, now) * replicas / self.hot_share)))

    def _count(self, entry: _Anchor, now: float) -> None:
        """One more placement of ``entry``: its weight and the pool's."""
        entry.weight = self._decayed(entry.weight, entry.counted_at, now) + 1.0
        entry.counted_at = now
        self._total = self._decayed(self._total, self._total_at, now) + 1.0
        self._total_at = now

    def home(
        self, anchor: int, members: Sequence[str], now: float, *, seen: bool = True, opens: bool = True
    ) -> str | None:
        """Where ``anchor`` lives among ``members`` (never empty); ``seen``: this is one more use
        of it, and ``opens``: one that begins a conversation (only those count towards its share).

        A prefix the last pass did not home goes to its first choice, where the next pass
        most likely puts it; once it is in use, that home is kept until the pass.
        None for a prefix seen once in a pool where fewer than half the new prefixes come
        back (``reuse``): a home only pays for a prefix that is used again, and one-offs are
        better spread by load.
        """
        anchors = self._anchors
        entry = anchors.get(anchor)
        if entry is None:
            entry = anchors[anchor] = _Anchor(0, now)
            while len(anchors) > self.max_anchors:
                self._dirty |= self._in_use(anchors.popitem(last=False)[1])
        else:
            anchors.move_to_end(anchor)
        entry.last_seen = now
        if seen:
            if opens:
                self._count(entry, now)
            entry.seen += 1
            if entry.seen == 1:
                pending = self._pending
                pending.append(anchor)
                if len(pending) > _REUSE_HORIZON:
                    old = anchors.get(pending.popleft())
                    if old is None or old.seen == 1:
                        self._resolved(reused=False)
            elif entry.seen == 2:
                self._resolved(reused=True)
            self._dirty |= entry.seen == self.active_after
        ordered = tuple(sorted(members))
        since = now - self._passed_at
        if ordered != self._members or (self._dirty and since >= self.refresh_s) or since >= self.window_s:
            self._place(ordered, now)
        home = self._homes.get(anchor)
        if home is None:
            if entry.seen <= 1 and self.reuse() < _REUSE_THRESHOLD:
                return None
            if not entry.order:
                entry.order = self.order(anchor, ordered)
            home = entry.order[0]
            if self._in_use(entry):  # keep it until the next pass
                self._homes[anchor] = home
        return home

    def _bound(self, in_use: int) -> int:
        """Homes per replica: the mean, plus ``slack`` of the spread a hash would leave (~sqrt(mean))."""
        mean = in_use / len(self._members)
        return max(1, math.ceil(self.factor * mean + self.slack * math.sqrt(mean)))

    def _in_use(self, entry: _Anchor) -> bool:
        return entry.seen >= self.active_after

    def _place(self, members: tuple[str, ...], now: float) -> None:
        """The pass: each prefix in use on its first choice, but the least attached of a full replica's.

        Every prefix in use is homed on the first replica of its rendezvous order, at most
        ``bound`` of them per replica; past that, a replica keeps the ones with the highest
        rendezvous weight for it, and the others go, in key order, to the next replica of
        their order with room. Only a full replica's excess moves, so a prefix joining or
        leaving the set moves at most about one other.
        """
        anchors = self._anchors
        horizon = now - self.window_s
        while anchors and next(iter(anchors.values())).last_seen < horizon:
            anchors.popitem(last=False)
        if members != self._members:
            for entry in anchors.values():
                entry.order = ()
        self._members, self._dirty, self._passed_at = members, False, now
        self._parts_at = None
        homes: dict[int, str] = {}
        in_use = [a for a, e in anchors.items() if self._in_use(e)]
        count = dict.fromkeys(members, 0)
        if members and in_use:
            bound = self._bound(len(in_use))
            by_first: dict[str, list[tuple[int, int]]] = {m: [] for m in members}
            for anchor in in_use:
                entry = anchors[anchor]
                if not entry.order:
                    entry.order = self.order(anchor, members)
                first = entry.order[0]
                by_first[first].append((self.weight(anchor, first), anchor))
            overflow: list[int] = []
            for member, group in by_first.items():
                group.sort(reverse=True)
                for _weight, anchor in group[:bound]:
                    homes[anchor] = member
                count[member] = min(len(group), bound)
                overflow.extend(anchor for _weight, anchor in group[bound:])
            for anchor in sorted(overflow):
                order = anchors[anchor].order
                home = next((m for m in order if count[m] < bound), order[0])
                count[home] += 1
                homes[anchor] = home
        self._homes = homes

    def order(self, anchor: int, members: Sequence[str]) -> tuple[str, ...]:
        """``members`` in ``anchor``'s rendezvous order."""
        return tuple(sorted(members, key=lambda m: self.weight(anchor, m), reverse=True))

    def weight(self, anchor: int, address: str) -> int:
        """``rendezvous_weight`` of ``anchor`` on the replica at ``address`` (its seed cached)."""
        seed = self._seeds.get(address)
        if seed is None:
            seed = self._seeds[address] = address_seed(address)
        return rendezvous_weight(anchor, seed)
