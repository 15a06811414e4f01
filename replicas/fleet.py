"""The fleet: every replica of every model, their processes, and their health loop.

``Fleet`` is an async context manager: entering starts the managed replicas and the
health checker; leaving drains (no new requests, in-flight ones get the grace period),
then stops the processes in reverse order.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from common.breaker import BreakerConfig, CircuitBreaker
from common.tasks import stop
from replicas.config import (
    EventsEndpoint,
    HealthSettings,
    KubernetesSource,
    ModelReplicas,
    ReplicaSettings,
    RestartSettings,
)
from replicas.credentials import CredentialError, upstream_headers
from replicas.health import HealthChecker
from replicas.launcher import LaunchSpec, ManagedProcess, free_port
from replicas.readiness import fleet_state_known
from replicas.replica import ProbeKind, Replica, ReplicaState

log = logging.getLogger("fleetgate.fleet")

# How often the waits below look at the fleet: a small fraction of a health interval.
_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class _Upstream:
    """How the replicas of one source are spoken to (resolved once, credentials included)."""

    served_model: str
    probe: ProbeKind
    metrics: bool
    headers: dict[str, str] = field(repr=False)
    priority_scheduling: bool = False


def sim_argv(port: int, served_model: str, rs: ReplicaSettings, index: int) -> list[str]:
    sim = rs.sim
    argv = [
        sys.executable,
        "-m",
        "sim.server",
        "--port",
        str(port),
        "--model",
        served_model,
        "--ttft-ms",
        str(sim.ttft_ms),
        "--tokens-per-s",
        str(sim.tokens_per_s),
        "--seed",
        str(sim.seed + index),
        "--time-scale",
        str(sim.time_scale),
    ]
    if sim.profile:
        argv += ["--profile", sim.profile]
    if sim.tokenizer:
        argv += ["--tokenizer", sim.tokenizer]
    if sim.ignore_eos:
        argv.append("--ignore-eos")
    return [*argv, *rs.args]


def vllm_argv(port: int, served_model: str, rs: ReplicaSettings) -> list[str]:
    assert rs.model_path is not None
    policy = rs.scheduling_policy
    scheduling = ["--scheduling-policy", policy] if policy and not _has_arg(rs.args, "--scheduling-policy") else []
    return [
        rs.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        rs.model_path,
        "--served-model-name",
        served_model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *scheduling,
        *rs.args,
    ]


def kv_events_args(publish_port: int, replay_port: int) -> list[str]:
    """vLLM's ``--kv-events-config`` publishing on ``publish_port``, replaying on ``replay_port``."""
    # vLLM binds its PUB socket only for a wildcard address (``tcp://*:port``) and *connects*
    # to any other (``ZmqEventPublisher._is_bind_endpoint``): a loopback address would have it
    # connect to nobody. The replay socket is always bound.
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{publish_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }
    return ["--kv-events-config", json.dumps(config)]


def publishes_events(rs: ReplicaSettings, model: str, tokenized: Collection[str]) -> bool:
    """Whether this source's replicas publish KV events the gateway reads: as configured, and
    by default for managed vLLM replicas of a model the gateway has the tokenizer of."""
    if isinstance(rs.kv_events, str):
        return True
    if rs.kv_events is not None:
        return rs.kv_events
    return rs.engine == "vllm" and model in tokenized and not _has_arg(rs.args, "--kv-events-config")


def _has_arg(args: Sequence[str], name: str) -> bool:
    """Whether the replica's own ``args`` already set ``name``."""
    return any(a == name or a.startswith(name + "=") for a in args)


