"""Soak: thousands of concurrent streams through one gateway process, in bursts with idle between.

The bar (issue 34): no growth from burst to burst, 0 errors, descriptors back. Five bursts of
5,000 concurrent streams, each followed by idle; RSS after burst 5 (after its idle) within
``GROWTH_BAR`` (3%) of RSS after burst 2; no client error and no error line in the gateway's
log; open descriptors exactly at baseline after every idle. Burst 1 is not compared: it sets
the allocators' high-water mark, which CPython's arenas keep (bench/results/soak.md), so
"back to baseline" cannot hold and is not what an operator sizes a pod by; growth after it
would be a leak. One command (about 25 minutes; exit status 0 when the bar is met)::

    .venv/bin/python -m bench.soak --bursts 5 --duration 180 --idle 60 --tokens-per-s 0.5 --health-timeout 10

and one long burst, as the earlier runs (``--bursts 1``, the default)::

    .venv/bin/python -m bench.soak [--streams 5000] [--duration 600] [--idle 90]

Method, all real processes on this machine:
- two ``fleetgate sim`` replicas (``--replicas``; ``--tokens-per-s``, ``--ttft-ms 50``,
  ``--ignore-eos``; idle keep-alive connections closed after 5 s, so the gateway's pool of
  idle replica connections drains within the idle phase) and one ``fleetgate serve`` process
  in front of them (one tenant, limits on the memory store, access log on, log level info,
  capacity bounds lifted so every stream is admitted at once), on CPython's default
  allocator (``--python-malloc malloc`` sets another; ``--gateway-env`` adds to the gateway's
  environment only);
- this process (uvloop) holds ``--streams`` streams open at once: each worker opens a chat
  completion stream of ``--max-tokens`` tokens, reads it to ``[DONE]``, and opens the next
  one, until ``--duration`` has passed; workers start spread over ``--ramp`` seconds; a
  worker whose stream failed pauses 1 s before its next one, as a client's retry would. It
  counts events in the bytes as they arrive, not line by line (it shares the cores). That is
  one burst; ``--bursts`` of them run, each followed by ``--idle`` seconds without traffic;
- the gateway's resident set and open descriptors (``/proc``) are sampled every 5 s, through
  the load and the idle phases. The *baseline* is the gateway idle after start-up and a
  warm-up of 50 streams (every code path of a stream has run once: lazy imports, the
  replica connection pools, the metrics' label sets), taken once the warm-up's connections
  have closed and the gateway has been idle longer than its ``server.memory_trim_idle_s``
  (``--trim-idle``, the default 30 s): the same state as the measure *after* each burst's
  ``--idle`` seconds, so neither is taken before the idle release and the other after it.
  Both wait, if need be (at most ``RELEASE_WAIT_S`` more), until the gateway has logged its
  idle release (``idle: memory released``). RSS right after start-up (before the warm-up) is
  reported too. Memory per open stream: (median RSS while all streams are open - baseline)
  / streams, and at peak: (highest RSS sampled - baseline) / streams;
- the health probes' "replica down" lines and the machine's load average are reported: on
  a shared machine a starved replica can miss its probes; and, from the gateway's
  ``/metrics`` at the end, its failed upstream attempts by kind (connect, connect_timeout, timeout, status,
  stream) and failed health probes: what a client's error came from;
- event-loop lag: the gateway's own ``fleetgate_event_loop_lag_seconds`` histogram (a 0.1 s
  timer, how late it ran), its p99 over the load phases (bucket upper bound);
- errors: any stream that did not answer 200 (counted with the error body's code), ended
  with an error event, or stopped before ``[DONE]``; plus error lines or tracebacks in the
  gateway's log.

Writes bench/results/soak.md (``--out``). ``run_soak`` is also what the test suite runs, in
a shortened form (tests/integration/test_soak.py: two bursts of 500 streams).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import orjson
import yaml

from gateway.settings import hash_key
from replicas.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
MODEL = "soak"
API_KEY = "sk-soak"
SAMPLE_EVERY_S = 5.0
# A worker's pause after a failed stream before its next one.
RETRY_PAUSE_S = 1.0
# The bar (issue 34): RSS after the last burst against after this one, at most GROWTH_BAR
# more. Burst 1 sets the allocators' high-water mark (CPython keeps every arena it took);
# burst 2 is the first that should find everything it needs already there.
COMPARED_BURST = 2
GROWTH_BAR = 0.03
# The gateway logs each idle release; a measure waits for it at most this long past its idle
# phase (it comes memory_trim_idle_s + up to 2 s after the last request: common/idle_trim.py).
RELEASE_WAIT_S = 30.0
RELEASED_LINE = "idle: memory released"


@dataclass(frozen=True)
class SoakConfig:
    streams: int = 5000
    duration_s: float = 600.0
    idle_s: float = 90.0
    ramp_s: float = 30.0
    tokens_per_s: float = 1.0
    max_tokens: int = 30
    replicas: int = 2
    replica_keepalive_s: float = 5.0
    sample_every_s: float = SAMPLE_EVERY_S
    # Load phases, each followed by the idle phase: RSS after the later ones against after
    # the second tells growth (a leak) from the allocator keeping its high-water mark.
    bursts: int = 1
    # The gateway's health.timeout_s (its default here): a replica starved of CPU on a shared
    # machine can miss three probes in a row and be marked down.
    health_timeout_s: float = 1.0
    # The gateway's server.memory_trim_idle_s (its default); None: no idle release.
    memory_trim_idle_s: float | None = 30.0
    # PYTHONMALLOC for the gateway process only ("malloc": glibc's malloc for every object);
    # None: CPython's default (pymalloc, its arenas).
    python_malloc: str | None = None
    # More environment for the gateway process only (e.g. an allocator to preload).
    gateway_env: tuple[tuple[str, str], ...] = ()

    @property
    def settle_s(self) -> float:
        """Idle time before the baseline: the warm-up's replica connections have closed and the
        idle release (if any) has had its chance, as it has by the end of an idle phase."""
        trim = 0.0 if self.memory_trim_idle_s is None else self.memory_trim_idle_s + 3.0
        return max(2.0, self.replica_keepalive_s + 2.0, trim)


@dataclass
class Sample:
    at_s: float
    rss_mb: float
    fds: int
    open_streams: int


@dataclass
class Burst:
    """One load phase and the idle phase after it, as the client and ``/proc`` saw them."""

    done: int
    events: int
    errors: Counter[str]
    peak_open: int
    peak_rss_mb: float
    # Sampled at the end of the idle phase; ``released``: after the gateway's idle release.
    after: Sample
    released: bool
    cpu_s: float
    load_average: float
    # The gateway's event-loop lag histogram over the load phase: samples per bucket bound.
    loop_lag: dict[float, float]


@dataclass
class SoakResult:
    config: SoakConfig
    started: Sample
    baseline: Sample
    bursts: list[Burst]
    samples: list[Sample] = field(default_factory=list)
    log_errors: list[str] = field(default_factory=list)
    loop_lag_p99_s: float | None = None
    loop_lag_max_bucket_s: float | None = None
    replicas_marked_down: int = 0
    # The gateway's own count of failed upstream attempts by kind, and failed health probes.
    upstream_failures: Counter[str] = field(default_factory=Counter)
    # PYTHONMALLOC as the gateway process was started with.
    allocator: str = "pymalloc"

    @property
    def afters(self) -> list[Sample]:
        return [burst.after for burst in self.bursts]

    @property
    def after(self) -> Sample:
        return self.afters[-1]

    @property
    def streams_done(self) -> int:
        return sum(burst.done for burst in self.bursts)

    @property
    def events(self) -> int:
        return sum(burst.events for burst in self.bursts)

    @property
    def errors(self) -> Counter[str]:
        return sum((burst.errors for burst in self.bursts), Counter())

    @property
    def peak_open(self) -> int:
        return max((burst.peak_open for burst in self.bursts), default=0)

    @property
    def cpu_s(self) -> float:
        return sum(burst.cpu_s for burst in self.bursts)

    @property
    def full(self) -> list[Sample]:
        """Samples taken while (nearly) every stream was open."""
        return [s for s in self.samples if s.open_streams >= 0.98 * self.config.streams]

    @property
    def rss_full_mb(self) -> float | None:
        full = self.full
        return statistics.median(s.rss_mb for s in full) if full else None

    @property
    def kb_per_stream(self) -> float | None:
        rss = self.rss_full_mb
        return None if rss is None else (rss - self.baseline.rss_mb) * 1024 / self.config.streams

    @property
    def peak_rss_mb(self) -> float:
        return max((burst.peak_rss_mb for burst in self.bursts), default=self.baseline.rss_mb)

    @property
    def kb_per_stream_at_peak(self) -> float:
        """(Highest RSS sampled - baseline) / streams."""
        return (self.peak_rss_mb - self.baseline.rss_mb) * 1024 / self.config.streams

    @property
    def growth(self) -> float | None:
        """RSS after the last burst against after burst ``COMPARED_BURST``; None with fewer
        bursts than one past it."""
        if len(self.bursts) <= COMPARED_BURST:
            return None
        return self.after.rss_mb / self.afters[COMPARED_BURST - 1].rss_mb - 1


def bar_failures(result: SoakResult) -> list[str]:
    """Where a run misses the bar (docstring of this module); empty: met. A run of fewer than
    three bursts is judged on errors and descriptors only."""
    failures = []
    errors = sum(result.errors.values())
    if errors:
        failures.append(f"{errors} client errors {dict(result.errors)}")
    if result.log_errors:
        failures.append(f"{len(result.log_errors)} error lines in the gateway's log")
    for i, burst in enumerate(result.bursts, 1):
        if burst.after.fds != result.baseline.fds:
            failures.append(f"{burst.after.fds} descriptors after burst {i}'s idle, {result.baseline.fds} at baseline")
        if result.config.memory_trim_idle_s is not None and not burst.released:
            failures.append(f"no idle release logged after burst {i}: its RSS is not comparable")
    if result.growth is not None and result.growth > GROWTH_BAR:
        failures.append(
            f"RSS after burst {len(result.bursts)} {result.growth:+.1%} of after burst {COMPARED_BURST}'s "
            f"(bar: {GROWTH_BAR:+.0%})"
        )
    return failures


def process_sample(pid: int, started: float, open_streams: int) -> Sample:
    rss_kb = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kb = int(line.split()[1])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return Sample(round(time.monotonic() - started, 1), rss_kb / 1024, fds, open_streams)


def started_allocator(pid: int) -> str:
    """``PYTHONMALLOC`` in the environment the process was (last) executed with."""
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if entry.startswith(b"PYTHONMALLOC="):
            return entry.split(b"=", 1)[1].decode()
    return "pymalloc"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raise_fd_limit() -> None:
    """Each stream holds a client socket here and two in the gateway; children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def wait_healthy(url: str, path: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url}{path} never answered 200")


