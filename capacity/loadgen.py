"""The load generator: users streaming chat completions from an OpenAI-compatible endpoint.

One load point at a time, in one of two shapes:

* **closed loop**: ``level`` users, each sending its next request when the previous one has
  finished and the user has thought (the way a fixed team of people works);
* **open loop**: sessions arrive as a Poisson process at ``level`` per second, each runs its
  turns and leaves (the way a public service is hit: arrivals do not wait for the server).

Users start spread over the warm-up (unless ``ramp`` is off), so they are out of step by
the time the measurement window opens. Requests *sent* inside the window are the point's
samples; the load stays on until each of them has finished, so every sample saw the full
load, then the rest are cancelled. Every request streams (``stream_options.include_usage``
for the real token counts) and each text event is timestamped on arrival.

``time_scale`` is for simulated replicas that run faster than real time (``python -m
sim.server --time-scale X``): think times and windows are divided by it when the
generator waits, and every measured duration is multiplied back, so all figures are in
real-time-equivalent units.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import aiohttp
import orjson

from capacity.stats import RequestSample, decode_rate, maybe_percentile, tokens_in_window
from capacity.workload import RequestSpec, Session, Workload

Mode = Literal["closed", "open"]
# After a failed request a closed-loop user pauses this long (wall time), so a dead server
# is not hammered in a hot loop while the errors are counted.
ERROR_BACKOFF_S = 0.05
ERROR_BODY_BYTES = 4096
CONNECT_TIMEOUT_S = 10.0
# vLLM's 400 for a prompt beyond the context window says "maximum context length".
_CONTEXT_MARKERS = (b"context length", b"maximum context", b"too long")


@dataclass(frozen=True)
class Target:
    """An OpenAI-compatible endpoint: fleetgate, or a vLLM server directly."""

    name: str
    base_url: str
    model: str
    api_key: str | None = None


@dataclass(frozen=True)
class PointPlan:
    """One load point. Durations in real-time-equivalent seconds."""

    mode: Mode
    level: float  # users (closed) or session arrivals per second (open)
    warmup_s: float
    duration_s: float
    time_scale: float = 1.0
    request_timeout_s: float = 600.0
    seed: int = 0
    max_sessions: int = 10_000  # open loop: arrivals beyond this many live sessions are refused
    # Closed loop: spread the users' first requests over the warm-up (a steady state), or send
    # them all at once, as most benchmark scripts do (equal-length requests then stay in step).
    ramp: bool = True


@dataclass
class Progress:
    """Live counters of the running point, for the progress display."""

    phase: str = "idle"
    window_start: float = 0.0  # clock times of the measurement window
    window_end: float = 0.0
    started: int = 0
    finished: int = 0
    errors: int = 0
    in_flight: int = 0
    sampled: int = 0
    tokens: int = 0
    recent_ttft: deque[float] = field(default_factory=lambda: deque(maxlen=500))


@dataclass
class PointResult:
    """The samples of one point and its window (clock times, for the fleet probe)."""

    target: str
    plan: PointPlan
    samples: list[RequestSample]
    window_tokens: float  # tokens generated inside the window, by any request
    window_start: float
    window_end: float
    finished_at: float

    @property
    def window_s(self) -> float:
        return self.plan.duration_s


class _Run:
    """The state of one point while it runs."""

    def __init__(
        self, target: Target, plan: PointPlan, clock: Callable[[], float], progress: Progress, warm_keys: set[str]
    ) -> None:
        self.target, self.plan, self.clock, self.progress = target, plan, clock, progress
        self.scale = plan.time_scale
        self.t0 = clock()
        self.window_start = self.t0 + plan.warmup_s / self.scale
        self.window_end = self.window_start + plan.duration_s / self.scale
        self.samples: list[RequestSample] = []
        self.window_tokens = 0.0
        self.pending = 0  # sampled requests not finished yet
        self.window_over = False
        self.drained = asyncio.Event()
        self.warm_keys = warm_keys  # shared copies this target has prefilled, in this point or earlier
        self.tasks: set[asyncio.Task[None]] = set()

    async def sleep(self, real_s: float) -> None:
        if real_s > 0:
            await asyncio.sleep(real_s / self.scale)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def settle(self, sample: RequestSample | None) -> None:
        """A sampled request ended (``None``: one outside the window)."""
        if sample is None:
            return
        self.samples.append(sample)
        self.pending -= 1
        if self.window_over and self.pending == 0:
            self.drained.set()


def request_body(target: Target, spec: RequestSpec, api: str) -> dict[str, Any]:
    """The JSON body for one request: streamed, with usage, and a fixed length when asked."""
    body: dict[str, Any] = {
        "model": target.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": spec.max_tokens,
    }
    if spec.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension: generate max_tokens whatever the model says
    if api == "chat":
        body["messages"] = spec.messages
    else:
        body["prompt"] = "\n".join(f"{m['role']}: {m['content']}" for m in spec.messages)
    return body


class StreamError(Exception):
    """A stream that sent an error event (``stream_error``) or ended without ``[DONE]`` (``truncated``)."""

    def __init__(self, kind: str, detail: object = None) -> None:
        super().__init__(kind if detail is None else f"{kind}: {detail}")
        self.kind = kind


async def stream_chunks(content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI-style SSE stream, up to ``[DONE]``; comments (keep-alives) skipped."""
    async for line in content:  # one SSE line at a time
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        chunk = orjson.loads(data)
        if "error" in chunk:
            raise StreamError("stream_error", chunk["error"])
        yield chunk
    raise StreamError("truncated")


