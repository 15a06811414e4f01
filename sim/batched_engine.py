"""The faithful ``SimEngine``: the continuous-batching model of ``sim.model`` in real time.

One background task runs engine steps back to back while there is work: it asks the pure
model for the next step, sleeps that step's duration (divided by ``time_scale``), then hands
each produced token to its request's stream. It sleeps on an event when idle, so an idle
engine costs nothing. Deadlines are absolute, so the Python cost of a step does not add up
as drift; if the loop falls behind it starts the next step at once rather than bursting.

The running and waiting gauges are vLLM's: the scheduler's queues as each step left them,
published when the step ends (vLLM's engine core records them with every step's output, and
a request that arrives during a step joins the scheduler only after it). A request that
arrives mid-step is therefore not reported waiting: waiting means passed over by the last
scheduling decision, for want of KV blocks, token budget or ``max_num_seqs``.

    engine = BatchedSimEngine.from_profile("h100-llama-3.1-8b", seed=0, time_scale=1.0)
    stream = engine.submit(SimRequest("r1", prompt, max_tokens=200))
    async for piece in stream: ...
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from replicas.replica import GAUGE_RUNNING, GAUGE_WAITING
from sim.engine import SimRequest, SimStream, natural_end
from sim.model import EngineModel, TokenEvent, prompt_token_ids
from sim.profiles import SimProfile, get_profile

if TYPE_CHECKING:
    from sim.freeze import Freeze
    from sim.kv_publisher import KvEventPublisher

logger = logging.getLogger(__name__)

FINISH_ABORT = "abort"  # vLLM's finish reason for a request dropped before it ended
_WORDS = (
    "the fleet serves tokens quickly while the gateway routes each request to a warm "
    "replica and the cache answers repeated questions without a GPU"
).split()


class _BatchedStream:
    """A request's tokens as the engine delivers them; iteration ends with the request."""

    def __init__(self, engine: BatchedSimEngine, request_id: str, prompt_tokens: int, rng: random.Random) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.request_id = request_id
        self._engine = engine
        self._rng = rng
        self._pieces: deque[str] = deque()
        self._done = False
        self._cancelled = False
        self._waiter: asyncio.Future[None] | None = None

    @property
    def done(self) -> bool:
        return self._done

    def push(self, event: TokenEvent) -> None:
        word = self._rng.choice(_WORDS)
        self._pieces.append(f" {word}" if event.position else word)
        self.completion_tokens += 1
        if event.finish_reason is not None:
            self.finish(event.finish_reason)
        else:
            self._wake()

    def finish(self, reason: str) -> None:
        if not self._done:
            self._done = True
            self.finish_reason = reason
            self._wake()

    def cancel(self) -> None:
        """The client left: free the request's slot and KV blocks. A no-op once it has ended."""
        if self._done:
            return
        self._cancelled = True
        self._engine._abort(self.request_id)
        self.finish(FINISH_ABORT)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            while not self._cancelled:
                if self._pieces:
                    yield self._pieces.popleft()
                elif self._done:
                    return
                else:
                    self._waiter = asyncio.get_running_loop().create_future()
                    await self._waiter
                    self._waiter = None
        finally:
            self.cancel()


