"""One replica as the gateway sees it: where it is, whether to use it, how loaded it is.

State machine::

    starting ──/health ok──► healthy ◄──probe ok── down
        │                      │  ▲                 ▲
        │                      │  └─undrain─┐       │ probes fail / process exits
        │                      └──drain──► draining ┘
        └── crash loop ──► failed (managed replicas only; stays until an admin restart)

Besides the state, a passive circuit breaker (``common.breaker``) counts consecutive proxy
failures; while it is open the replica is skipped even if its /health still answers. After
its cool-down one request, the trial, is sent; until the trial's outcome is known the replica
is not routable, so policies do not send a burst to a replica that has just come back. The
trial is taken and, if it ends without an outcome, handed back by the request's ``Claim``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from common.breaker import CircuitBreaker

# vLLM gauges the gateway reads (names as exposed by current vLLM).
GAUGE_RUNNING = "vllm:num_requests_running"
GAUGE_WAITING = "vllm:num_requests_waiting"
GAUGE_KV_USAGE = "vllm:kv_cache_usage_perc"
# Not a vLLM series: the KV cache's size in tokens, read off the labels of vLLM's
# ``vllm:cache_config_info`` (num_gpu_blocks x block_size) by the scraper.
GAUGE_KV_CAPACITY_TOKENS = "kv_capacity_tokens"

# How the health checker tells a replica is up: GET /health (vLLM, the simulator, TGI,
# llama.cpp), GET /v1/models (OpenAI-compatible servers without /health), or not at all
# (only the passive breaker takes the replica out of rotation).
ProbeKind = Literal["health", "models", "none"]
PROBE_PATHS: dict[str, str] = {"health": "/health", "models": "/v1/models"}

# How long every stream of this gateway on a replica may go without a byte before the replica
# counts as stalled (``Replica.stalled``; ``health.stall_after_s``). A healthy engine sends a
# token every few tens of milliseconds per stream, and even a step that prefills a full chunk
# (8,192 tokens) beside its decodes takes well under a second on a GPU: five seconds of
# silence on all of them is not load. It is short beside the stalls seen when two CPU engines
# share a core (10-75 s), so routing can spill new requests in the first seconds of one, and
# far below the chunk gap (30 s), so the spill starts long before any stream could be cut.
DEFAULT_STALL_AFTER_S = 5.0

# The statuses a last probe's reason names one by one: each points at a setting to fix (the
# key, the probe's path). Any other status is named by its class, so the label set is bounded.
_NAMED_STATUSES = frozenset({401, 403, 404})


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """How a replica's last active probe went: why it is in rotation or out of it.

    ``status`` is the answer's HTTP status, None when there was none; then ``error`` says
    why: "timeout", "late" (the gateway's own loop was held up: no verdict) or what the
    connection said. ``reason`` is the same in a bounded set, for a metric label.
    """

    path: str
    status: int | None
    error: str | None = None

    @property
    def reason(self) -> str:
        """One of: ok, http_401, http_403, http_404, http_4xx, http_5xx, http_other, timeout,
        late, error."""
        status = self.status
        if status is None:
            return self.error if self.error in ("timeout", "late") else "error"
        if status == 200:
            return "ok"
        if status in _NAMED_STATUSES:
            return f"http_{status}"
        return f"http_{status // 100}xx" if status // 100 in (4, 5) else "http_other"

    def snapshot(self) -> dict[str, object]:
        return {"path": self.path, "status": self.status, "error": self.error, "reason": self.reason}


class ReplicaState(StrEnum):
    STARTING = "starting"
    HEALTHY = "healthy"
    DRAINING = "draining"
    DOWN = "down"
    FAILED = "failed"


@dataclass(slots=True)
class Replica:
    """A replica serving one model; load counters are this gateway's own view."""

    id: str
    base_url: str
    model: str
    tier: str
    # The model name the replica itself serves (may differ from the public name).
    served_model: str
    managed: bool
    breaker: CircuitBreaker
    state: ReplicaState = ReplicaState.STARTING
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    # Streamed requests of this gateway still waiting for their first token, and their
    # prompt tokens the replica must still compute (estimated: cached prefixes excluded).
    prefill_requests: int = 0
    prefill_tokens: int = 0
    # Last values scraped from the replica's /metrics (vLLM metric name -> value), set by
    # ``observe``, and what they held beyond this gateway's own requests at that moment.
    gauges: dict[str, float] = field(default_factory=dict)
    foreign_requests: float = 0.0
    foreign_waiting: float = 0.0
    consecutive_probe_failures: int = 0
    probe_failures: int = 0
    restarts: int = 0
    # The process id of a managed replica (None for external ones).
    pid: int | None = None
    probe: ProbeKind = "health"
    # Scrape /metrics for vLLM's gauges; without them routing uses this gateway's own counts.
    scrape_metrics: bool = True
    # The LoRA adapters the replica serves (its /v1/models, ``replicas.lora``), and when
    # they were last read (gateway clock; None: not yet). Requests naming one go only here.
    adapters: frozenset[str] = frozenset()
    adapters_listed_at: float | None = None
    # The replica runs vLLM's priority scheduler: requests carry their band as ``priority``.
    priority_scheduling: bool = False
    # Sent with every request to the replica, probes included (credentials: never shown).
    upstream_headers: dict[str, str] = field(default_factory=dict, repr=False)
    # When bytes last arrived on one of this gateway's requests to the replica (gateway
    # clock): the passive sign of life that keeps probe timeouts of a busy replica from
    # taking it down. Probe timeouts so excused, and those seen late because the gateway's
    # own loop was held up (``health.LATE_S``), are counted in ``excused_probe_timeouts``.
    last_progress_at: float | None = None
    excused_probe_timeouts: int = 0
    # The last active probe (None: not probed yet); /admin/fleet and the metrics say why from it.
    last_probe: ProbeResult | None = None
    # Stall detection (``stalled``): this gateway's streams in flight on the replica, since
    # when it has held any (gateway clock), and how long all of them may go without a byte.
    streams: int = 0
    streams_since: float | None = None
    # This gateway's requests of a preempting band in flight on the replica (``Claim``):
    # a preemptible band's streams give way to them (``routing.preemption``).
    preempting: int = 0
    stall_after_s: float = DEFAULT_STALL_AFTER_S
    # The stall episode under way as the health loop saw it begin (``track_stall``), and
    # how many began since start.
    stalled_since: float | None = None
    stall_episodes: int = 0

    def observe(self, gauges: dict[str, float]) -> None:
        """Take a scrape of the replica's /metrics.

        Work the replica reports beyond this gateway's own (other gateway pods') is counted
        against this gateway's requests *now*, at the scrape, and kept until the next one.
        Counted later, against the current own count, a request of ours that finished since
        the scrape would pass for another pod's: every replica that just finished work
        would look busy for up to a health interval, and the policies would steer away
        from exactly the replicas that have room.
        """
        self.gauges = gauges
        running = gauges.get(GAUGE_RUNNING)
        waiting = gauges.get(GAUGE_WAITING, 0.0)
        if running is None:
            self.foreign_requests = self.foreign_waiting = 0.0
            return
        self.foreign_requests = max(0.0, running + waiting - self.outstanding_requests)
        # Our streamed requests not yet prefilled are the ones of ours that can be waiting.
        self.foreign_waiting = max(0.0, waiting - self.prefill_requests)

    @property
    def probed(self) -> bool:
        """Whether an active probe has given its verdict on the replica (always, for one
        that is not probed): until then its state is the one it started with, not news."""
        if self.probe == "none":
            return True
        return self.last_probe is not None and self.last_probe.error != "late"

    def routable(self, now: float) -> bool:
        """Healthy, and its breaker would let a request through (closed, or the trial is free)."""
        return self.state is ReplicaState.HEALTHY and self.breaker.ready(now)

    def stalled(self, now: float) -> bool:
        """Whether the replica holds streams of this gateway of which none has received a
        byte (a first token or a chunk) for ``stall_after_s``, as of ``now`` (gateway clock).

        A stalled replica is alive but not producing: its engine is stuck (starved of CPU,
        a long step, a hung collective), so a new request sent there waits behind it
        however short its own work. A routing policy should prefer another replica while
        this is true (the prefix's next one) and come back when it turns false, which it
        does at the first byte any of the replica's streams receives. It says nothing
        about cutting streams: those are the proxy's (``alive``).

        Measured on streams only: a non-streamed answer shows no progress until it is
        whole, so a replica holding only non-streamed requests is never judged stalled.
        The clock starts at the later of the last byte and the moment the replica went
        from no streams to some, so an idle replica's old progress does not count against
        its next request. Pure: reads the counters the claims and the proxy keep.
        """
        if not self.streams:
            return False
        since = self.streams_since
        last = self.last_progress_at
        if last is not None and (since is None or last > since):
            since = last
        return since is not None and now - since >= self.stall_after_s

    def track_stall(self, now: float) -> Literal["began", "ended"] | None:
        """Note, once per look (the health loop's round), whether a stall episode began or
        ended since the last look; counts the episodes for the metrics."""
        stalled = self.stalled(now)
        if stalled and self.stalled_since is None:
            self.stalled_since = now
            self.stall_episodes += 1
            return "began"
        if not stalled and self.stalled_since is not None:
            self.stalled_since = None
            return "ended"
        return None

    def alive(self) -> bool:
        """Whether the health checks vouch that the replica is up, however silent its streams.

        In rotation (healthy: its probes pass, or time out only while it still sends
        bytes), or draining while its last probe did not fail outright (draining replicas
        are probed but never taken down). A replica not probed at all (``probe: none``)
        has no such witness. The proxy keeps a silent stream open past the chunk gap only
        on a replica that is alive (``gateway.proxy``).
        """
        if self.probe == "none":
            return False
        if self.state is ReplicaState.HEALTHY:
            return True
        if self.state is ReplicaState.DRAINING:
            probe = self.last_probe
            return probe is None or probe.status == 200 or probe.error in ("timeout", "late")
        return False

    def snapshot(self, now: float) -> dict[str, object]:
        return {
            "id": self.id,
            "model": self.model,
            "tier": self.tier,
            "url": self.base_url,
            "managed": self.managed,
            "state": self.state.value,
            "breaker_open": not self.breaker.ready(now),
            "outstanding_requests": self.outstanding_requests,
            "outstanding_tokens": self.outstanding_tokens,
            "prefill_requests": self.prefill_requests,
            "prefill_tokens": self.prefill_tokens,
            "foreign_requests": self.foreign_requests,
            "foreign_waiting": self.foreign_waiting,
            "restarts": self.restarts,
            "pid": self.pid,
            "probe": self.probe,
            "probe_failures": self.probe_failures,
            "last_probe": self.last_probe.snapshot() if self.last_probe is not None else None,
            "excused_probe_timeouts": self.excused_probe_timeouts,
            "adapters": sorted(self.adapters),
            "stalled": self.stalled(now),
            "stall_episodes": self.stall_episodes,
            "gauges": dict(self.gauges),
        }


class Claim:
    """The load one request puts on a replica, taken back as the replica works it off.

    At dispatch the replica owes the prompt's prefill (``prompt``: the tokens it must compute,
    i.e. not already in its prefix cache) and up to ``completion`` tokens; the first token
    pays off the prompt, each further token one completion token, and ``release`` returns
    whatever is left (finished early, failed or cancelled).

    A request of a band that preempts (``preempting``) counts in ``Replica.preempting``
    until ``release``.

    A streamed request (``streamed``) counts in the replica's streams (``Replica.stalled``
    watches them) until ``release``, and in the replica's prefill backlog
    (``prefill_requests`` / ``prefill_tokens``) until its first token arrives. A non-streamed
    response shows no first token, so it is not counted there. ``on_prefilled`` is called
    once, when the prefill is over: at the first token, or at ``release`` if none came (the
    pool's admission hands the freed room on).

    A claim made (at ``now``) on a replica whose breaker is past its cool-down is that
    breaker's half-open trial. The proxy records the attempt's outcome on the breaker; a trial
    released without one (cancelled, the client left, the deadline passed) is handed back at
    ``release``, so the replica is not left half-open with a trial that never ends.
    """

    __slots__ = (
        "_completion_left",
        "_on_prefilled",
        "_prefilling",
        "_prompt_left",
        "_released",
        "_streamed",
        "_trial",
        "preempting",
        "replica",
    )

    def __init__(
        self,
        replica: Replica,
        prompt: int,
        completion: int,
        now: float,
        *,
        streamed: bool = False,
        on_prefilled: Callable[[], None] | None = None,
        preempting: bool = False,
    ) -> None:
        self.replica = replica
        self.preempting = preempting
        if preempting:
            replica.preempting += 1
        breaker = replica.breaker
        # Routing offered the replica only if its breaker was ready, and nothing awaited since.
        self._trial = breaker.trial if breaker.allow(now) else None
        self._prompt_left = prompt
        self._completion_left = completion
        self._released = False
        self._prefilling = self._streamed = streamed
        self._on_prefilled = on_prefilled
        replica.outstanding_requests += 1
        replica.outstanding_tokens += prompt + completion
        if streamed:
            replica.prefill_requests += 1
            replica.prefill_tokens += prompt
            if not replica.streams:
                replica.streams_since = now
            replica.streams += 1

    def prefilled(self) -> None:
        self._end_prefill()
        self.replica.outstanding_tokens -= self._prompt_left
        self._prompt_left = 0
        self._prefill_over()

    def generated(self, n: int) -> None:
        n = min(n, self._completion_left)
        self._completion_left -= n
        self.replica.outstanding_tokens -= n

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._trial is not None:
            self.replica.breaker.abandon_trial(self._trial)  # a no-op once its outcome is recorded
        self._end_prefill()
        if self._streamed:
            self.replica.streams -= 1
        if self.preempting:
            self.replica.preempting -= 1
        self.replica.outstanding_tokens -= self._prompt_left + self._completion_left
        self.replica.outstanding_requests -= 1
        self._prompt_left = self._completion_left = 0
        self._prefill_over()

    def _prefill_over(self) -> None:
        callback, self._on_prefilled = self._on_prefilled, None
        if callback is not None:
            callback()

    def _end_prefill(self) -> None:
        if self._prefilling:
            self._prefilling = False
            self.replica.prefill_requests -= 1
            self.replica.prefill_tokens -= self._prompt_left