def http_error_kind(status: int, body: bytes) -> str:
    lowered = body.lower()
    if status == 400 and any(marker in lowered for marker in _CONTEXT_MARKERS):
        return "context_length"
    return f"http_{status}"


class LoadGenerator:
    """Runs load points against targets; owns the HTTP client session (an async context manager)."""

    def __init__(self, workload: Workload, *, clock: Callable[[], float] = time.perf_counter, run_id: str = "") -> None:
        self.workload = workload
        self.clock = clock
        # Every text a run builds opens with its id, so a second run cannot hit the first's cache.
        self.run_id = run_id or secrets.token_hex(4)
        self._session: aiohttp.ClientSession | None = None
        self._points = 0
        self._warm: dict[str, set[str]] = {}  # per target: its shared copies stay cached across points

    async def __aenter__(self) -> LoadGenerator:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("LoadGenerator used outside 'async with'")
        return self._session

    async def run_point(self, target: Target, plan: PointPlan, progress: Progress | None = None) -> PointResult:
        """Run one load point to the end of its window and until its samples have finished."""
        progress = progress or Progress()
        run = _Run(target, plan, self.clock, progress, self._warm.setdefault(target.name, set()))
        progress.window_start, progress.window_end = run.window_start, run.window_end
        self._points += 1
        point_tag = f"{self.run_id}.{self._points}"
        progress.phase = "warm-up"
        if plan.mode == "closed":
            for user in range(int(plan.level)):
                run.spawn(self._closed_user(run, user, point_tag))
        else:
            run.spawn(self._arrivals(run, point_tag))
        try:
            await asyncio.sleep(max(0.0, run.window_start - self.clock()))
            progress.phase = "measuring"
            await asyncio.sleep(max(0.0, run.window_end - self.clock()))
            progress.phase = "draining"
            run.window_over = True
            if run.pending:
                await run.drained.wait()
            finished_at = self.clock()
        finally:
            for task in list(run.tasks):
                task.cancel()
            await asyncio.gather(*run.tasks, return_exceptions=True)
        progress.phase = "done"
        samples = sorted(run.samples, key=lambda s: s.start_s)
        return PointResult(target.name, plan, samples, run.window_tokens, run.window_start, run.window_end, finished_at)

    def _session_for(self, run: _Run, rng: random.Random, tag: str) -> Session:
        user_class = self.workload.pick_class(rng)
        namespace = f"{self.run_id}/{run.target.name}"
        return Session(self.workload, user_class, rng, tag=tag, namespace=namespace)

    async def _closed_user(self, run: _Run, user: int, point_tag: str) -> None:
        rng = random.Random(f"{run.plan.seed}:{run.plan.level}:{user}")
        if run.plan.ramp:
            await run.sleep(rng.uniform(0.0, run.plan.warmup_s))
        number = 0
        while True:
            session = self._session_for(run, rng, f"{point_tag}.u{user}s{number}")
            await self._converse(run, session, user, number)
            number += 1
            await run.sleep(session.think_time_s())

    async def _arrivals(self, run: _Run, point_tag: str) -> None:
        rng = random.Random(f"{run.plan.seed}:arrivals:{run.plan.level}")
        user = 0
        while True:
            await run.sleep(rng.expovariate(run.plan.level))
            if len(run.tasks) > run.plan.max_sessions:
                self._refused(run, user)
            else:
                run.spawn(self._open_user(run, user, point_tag))
            user += 1

    async def _open_user(self, run: _Run, user: int, point_tag: str) -> None:
        rng = random.Random(f"{run.plan.seed}:{run.plan.level}:{user}")
        await self._converse(run, self._session_for(run, rng, f"{point_tag}.u{user}"), user, 0)

    def _refused(self, run: _Run, user: int) -> None:
        now = self.clock()
        if run.window_start <= now < run.window_end:
            run.pending += 1
            start = (now - run.window_start) * run.scale
            run.settle(RequestSample(user, "-", 0, 0, start, error="client_overflow"))

    async def _converse(self, run: _Run, session: Session, user: int, number: int) -> None:
        while (spec := session.next_request()) is not None:
            sample, answer = await self._send(run, spec, session, user, number)
            if sample.error is not None:
                session.abandon()
                await asyncio.sleep(ERROR_BACKOFF_S)
            else:
                session.record_answer(answer)
            if session.turn < session.turns:
                await run.sleep(session.think_time_s())

    async def _send(
        self, run: _Run, spec: RequestSpec, session: Session, user: int, number: int
    ) -> tuple[RequestSample, str]:
        sent = self.clock()
        in_window = run.window_start <= sent < run.window_end and not run.window_over
        sample = RequestSample(user, session.user_class.name, number, spec.turn, (sent - run.window_start) * run.scale)
        if spec.opens_with_prefix:
            sample.prefix = "warm" if spec.prefix_key in run.warm_keys else "cold"
        progress = run.progress
        progress.started += 1
        progress.in_flight += 1
        run.pending += in_window
        times: list[float] = []
        parts: list[str] = []
        try:
            async with asyncio.timeout(run.plan.request_timeout_s / run.scale):
                await self._stream(run, spec, sample, times, parts)
        except TimeoutError:
            sample.error = "timeout"
        except aiohttp.ClientConnectorError:
            sample.error = "connect"
        except (aiohttp.ClientError, orjson.JSONDecodeError, ValueError):
            sample.error = "disconnected"
        finally:
            progress.in_flight -= 1
            tokens = sample.completion_tokens or len(times)
            run.window_tokens += tokens_in_window(times, tokens, run.window_start, run.window_end)
        self._measure(run, sample, sent, times)
        progress.finished += 1
        progress.errors += sample.error is not None
        progress.tokens += sample.completion_tokens
        if sample.ttft_s is not None:
            progress.recent_ttft.append(sample.ttft_s)
        if in_window:
            progress.sampled += 1
        run.settle(sample if in_window else None)
        return sample, "".join(parts)

    async def _stream(
        self, run: _Run, spec: RequestSpec, sample: RequestSample, times: list[float], parts: list[str]
    ) -> None:
        target, api = run.target, self.workload.api
        path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
        headers = {"Content-Type": "application/json"}
        if target.api_key:
            headers["Authorization"] = f"Bearer {target.api_key}"
        payload = orjson.dumps(request_body(target, spec, api))
        async with self.session.post(target.base_url.rstrip("/") + path, data=payload, headers=headers) as resp:
            if resp.status != 200:
                sample.error = http_error_kind(resp.status, await resp.content.read(ERROR_BODY_BYTES))
                return
            try:
                async for chunk in stream_chunks(resp.content):
                    self._chunk(run, spec, sample, chunk, times, parts)
            except StreamError as exc:
                sample.error = exc.kind

    def _chunk(
        self,
        run: _Run,
        spec: RequestSpec,
        sample: RequestSample,
        chunk: dict[str, Any],
        times: list[float],
        parts: list[str],
    ) -> None:
        """One chunk of a stream: when its first token came, its text, its usage."""
        api = self.workload.api
        for choice in chunk.get("choices") or ():
            text = choice.get("text") if api != "chat" else (choice.get("delta") or {}).get("content")
            # The first chunk with a choice marks the first token even when it carries only
            # the role (vLLM sends it as soon as the first token is out): the convention of
            # vLLM's own benchmark client. Later chunks count when they carry text.
            if text or not times:
                if not times and spec.prefix_key is not None:
                    run.warm_keys.add(spec.prefix_key)  # prefilled: later openers find it cached
                times.append(self.clock())
            if text:
                parts.append(text)
        usage = chunk.get("usage")
        if usage:
            sample.prompt_tokens = usage.get("prompt_tokens")
            sample.completion_tokens = int(usage.get("completion_tokens") or 0)

    @staticmethod
    def _measure(run: _Run, sample: RequestSample, sent: float, times: list[float]) -> None:
        scale = run.scale
        sample.e2e_s = (run.clock() - sent) * scale
        sample.events = len(times)
        sample.completion_tokens = sample.completion_tokens or len(times)
        if not times:
            return
        sample.ttft_s = (times[0] - sent) * scale
        sample.gaps = [(b - a) * scale for a, b in itertools.pairwise(times)]
        sample.decode_tps = decode_rate(sample.completion_tokens, 0.0, (times[-1] - times[0]) * scale)
        sample.itl_p50_s = maybe_percentile(sample.gaps, 50)
        sample.max_gap_s = max(sample.gaps) if sample.gaps else None
