"""The simulator's KV-cache events, published as vLLM publishes them.

vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``): a PUB socket sends each
engine step's events as ``(topic, seq, payload)`` (seq 8 bytes big-endian, from 0; the
payload a msgpack ``[ts, events, data_parallel_rank]``), the last ``buffer_steps`` batches
are kept, and a ROUTER socket answers a replay request (an 8-byte start sequence) with each
kept batch from it as ``(identity, "", topic, seq, payload)``, then an end marker with seq
-1. The events come from the simulated block pool (``sim.model.CacheEvent``): a block
cached, evicted, or the whole cache reset. Each stored block is its own ``BlockStored``
with its parent's hash (vLLM groups a request's new blocks of a step into one; either
reads the same).

``drop(n)``: the next ``n`` batches are kept for replay but not sent, as a publisher past its
high-water mark loses them: what a gap looks like to a subscriber (tests, benchmarks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from replicas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, encode_batch, encode_seq
from sim.model import CacheEvent

log = logging.getLogger(__name__)

# vLLM's defaults (KVEventsConfig).
BUFFER_STEPS = 10_000
HWM = 100_000
# vLLM's main KV cache reports this medium on every backend.
MEDIUM = "GPU"


def to_kv_events(events: Sequence[CacheEvent], block_size: int) -> list[KvEvent]:
    out: list[KvEvent] = []
    for e in events:
        if e.kind == "stored":
            out.append(BlockStored((e.block_hash,), e.parent_hash, e.token_ids, block_size, medium=MEDIUM))
        elif e.kind == "removed":
            out.append(BlockRemoved((e.block_hash,), MEDIUM))
        else:
            out.append(AllBlocksCleared())
    return out


class KvEventPublisher:
    """A PUB socket and a replay ROUTER socket, bound at once; ``start`` serves replays."""

    def __init__(
        self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "", buffer_steps: int = BUFFER_STEPS
    ) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self._drop = 0
        self.published = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._replay is not None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replays(), name="kv-events-replay")

    def publish(self, events: Sequence[KvEvent], ts: float | None = None) -> None:
        """One batch: sent now (never waits: a PUB socket drops past its high-water mark)."""
        payload = encode_batch(time.time() if ts is None else ts, events)
        seq = self.seq
        self.seq += 1
        self._buffer.append((seq, payload))
        if self._drop > 0:
            self._drop -= 1
            return
        self._pub.send_multipart((self._topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)
        self.published += 1

    def drop(self, n: int) -> None:
        self._drop += n

    async def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            identity, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart((identity, b"", self._topic, encode_seq(seq), payload))
            await self._replay.send_multipart((identity, b"", b"", encode_seq(-1), b""))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
