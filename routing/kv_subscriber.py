"""One replica's KV-cache event stream, read into the gateway's exact index (the async edge).

A ZMQ SUB socket on the replica's publisher (``--kv-events-config``'s ``endpoint``) feeds
each batch to the replica's ``routing.kv_index.ReplicaBlocks``, which decides: the next
batch is applied; a gap or a restarted engine clears the set. Then, when the replica has
a replay endpoint (vLLM's ROUTER socket, which keeps its last ``buffer_steps`` batches),
the subscriber asks it for everything from sequence 0 and rebuilds the set from that:
exact again when the engine's buffer still starts at 0 (a young engine, or a gap soon
after start) or holds a clear of the whole cache; otherwise the set holds what the replay
had and the replica stays *not exact*, so routing reads the estimate for it
(``KvIndex.cached_tokens`` returns None), until the engine restarts or its cache is reset.
A gap whose batch itself clears the cache needs no replay. Batches that arrive on the SUB
socket during a replay wait in it and are then applied or skipped as already replayed
(``Sync.STALE``).

Decoding and the set are pure (``replicas.kv_events``, ``routing.kv_index``); this module
only moves frames. A frame that does not decode is counted and dropped; the next batch's
sequence number then shows the gap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from replicas.config import EventsEndpoint
from replicas.kv_events import END_OF_REPLAY, EventBatch, KvEventDecodeError, decode_batch, decode_seq
from routing.kv_index import KvIndex, ReplicaBlocks, Sync

if TYPE_CHECKING:
    import zmq.asyncio

log = logging.getLogger("fleetgate.kv_events")

# A replay's frames come back within this, or the replay is given up (the set stays not exact).
REPLAY_TIMEOUT_S = 5.0
# Resyncs of one replica at most this often: a stream that keeps gapping (a publisher past
# its high-water mark) must not turn into a replay loop.
MIN_RESYNC_INTERVAL_S = 2.0


@dataclass(slots=True)
class SubscriberCounts:
    """What the stream did, for the metrics collector and ``/admin/fleet``."""

    received: int = 0
    decode_errors: int = 0
    replays: int = 0
    replay_failures: int = 0
    connected: bool = False
    last_error: str | None = None
    by_sync: dict[str, int] = field(default_factory=dict)


class KvSubscriber:
    """Reads one replica's events into its ``ReplicaBlocks`` until closed."""

    def __init__(
        self,
        replica_id: str,
        where: EventsEndpoint,
        blocks: ReplicaBlocks,
        *,
        clock: Callable[[], float] = time.monotonic,
        context: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        min_resync_interval_s: float = MIN_RESYNC_INTERVAL_S,
    ) -> None:
        self.replica_id = replica_id
        self.where = where
        self.blocks = blocks
        self.counts = SubscriberCounts()
        self._clock = clock
        # pyzmq is imported where a replica publishes: a fleet without events never loads it.
        import zmq
        import zmq.asyncio

        self._zmq = zmq
        self._ctx = context or zmq.asyncio.Context.instance()
        self._replay_timeout_s = replay_timeout_s
        self._min_resync_interval_s = min_resync_interval_s
        self._last_resync: float | None = None
        # A gap or a restart seen and not yet followed by a replay.
        self._resync_wanted = False
        self._task: asyncio.Task[None] | None = None
        self._sub: zmq.asyncio.Socket | None = None

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("already started")
        zmq = self._zmq
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.IPV6, 1)  # a pod's address may be IPv6 (``KubernetesSource.events_at``)
        sub.setsockopt(zmq.SUBSCRIBE, self.where.topic.encode())
        sub.connect(self.where.endpoint)
        self._sub = sub
        self._task = asyncio.create_task(self._run(sub), name=f"kv-events:{self.replica_id}")

    async def close(self) -> None:
        from common.tasks import stop

        await stop(self._task)
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    async def _run(self, sub: zmq.asyncio.Socket) -> None:
        self.counts.connected = True
        # A gateway starting beside a running engine has missed its first batches.
        await self._resync()
        while True:
            if self._resync_wanted:
                wait_s = self._resync_wait_s()
                if wait_s <= 0:
                    self._resync_wanted = False
                    await self._resync()
                    continue
                if not await sub.poll(wait_s * 1000):
                    continue  # nothing came meanwhile: the resync is due now
            frames = await sub.recv_multipart()
            sync = self._on_frames(frames)
            if sync is Sync.NEXT and self.blocks.exact:
                self._resync_wanted = False  # the stream began at 0 while a replay was pending
            if self.where.replay is not None and sync in (Sync.GAP, Sync.RESTART) and not self.blocks.exact:
                self._resync_wanted = True

    def _on_frames(self, frames: list[bytes]) -> Sync | None:
        self.counts.received += 1
        try:
            if len(frames) != 3:
                raise KvEventDecodeError(f"{len(frames)} frames, expected topic, seq, payload")
            batch = decode_batch(decode_seq(frames[1]), frames[2])
        except KvEventDecodeError as exc:
            self.counts.decode_errors += 1
            self.counts.last_error = str(exc)[:200]
            log.warning("KV event batch dropped", extra={"replica": self.replica_id, "reason": str(exc)[:200]})
            return None
        sync = self.blocks.apply(batch, self._clock())
        self.counts.by_sync[sync.value] = self.counts.by_sync.get(sync.value, 0) + 1
        if sync in (Sync.GAP, Sync.RESTART):
            log.info(
                "KV events: replica cleared",
                extra={"replica": self.replica_id, "why": sync.value, "seq": batch.seq},
            )
        return sync

    def _resync_wait_s(self) -> float:
        """How long until the next resync may run (0 or less: now)."""
        last = self._last_resync
        return 0.0 if last is None else last + self._min_resync_interval_s - self._clock()

    async def _resync(self) -> None:
        """Rebuild the set from the engine's replay buffer, from sequence 0."""
        if self.where.replay is None:
            return
        self._last_resync = self._clock()
        self.counts.replays += 1
        try:
            batches = await self._replay(self.where.replay)
        except (self._zmq.ZMQError, KvEventDecodeError, TimeoutError) as exc:
            self.counts.replay_failures += 1
            self.counts.last_error = f"replay: {type(exc).__name__} {exc}"[:200]
            # Tried again (every ``min_resync_interval_s``) unless a batch 0 makes it needless:
            # a replica still starting has not bound its replay socket yet.
            self._resync_wanted = self.blocks.last_seq is None or not self.blocks.exact
            log.warning("KV events: replay failed", extra={"replica": self.replica_id, "reason": str(exc)[:200]})
            return
        if not batches:
            self.blocks.start_empty(self._clock())  # an engine that has published nothing yet
            return
        exact = self.blocks.rebuild(batches, self._clock())
        log.info(
            "KV events: resynchronised from the replay buffer",
            extra={"replica": self.replica_id, "from_seq": batches[0].seq, "to_seq": batches[-1].seq, "exact": exact},
        )

    async def _replay(self, endpoint: str) -> list[EventBatch]:
        # A DEALER speaks to vLLM's ROUTER as a REQ would (the empty delimiter frame), but
        # takes its many replies.
        sock = self._ctx.socket(self._zmq.DEALER)
        sock.setsockopt(self._zmq.LINGER, 0)
        sock.setsockopt(self._zmq.IPV6, 1)
        try:
            sock.connect(endpoint)
            await sock.send_multipart([b"", (0).to_bytes(8, "big")])
            batches: list[EventBatch] = []
            async with asyncio.timeout(self._replay_timeout_s):
                while True:
                    frames = await sock.recv_multipart()
                    # [b"", topic, seq, payload]
                    if len(frames) != 4:
                        raise KvEventDecodeError(f"replay reply of {len(frames)} frames")
                    seq = decode_seq(frames[2])
                    if seq == END_OF_REPLAY:
                        return batches
                    with contextlib.suppress(KvEventDecodeError):
                        batches.append(decode_batch(seq, frames[3]))
        finally:
            sock.close(linger=0)

    def describe(self) -> dict[str, object]:
        c = self.counts
        return {
            "endpoint": self.where.endpoint,
            "replay": self.where.replay,
            "received": c.received,
            "decode_errors": c.decode_errors,
            "replays": c.replays,
            "replay_failures": c.replay_failures,
            **({"last_error": c.last_error} if c.last_error else {}),
        }