class Fleet:
    """All replicas, grouped by public model name."""

    def __init__(
        self,
        models: Sequence[ModelReplicas],
        health: HealthSettings,
        *,
        log_dir: Path,
        restart: RestartSettings,
        clock: Callable[[], float] = time.monotonic,
        environ: Mapping[str, str] | None = None,
        on_down: Callable[[Replica], None] | None = None,
        on_removed: Callable[[Replica], None] | None = None,
        tokenized: Collection[str] = (),
    ) -> None:
        self._health_settings = health
        # Models the gateway has the tokenizer of: their managed vLLM replicas publish KV events
        # by default (``publishes_events``), and where each replica publishes, by replica id.
        self._tokenized = frozenset(tokenized)
        self.kv_endpoints: dict[str, EventsEndpoint] = {}
        # Models some of whose replicas publish, found or yet to be found by discovery.
        self.kv_models: set[str] = set()
        # Told of each discovered replica's events endpoint as it comes (None: it went).
        self._kv_listener: Callable[[str, EventsEndpoint | None], None] | None = None
        self._on_down = on_down
        # Told of each replica discovery removed or an operator restarts: its streams under
        # way move elsewhere.
        self._on_removed = on_removed
        # Operators' restarts under way, by replica id.
        self._restarts: dict[str, asyncio.Task[None]] = {}
        self._environ = os.environ if environ is None else environ
        self._log_dir = log_dir
        self._policy = restart
        self.clock = clock
        self.by_model: dict[str, list[Replica]] = {}
        self.tiers: dict[str, str] = {}
        self.processes: list[ManagedProcess] = []
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self.checker: HealthChecker | None = None
        self.discovery: list[tuple[str, KubernetesSource]] = []
        # What each discovery source's replicas get: served name, probe, headers; and the
        # topic its pods publish KV events on (where: ``KubernetesSource.events_at``).
        self._discovered_as: list[_Upstream] = []
        self._discovered_topics: list[str] = []
        # Replica ids each discovery source (model, index in `discovery`) added.
        self._owned: dict[tuple[str, int], set[str]] = {}
        # Discovery sources (index in `discovery`) whose first list has arrived.
        self._listed: set[int] = set()
        self._discovery_tasks: list[asyncio.Task[None]] = []
        self._models = {m.name: m for m in models}
        for model in models:
            self.tiers[model.name] = model.tier
            self.by_model[model.name] = self._build(model)

    def _breaker(self) -> CircuitBreaker:
        hs = self._health_settings
        # No trial timeout: the request's Claim hands an unfinished trial back when it ends.
        return CircuitBreaker(BreakerConfig(hs.breaker_failures, hs.breaker_cooldown_s, trial_timeout_s=None))

    def _upstream(self, model: ModelReplicas, index: int) -> _Upstream:
        rs = model.replicas[index]
        try:
            headers = upstream_headers(rs.api_key, rs.headers, self._environ)
        except CredentialError as exc:
            raise CredentialError(f"models.{model.name}.replicas.{index}.{exc}") from None
        return _Upstream(
            rs.upstream_model or model.name,
            rs.probe,
            rs.scrapes_metrics,
            headers,
            rs.scheduling_policy == "priority",
        )

    def _replica(self, rid: str, url: str, model: ModelReplicas, up: _Upstream, *, managed: bool) -> Replica:
        # Not probed: routable at once, until the passive breaker says otherwise.
        state = ReplicaState.HEALTHY if up.probe == "none" else ReplicaState.STARTING
        return Replica(
            rid,
            url.rstrip("/"),
            model.name,
            model.tier,
            up.served_model,
            managed,
            self._breaker(),
            state=state,
            probe=up.probe,
            scrape_metrics=up.metrics,
            upstream_headers=up.headers,
            priority_scheduling=up.priority_scheduling,
            stall_after_s=self._health_settings.stall_after_s,
        )

    def _build(self, model: ModelReplicas) -> list[Replica]:
        replicas: list[Replica] = []
        for source, rs in enumerate(model.replicas):
            up = self._upstream(model, source)
            if rs.kubernetes is not None:
                self.discovery.append((model.name, rs.kubernetes))
                self._discovered_as.append(up)
                self._discovered_topics.append(rs.kv_events_topic)
                if rs.kubernetes.kv_events_port is not None:
                    self.kv_models.add(model.name)
                continue
            for _ in range(rs.count):
                index = len(replicas)
                rid = f"{model.name}-{index}"
                events = publishes_events(rs, model.name, self._tokenized)
                if events:
                    self.kv_models.add(model.name)
                if rs.url is not None:
                    replicas.append(self._replica(rid, rs.url, model, up, managed=False))
                    if events and isinstance(rs.kv_events, str):
                        self.kv_endpoints[rid] = EventsEndpoint(rs.kv_events, rs.kv_events_replay, rs.kv_events_topic)
                    continue
                port = free_port()
                replica = self._replica(rid, f"http://127.0.0.1:{port}", model, up, managed=True)
                # The same ports across restarts: the subscriber's socket reconnects by itself.
                publish, replay = (free_port(), free_port()) if events else (0, 0)
                if events:
                    self.kv_endpoints[rid] = EventsEndpoint(
                        f"tcp://127.0.0.1:{publish}", f"tcp://127.0.0.1:{replay}", rs.kv_events_topic
                    )
                if rs.engine == "sim":
                    argv, env = sim_argv(port, up.served_model, rs, index), {}
                    if events:
                        argv += ["--kv-events-port", str(publish), "--kv-events-replay-port", str(replay)]
                else:
                    argv = vllm_argv(port, up.served_model, rs)
                    if events:
                        argv += kv_events_args(publish, replay)
                    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, rs.gpus))} if rs.gpus else {}
                env = {**env, **rs.env}
                spec = LaunchSpec(argv, env, self._log_dir / f"{rid}.log")
                self.processes.append(ManagedProcess(replica, spec, self._policy))
                replicas.append(replica)
        return replicas

    def sync(self, model: str, desired: Mapping[str, str], *, source: int = 0) -> tuple[list[str], list[str]]:
        """Make the replicas one discovery ``source`` of ``model`` found exactly ``desired``.

        ``desired`` maps replica id -> base URL. Idempotent: discovery hands over the
        whole desired set each time; only real changes are applied and logged, and only to
        the replicas this source added (a model may also have static or other discovered
        replicas). New replicas start as ``starting`` and join the rotation after their
        first good probe. Removed replicas leave the rotation at once; requests already
        on them finish (their claims hold the replica), or, for streams still running after
        a short grace, are continued on another replica (``on_removed``).
        """
        self._listed.add(source)
        current = self.by_model[model]
        owned = self._owned.setdefault((model, source), set())
        known = {r.id: r for r in current if r.id in owned}
        added = [rid for rid in desired if rid not in known or known[rid].base_url != desired[rid].rstrip("/")]
        removed = [rid for rid in known if rid not in desired or rid in added]
        if not added and not removed:
            return [], []
        keep = [r for r in current if r.id not in removed]
        if self._on_removed is not None:
            for replica in current:
                if replica.id in removed:
                    self._on_removed(replica)
        settings = self._models[model]
        up = self._discovered_as[source]
        _, kube = self.discovery[source]
        for rid in removed:
            self._events_moved(rid, None)
        for rid in added:
            keep.append(self._replica(rid, desired[rid], settings, up, managed=False))
            host = urlsplit(desired[rid]).hostname
            if host:
                self._events_moved(rid, kube.events_at(host, self._discovered_topics[source]))
        current[:] = keep  # in place: routing closures hold this list
        owned.difference_update(removed)
        owned.update(added)
        log.info("fleet changed", extra={"model": model, "added": added, "removed": removed})
        return added, [rid for rid in removed if rid not in added]

    def bind_kv_events(self, listener: Callable[[str, EventsEndpoint | None], None]) -> None:
        """Tell ``listener`` of each replica discovery adds that publishes KV events (its
        endpoint) and of each one it removes (None)."""
        self._kv_listener = listener

    def _events_moved(self, rid: str, where: EventsEndpoint | None) -> None:
        if where is None and self.kv_endpoints.pop(rid, None) is None:
            return
        if where is not None:
            self.kv_endpoints[rid] = where
        if self._kv_listener is not None:
            self._kv_listener(rid, where)

    def all(self) -> list[Replica]:
        return [r for rs in self.by_model.values() for r in rs]

    def get(self, replica_id: str) -> Replica | None:
        return next((r for r in self.all() if r.id == replica_id), None)

    def healthy_count(self) -> int:
        now = self.clock()
        return sum(r.routable(now) for r in self.all())

    async def __aenter__(self) -> Fleet:
        self._session = aiohttp.ClientSession()
        hs = self._health_settings
        self.checker = HealthChecker(
            self._session,
            interval_s=hs.interval_s,
            timeout_s=hs.timeout_s,
            failures_to_down=hs.failures_to_down,
            progress_window_s=hs.progress_window_s,
            adapters_interval_s=hs.adapters_interval_s,
            clock=self.clock,
            on_down=self._on_down,
        )
        for proc in self.processes:
            proc.start()
        for index, (model, source) in enumerate(self.discovery):
            from replicas.kubernetes import watch_endpoint_slices

            on_change = functools.partial(self.sync, model, source=index)
            self._discovery_tasks.append(
                asyncio.create_task(watch_endpoint_slices(source, on_change), name=f"k8s:{model}:{index}")
            )
        self._health_task = asyncio.create_task(self.checker.run(self.all), name="health")
        return self

    @property
    def state_known(self) -> bool:
        """Whether the fleet's state is known yet (``replicas.readiness``): what the
        gateway's readiness waits for at start."""
        return fleet_state_known(self.by_model, unlisted_sources=len(self.discovery) - len(self._listed))

    async def wait_known(self, timeout_s: float) -> bool:
        """Wait until ``state_known``; False on timeout."""
        return await self._until(lambda: self.state_known, timeout_s)

    async def wait_healthy(self, timeout_s: float, *, every: bool = False) -> bool:
        """Wait until one (or every) replica is routable; False on timeout."""

        def healthy() -> bool:
            n = self.healthy_count()
            return (every and n == len(self.all())) or (not every and n > 0)

        return await self._until(healthy, timeout_s)

    async def _until(self, check: Callable[[], bool], timeout_s: float) -> bool:
        # Polled: the health loop, the launcher and discovery change the state and signal nobody.
        deadline = self.clock() + timeout_s
        while self.clock() < deadline:
            if check():
                return True
            await asyncio.sleep(_POLL_S)
        return False

    async def drain_all(self, grace_s: float) -> None:
        """Stop routing to every replica; wait for in-flight requests up to ``grace_s``."""
        for replica in self.all():
            if replica.state is ReplicaState.HEALTHY:
                replica.state = ReplicaState.DRAINING
        deadline = self.clock() + grace_s
        # Polled: in-flight counts change in the proxy, which knows nothing of draining.
        while any(r.outstanding_requests for r in self.all()) and self.clock() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    def process(self, replica: Replica) -> ManagedProcess | None:
        """The process the gateway runs ``replica`` in; None for a replica it does not run."""
        return next((p for p in self.processes if p.replica is replica), None)

    def restart(self, replica: Replica, grace_s: float) -> bool:
        """Restart managed ``replica`` without cutting its streams: drained at once (its
        streams move to other replicas after ``upstream.migrate_after_s``), stopped once
        nothing runs on it or after ``grace_s``, started again; back in rotation at its
        first good probe. False when a restart of it is already under way."""
        proc = self.process(replica)
        if proc is None:
            raise ValueError(f"replica {replica.id} is not run by the gateway")
        if replica.id in self._restarts:
            return False
        task = asyncio.create_task(self._restart(proc, grace_s), name=f"restart:{replica.id}")
        self._restarts[replica.id] = task
        task.add_done_callback(lambda _: self._restarts.pop(replica.id, None))
        return True

    async def _restart(self, proc: ManagedProcess, grace_s: float) -> None:
        replica = proc.replica
        if replica.state is not ReplicaState.FAILED:
            replica.state = ReplicaState.DRAINING
        if self._on_removed is not None:
            self._on_removed(replica)
        log.info("replica restart: draining", extra={"replica": replica.id})
        started = self.clock()
        await self._until(lambda: not replica.outstanding_requests, grace_s)
        left = replica.outstanding_requests
        await proc.restart()
        log.info(
            "replica restart: stopped, starting again",
            extra={"replica": replica.id, "drained_s": round(self.clock() - started, 3), "requests_cut": left},
        )

    async def __aexit__(self, *exc: object) -> None:
        for task in [*self._restarts.values(), *self._discovery_tasks, self._health_task]:
            await stop(task)
        await asyncio.gather(*(p.stop() for p in reversed(self.processes)))
        if self._session is not None:
            await self._session.close()