class BatchedSimEngine:
    """A simulated vLLM replica on the profiled GPU, running the pure model in scaled real time.

    ``time_scale`` > 1 runs faster than real time (tests use 100-1000); ``seed`` fixes the step
    jitter and the generated text, so a replay of the same submissions gives the same streams.
    An answer ends on its own after a length drawn from the profile's ``answer_lengths``, unless
    ``ignore_eos`` (every request) or the request's own makes it run to ``max_tokens``.
    """

    def __init__(
        self, profile: SimProfile, *, seed: int = 0, time_scale: float = 1.0, ignore_eos: bool = False
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.profile = profile
        self.time_scale = time_scale
        self.ignore_eos = ignore_eos
        self.model = EngineModel(profile, random.Random(seed))
        self._text_rng = random.Random(seed ^ 0x5EED)
        self._streams: dict[str, _BatchedStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        # (running, waiting) as the last finished step left them: what the gauges report.
        self._reported = (0, 0)
        # Self-measurement: steps run, Python seconds spent per step, worst lateness.
        self.steps_run = 0
        self.step_cpu_s = 0.0
        self.max_lag_s = 0.0
        # While frozen (``sim.freeze``: a stalled engine on cue) no step runs.
        self.freeze: Freeze | None = None
        # KV-cache events, when published (``publish_events``).
        self.publisher: KvEventPublisher | None = None

    @classmethod
    def from_profile(
        cls,
        name: str,
        *,
        seed: int = 0,
        time_scale: float = 1.0,
        num_blocks: int | None = None,
        block_size: int | None = None,
        ignore_eos: bool = False,
    ) -> BatchedSimEngine:
        """Build an engine from a registered profile name (``sim.profiles.PROFILES``).

        ``num_blocks`` and ``block_size`` override the profile's KV cache as vLLM's
        ``--num-gpu-blocks-override`` and ``--block-size`` do.
        """
        profile = get_profile(name)
        if block_size is not None:
            profile = dataclasses.replace(profile, block_size=block_size)
        if num_blocks is not None:
            profile = dataclasses.replace(profile, num_blocks_override=num_blocks)
        return cls(profile, seed=seed, time_scale=time_scale, ignore_eos=ignore_eos)

    def submit(self, request: SimRequest) -> SimStream:
        """Queue a request; it reaches the scheduler after the profile's API-server latency.

        Raises ValueError when the prompt does not fit the context window (vLLM answers 400).
        """
        if self._closed:
            raise RuntimeError("engine is closed")
        if request.request_id in self._streams:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        token_ids = request.token_ids or prompt_token_ids(request.prompt)
        max_len = self.profile.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"This model's maximum context length is {max_len} tokens. "
                f"However, your request has {len(token_ids)} input tokens."
            )
        seed = request.seed if request.seed is not None else self._text_rng.getrandbits(64)
        stream = _BatchedStream(self, request.request_id, len(token_ids), random.Random(f"{seed}|{request.prompt}"))
        self._streams[request.request_id] = stream
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._task = loop.create_task(self._run(), name=f"sim-engine-{self.profile.name}")
        delay = self.profile.efficiency.frontend_latency_s / self.time_scale
        eos_after = natural_end(request, self.profile.answer_lengths, self.ignore_eos)
        loop.call_later(delay, self._admit, stream, token_ids, request.max_tokens, eos_after)
        return stream

    def gauges(self) -> dict[str, float]:
        gauges = self.model.metrics()
        gauges[GAUGE_RUNNING], gauges[GAUGE_WAITING] = float(self._reported[0]), float(self._reported[1])
        return gauges

    def cache_config(self) -> dict[str, int] | None:
        return {"num_gpu_blocks": self.profile.num_blocks, "block_size": self.profile.block_size}

    def reset_prefix_cache(self) -> bool:
        done = self.model.pool.reset()
        self._publish()
        return done

    def publish_events(self, publisher: KvEventPublisher) -> None:
        """Publish the block pool's changes through ``publisher`` after every step, as vLLM's
        scheduler does with ``--kv-events-config``."""
        self.publisher = publisher
        self.model.pool.events = []

    def _publish(self) -> None:
        events = self.model.pool.events
        if self.publisher is None or not events:
            return
        self.model.pool.events = []
        from sim.kv_publisher import to_kv_events

        self.publisher.publish(to_kv_events(events, self.profile.block_size))

    async def close(self) -> None:
        """Stop the step loop and end every open stream with ``abort``. Idempotent."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._end_all()

    def _admit(self, stream: _BatchedStream, token_ids: list[int], max_tokens: int, eos_after: int | None) -> None:
        if stream.done or self._closed:
            return
        self.model.add_request(stream.request_id, token_ids, max(1, max_tokens), eos_after)
        self._wake.set()

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.model.abort(request_id)
        if not self.model.has_work:  # no next step will publish it
            self._reported = (0, 0)

    def _end_all(self) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            self.model.abort(stream.request_id)
            stream.finish(FINISH_ABORT)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        try:
            while True:
                if self.freeze is not None and self.freeze.frozen:
                    await self.freeze.wait()
                    deadline = loop.time()
                    continue
                if not self.model.has_work:
                    self._reported = (0, 0)  # an abort during the last step left it stale
                    self._wake.clear()
                    await self._wake.wait()
                    deadline = loop.time()
                    continue
                started = time.perf_counter()
                result = self.model.step()
                self._publish()
                after_step = (self.model.num_running, self.model.num_waiting)
                now = loop.time()
                self.max_lag_s = max(self.max_lag_s, now - deadline)
                deadline = max(deadline, now) + result.duration_s / self.time_scale
                self.step_cpu_s += time.perf_counter() - started
                await asyncio.sleep(max(0.0, deadline - loop.time()))
                started = time.perf_counter()
                self._reported = after_step
                self._deliver(result.events)
                self.steps_run += 1
                self.step_cpu_s += time.perf_counter() - started
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug in the model must not leave clients waiting forever.
            logger.exception("simulated engine %s failed; aborting open requests", self.profile.name)
            self._closed = True
            self._end_all()

    def _deliver(self, events: list[TokenEvent]) -> None:
        streams = self._streams
        for event in events:
            stream = streams.get(event.request_id)
            if stream is None:
                continue  # cancelled while the step ran
            stream.push(event)
            if event.finish_reason is not None:
                del streams[event.request_id]