class KvEventStreams:
    """Every publishing replica's subscriber, reading into one ``KvIndex``: an async context
    manager (entered after the fleet, so a managed replica's ports are chosen; its sockets
    connect before the engine binds and ZMQ reconnects until it does)."""

    def __init__(
        self, endpoints: Mapping[str, EventsEndpoint], index: KvIndex, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.index = index
        self._clock = clock
        self.subscribers = {
            rid: KvSubscriber(rid, where, index.replica(rid), clock=clock) for rid, where in endpoints.items()
        }
        self._started = False
        # Subscribers of replicas that went, closing.
        self._closing: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> KvEventStreams:
        self._started = True
        for subscriber in self.subscribers.values():
            subscriber.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._started = False
        for subscriber in reversed(list(self.subscribers.values())):
            await subscriber.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def update(self, replica_id: str, where: EventsEndpoint | None) -> None:
        """A replica discovery found publishing at ``where``, or that went (None): its
        subscriber is replaced or closed, and what the index held of it forgotten."""
        old = self.subscribers.pop(replica_id, None)
        if old is not None:
            task = asyncio.get_running_loop().create_task(old.close(), name=f"kv-events-close:{replica_id}")
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        self.index.forget(replica_id)
        if where is None:
            return
        subscriber = KvSubscriber(replica_id, where, self.index.replica(replica_id), clock=self._clock)
        self.subscribers[replica_id] = subscriber
        if self._started:
            subscriber.start()

    def describe(self) -> dict[str, dict[str, object]]:
        """Per replica: whether its events are in use (``exact``), blocks held, last sequence,
        gaps and resyncs, the stream's counts (``/admin/fleet``)."""
        blocks = self.index.describe()
        return {rid: {**blocks.get(rid, {}), **s.describe()} for rid, s in self.subscribers.items()}