@contextlib.contextmanager
def fleet(cfg: SoakConfig, workdir: Path) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """The simulated replicas and the gateway; yields the gateway's URL, process and stderr file."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        urls = []
        for _ in range(cfg.replicas):
            port = free_port()
            args = ["--port", str(port), "--model", MODEL, "--ttft-ms", "50", "--tokens-per-s", str(cfg.tokens_per_s)]
            args += ["--keepalive-timeout-s", str(cfg.replica_keepalive_s)]
            # Every stream runs its max_tokens: a stream's length is the soak's to set, not a draw.
            args.append("--ignore-eos")
            sim = subprocess.Popen([sys.executable, "-m", "gateway.cli", "sim", *args], cwd=ROOT)
            procs.append(sim)
            urls.append(f"http://127.0.0.1:{port}")
        for url, sim in zip(urls, procs, strict=True):
            wait_healthy(url, "/health", sim)
        port = free_port()
        config = {
            "server": {
                "port": port,
                # Its default: the idle release's line tells when a measure may be taken.
                "log_level": "info",
                "shutdown_grace_s": 5,
                "memory_trim_idle_s": cfg.memory_trim_idle_s,
            },
            "models": [
                {
                    "name": MODEL,
                    "replicas": [{"url": url} for url in urls],
                    "capacity": {"max_requests": 1_000_000, "max_prefill_tokens": None},
                }
            ],
            "routing": {"queue": {"max_queue_length": 1_000_000}},
            "upstream": {"first_byte_timeout_s": 60, "chunk_gap_timeout_s": 60},
            "health": {"timeout_s": cfg.health_timeout_s},
            "tenants": [{"id": "soak", "api_keys": ["sha256:" + hash_key(API_KEY)]}],
        }
        path = workdir / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        stderr = workdir / "gateway.stderr"
        with open(stderr, "wb") as err:
            env = {**os.environ, **dict(cfg.gateway_env)}
            if cfg.python_malloc is not None:
                env["PYTHONMALLOC"] = cfg.python_malloc
            gateway = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--log-dir", str(workdir)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        procs.append(gateway)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, "/readyz", gateway)
        yield url, gateway, stderr
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def error_code(body: bytes) -> str:
    """The ``code`` of an OpenAI error body (why the gateway refused), or ``?``."""
    try:
        return str(orjson.loads(body)["error"]["code"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "?"


class EventCounter:
    """A stream's SSE events, counted from its bytes chunk by chunk as they arrive (a reader
    line by line costs the client a Python iteration per line, and at 5,000 streams the client
    shares the gateway's cores). An event starts a line after a blank one: the markers begin
    with the blank line (JSON content cannot hold a raw newline), and the stream is read as if
    one preceded it. A marker split between two chunks is found with the tail of the previous
    chunk, counted from one byte less than a marker's length so that no match counts twice."""

    EVENT = b"\n\ndata: "
    DONE = b"\n\ndata: [DONE]"
    ERROR = b'\n\ndata: {"error"'

    def __init__(self) -> None:
        self.data_lines = 0
        self.finished = False
        self.errored = False
        self._tail = b"\n\n"

    def feed(self, chunk: bytes) -> None:
        block = self._tail + chunk
        # A match starting before the tail's last len(EVENT) - 1 bytes ended in the previous chunk.
        self.data_lines += block[max(0, len(self._tail) - len(self.EVENT) + 1) :].count(self.EVENT)
        self.finished = self.finished or self.DONE in block
        self.errored = self.errored or self.ERROR in block
        self._tail = block[-(len(self.ERROR) - 1) :]

    @property
    def count(self) -> int:
        """Events, the closing ``[DONE]`` aside."""
        return self.data_lines - self.finished


class Load:
    """Workers that keep one stream each open until told to stop."""

    def __init__(self, url: str, cfg: SoakConfig, session: aiohttp.ClientSession) -> None:
        self.url, self.cfg, self.session = url, cfg, session
        self.open = 0
        self.peak = 0
        self.done = 0
        self.events = 0
        self.errors: Counter[str] = Counter()
        self.stop = asyncio.Event()
        self.body = orjson.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": cfg.max_tokens,
                "stream": True,
            }
        )

    async def stream_once(self) -> None:
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            async with self.session.post(
                self.url + "/v1/chat/completions", data=self.body, headers=headers, timeout=timeout
            ) as response:
                if response.status != 200:
                    self.errors[f"status {response.status} {error_code(await response.read())}"] += 1
                    return
                events = EventCounter()
                async for chunk in response.content.iter_any():
                    events.feed(chunk)
                self.events += events.count
                if events.errored:
                    self.errors["error event"] += 1
                elif not events.finished:
                    self.errors["ended before [DONE]"] += 1
                else:
                    self.done += 1
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.errors[type(exc).__name__] += 1
        finally:
            self.open -= 1

    async def worker(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        while not self.stop.is_set():
            failed = sum(self.errors.values())
            await self.stream_once()
            if sum(self.errors.values()) > failed:
                # A client retries after a pause, as the OpenAI SDKs do: without it, 5,000
                # workers answered 503 at once retry in a loop that starves the machine.
                await asyncio.sleep(RETRY_PAUSE_S)

    async def run(self, ramp_s: float) -> None:
        n = self.cfg.streams
        await asyncio.gather(*(self.worker(ramp_s * i / n) for i in range(n)))


def loop_lag_buckets(url: str) -> dict[float, float]:
    buckets: dict[float, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("fleetgate_event_loop_lag_seconds_bucket"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float("inf") if bound == "+Inf" else float(bound)] = float(line.rsplit(" ", 1)[1])
    return buckets


def upstream_failures(url: str) -> Counter[str]:
    """The gateway's failed upstream attempts so far by kind (``fleetgate_upstream_errors``,
    summed over replicas: connect, timeout, status, stream...), and its failed health probes."""
    failures: Counter[str] = Counter()
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("fleetgate_upstream_errors_total{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            failures[kind] += int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("fleetgate_replica_probe_failures_total{"):
            failures["health probe"] += int(float(line.rsplit(" ", 1)[1]))
    return +failures


def quantile_bound(before: dict[float, float], after: dict[float, float], q: float) -> tuple[float, float] | None:
    """The bucket bound holding quantile ``q`` of the samples between two scrapes, and the
    bound of the highest non-empty bucket."""
    counts = {b: after[b] - before.get(b, 0.0) for b in sorted(after)}
    total = counts[float("inf")]
    if total <= 0:
        return None
    bound = next(b for b, c in counts.items() if c >= q * total)
    highest = next(b for b, c in counts.items() if c >= total)
    return bound, highest


@contextlib.asynccontextmanager
async def client_session(streams: int) -> AsyncIterator[aiohttp.ClientSession]:
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        yield session


async def sample_while(load: Load, pid: int, started: float, every_s: float, out: list[Sample]) -> None:
    while True:
        await asyncio.sleep(every_s)
        out.append(process_sample(pid, started, load.open))


def releases(stderr: Path) -> int:
    """The idle releases the gateway has logged so far."""
    return stderr.read_text().count(RELEASED_LINE)


async def after_release(stderr: Path, before: int, trim: bool) -> bool:
    """Wait (at most ``RELEASE_WAIT_S``) until the gateway has logged a release past the
    ``before``-th; True once it has. Without an idle release (``trim`` off): True at once."""
    deadline = time.monotonic() + RELEASE_WAIT_S
    while trim and releases(stderr) <= before:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.2)
    return True


async def run_burst(url: str, cfg: SoakConfig, pid: int, started: float, stderr: Path, samples: list[Sample]) -> Burst:
    """One load phase and the idle after it; the samples of both go to ``samples``."""
    first = len(samples)
    lag_before = await asyncio.to_thread(loop_lag_buckets, url)
    cpu_before = cpu_seconds(pid)
    released_before = releases(stderr)
    async with client_session(cfg.streams) as session:
        load = Load(url, cfg, session)
        sampler = asyncio.create_task(sample_while(load, pid, started, cfg.sample_every_s, samples))
        running = asyncio.create_task(load.run(cfg.ramp_s))
        await asyncio.sleep(cfg.duration_s)
        load.stop.set()
        lag_after = await asyncio.to_thread(loop_lag_buckets, url)
        load_average = os.getloadavg()[0]
        await running
    cpu = cpu_seconds(pid) - cpu_before
    await asyncio.sleep(cfg.idle_s)  # still sampled: the idle release shows in the samples
    released = await after_release(stderr, released_before, cfg.memory_trim_idle_s is not None)
    sampler.cancel()
    after = process_sample(pid, started, 0)
    return Burst(
        done=load.done,
        events=load.events,
        errors=load.errors,
        peak_open=load.peak,
        peak_rss_mb=max(s.rss_mb for s in [*samples[first:], after]),
        after=after,
        released=released,
        cpu_s=cpu,
        load_average=load_average,
        loop_lag={bound: count - lag_before.get(bound, 0.0) for bound, count in lag_after.items()},
    )


async def run_soak(cfg: SoakConfig, workdir: Path | None = None) -> SoakResult:
    """Start the processes, warm up, then each burst and its idle; the figures."""
    raise_fd_limit()
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-")))
        url, gateway, stderr = stack.enter_context(fleet(cfg, workdir))
        started = time.monotonic()
        at_start = process_sample(gateway.pid, started, 0)
        allocator = started_allocator(gateway.pid)
        released_before = releases(stderr)
        async with client_session(50) as session:
            warm = Load(url, SoakConfig(streams=50, max_tokens=3, tokens_per_s=cfg.tokens_per_s), session)
            await asyncio.gather(*(warm.stream_once() for _ in range(50)))
        await asyncio.sleep(cfg.settle_s)
        await after_release(stderr, released_before, cfg.memory_trim_idle_s is not None)
        baseline = process_sample(gateway.pid, started, 0)
        samples: list[Sample] = []
        bursts = [await run_burst(url, cfg, gateway.pid, started, stderr, samples) for _ in range(cfg.bursts)]
        lag_counts: dict[float, float] = {}
        for burst in bursts:
            for bound, count in burst.loop_lag.items():
                lag_counts[bound] = lag_counts.get(bound, 0.0) + count
        failures = await asyncio.to_thread(upstream_failures, url)
        log = stderr.read_text()
        log_errors = [line for line in log.splitlines() if '"level":"error"' in line or "Traceback" in line]
        lag = quantile_bound({}, lag_counts, 0.99)
        return SoakResult(
            config=cfg,
            started=at_start,
            baseline=baseline,
            bursts=bursts,
            samples=samples,
            log_errors=log_errors,
            loop_lag_p99_s=lag[0] if lag else None,
            loop_lag_max_bucket_s=lag[1] if lag else None,
            replicas_marked_down=log.count("replica down"),
            upstream_failures=failures,
            allocator=allocator,
        )


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def bursts_table(result: SoakResult) -> list[str]:
    """Each burst: its streams and errors, its peak, and where its idle phase left the gateway."""
    base = result.baseline.rss_mb
    compared = result.afters[COMPARED_BURST - 1].rss_mb if len(result.bursts) >= COMPARED_BURST else None
    lines = [
        f"| burst | streams completed | errors | RSS peak | RSS after {result.config.idle_s:g} s idle "
        f"| against baseline | against burst {COMPARED_BURST} | descriptors after idle | idle release logged |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for i, burst in enumerate(result.bursts, 1):
        rss = burst.after.rss_mb
        lines.append(
            f"| {i} | {burst.done:,} | {sum(burst.errors.values())} | {burst.peak_rss_mb:.1f} MB | {rss:.1f} MB "
            f"| {rss / base - 1:+.1%} | "
            + (f"{rss / compared - 1:+.1%}" if compared is not None and i > COMPARED_BURST else "-")
            + f" | {burst.after.fds} | {'yes' if burst.released else 'no'} |"
        )
    return lines


def verdict(result: SoakResult) -> list[str]:
    """The bar's verdict in a line, and where the run misses it."""
    failures = bar_failures(result)
    if result.growth is None:
        scope = f"growth not judged: it needs more than {COMPARED_BURST} bursts"
    else:
        scope = f"RSS after burst {len(result.bursts)} {result.growth:+.1%} of after burst {COMPARED_BURST}'s"
    head = f"**Bar (RSS after the last burst within {GROWTH_BAR:.0%} of after burst {COMPARED_BURST}'s; 0 errors; "
    head += f"descriptors back after each idle): {'not met' if failures else 'met'}** ({scope})."
    return [head, *(f"- {failure}" for failure in failures)]


def report(result: SoakResult, command: str, note: str) -> str:
    cfg = result.config
    kb = result.kb_per_stream
    lag = result.loop_lag_p99_s
    lines = [
        "# Soak: concurrent streams through one gateway process",
        "",
        f"Command: `{command}`  ",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores (shared with other work while it ran).",
        "",
    ]
    if note:
        lines += [note, ""]
    lines += [
        "Method: see the docstring of bench/soak.py. "
        f"{cfg.bursts} burst(s): "
        f"{cfg.streams} streams held open at once for {cfg.duration_s:g} s (workers started over "
        f"{cfg.ramp_s:g} s), {cfg.max_tokens} tokens per stream at {cfg.tokens_per_s:g} tokens/s, "
        f"{cfg.replicas} simulated replicas, then {cfg.idle_s:g} s idle. Idle memory release "
        + (
            "off."
            if cfg.memory_trim_idle_s is None
            else f"after {cfg.memory_trim_idle_s:g} s without a request in flight (server.memory_trim_idle_s)."
        )
        + f" The gateway ran on PYTHONMALLOC={result.allocator}"
        + (" (CPython's default)." if cfg.python_malloc is None else " (set by --python-malloc).")
        + "".join(f" Gateway environment: {k}={v}." for k, v in cfg.gateway_env)
        + (f" Health probe timeout {cfg.health_timeout_s:g} s." if cfg.health_timeout_s != 1.0 else "")
        + f" Baseline: idle after start-up, a warm-up of 50 streams and {cfg.settle_s:g} s without traffic.",
        "",
        "| figure | value |",
        "| --- | ---: |",
        f"| streams completed | {result.streams_done:,} |",
        f"| token events relayed | {result.events:,} |",
        f"| most streams open at once | {result.peak_open:,} |",
        f"| errors (client side) | {sum(result.errors.values())} {dict(result.errors) or ''} |",
        f"| error lines / tracebacks in the gateway's log | {len(result.log_errors)} |",
        f"| gateway RSS right after start-up (before the warm-up) | {result.started.rss_mb:.1f} MB |",
        f"| gateway RSS, baseline | {result.baseline.rss_mb:.1f} MB |",
        "| gateway RSS, all streams open (median) | "
        + (f"{result.rss_full_mb:.1f} MB |" if result.rss_full_mb is not None else "never all open |"),
        "| memory per open stream (median RSS, all open) | " + (f"{kb:.1f} KB |" if kb is not None else "- |"),
        f"| gateway RSS at peak (highest sample) | {result.peak_rss_mb:.1f} MB |",
        f"| memory per open stream at peak ((peak - baseline) / streams) | {result.kb_per_stream_at_peak:.1f} KB |",
        "| gateway CPU time per 1,000 token events relayed (load phases) | "
        + (f"{result.cpu_s * 1000 / result.events * 1000:.0f} ms |" if result.events else "- |"),
        f"| replicas marked down by the health probes | {result.replicas_marked_down} |",
        "| failed upstream attempts by kind, failed health probes (the gateway's /metrics) | "
        + (
            f"{sum(result.upstream_failures.values())} {dict(result.upstream_failures)} |"
            if result.upstream_failures
            else "0 |"
        ),
        "| 1-minute load average at the end of each load phase | "
        + ", ".join(f"{burst.load_average:.1f}" for burst in result.bursts)
        + " |",
        f"| open descriptors: baseline / peak / after each idle | {result.baseline.fds} / "
        f"{max((s.fds for s in result.samples), default=0)} / {', '.join(str(a.fds) for a in result.afters)} |",
        "| event-loop lag p99 (load phase; bucket upper bound) | "
        + (
            "- |"
            if lag is None
            else "> 2.5 s (past the last bucket) |"
            if lag == float("inf")
            else f"<= {lag * 1000:g} ms |"
        ),
        "| event-loop lag, worst sample (bucket upper bound) | "
        + (
            f"<= {result.loop_lag_max_bucket_s * 1000:g} ms |"
            if result.loop_lag_max_bucket_s not in (None, float("inf"))
            else "> 2.5 s |"
        ),
        "",
        *bursts_table(result),
        "",
        *verdict(result),
        "",
        "Samples (every few seconds: time, gateway RSS, descriptors, streams open):",
        "",
        "| t (s) | RSS (MB) | fds | open streams |",
        "| ---: | ---: | ---: | ---: |",
    ]
    step = max(1, len(result.samples) // 30)
    lines += [f"| {s.at_s:g} | {s.rss_mb:.1f} | {s.fds} | {s.open_streams} |" for s in result.samples[::step]]
    if result.log_errors:
        lines += ["", "First error lines of the gateway's log:", "", "```", *result.log_errors[:5], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=5000)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--idle", type=float, default=90.0)
    parser.add_argument("--ramp", type=float, default=30.0)
    parser.add_argument("--tokens-per-s", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=30)
    parser.add_argument(
        "--bursts", "--rounds", type=int, default=1, help="load phases, each followed by the idle phase (the bar: 5)"
    )
    parser.add_argument(
        "--trim-idle", type=float, default=30.0, help="the gateway's server.memory_trim_idle_s; 0: no idle release"
    )
    parser.add_argument(
        "--python-malloc", default=None, help="PYTHONMALLOC for the gateway (pymalloc: CPython's default allocator)"
    )
    parser.add_argument(
        "--gateway-env", action="append", default=[], metavar="KEY=VALUE", help="environment for the gateway only"
    )
    parser.add_argument("--replicas", type=int, default=2, help="simulated replicas (one process each)")
    parser.add_argument(
        "--health-timeout", type=float, default=1.0, help="the gateway's health.timeout_s (1 s: its default)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.md")
    parser.add_argument("--append", action="store_true", help="add to the results file instead of replacing it")
    parser.add_argument("--note", default="", help="a line for the results file (a shortened run says so)")
    args = parser.parse_args(argv)
    cfg = SoakConfig(
        streams=args.streams,
        duration_s=args.duration,
        idle_s=args.idle,
        ramp_s=args.ramp,
        tokens_per_s=args.tokens_per_s,
        max_tokens=args.max_tokens,
        bursts=args.bursts,
        memory_trim_idle_s=args.trim_idle or None,
        python_malloc=args.python_malloc,
        replicas=args.replicas,
        gateway_env=tuple((k, v) for k, _, v in (kv.partition("=") for kv in args.gateway_env)),
        health_timeout_s=args.health_timeout,
    )
    import uvloop

    result = uvloop.run(run_soak(cfg))
    command = "python -m bench.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(result, command.strip(), args.note)
    if args.append and args.out.exists():
        text = args.out.read_text() + "\n" + text
    args.out.write_text(text)
    print(text)
    return 1 if bar_failures(result) else 0


if __name__ == "__main__":
    sys.exit(main())
