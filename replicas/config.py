"""How the fleet is configured: replica sources, health checks, restarts of managed replicas.

These are the ``models[].replicas[]``, ``health`` and ``restart`` sections of the YAML;
``gateway.settings`` assembles them with the other packages' sections into ``Settings``.
Validated once at load, then handed to the fleet as frozen objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from replicas.replica import DEFAULT_STALL_AFTER_S, ProbeKind

# Header names a replica source's `headers` cannot set: the gateway writes these itself.
_GATEWAY_HEADERS = frozenset(
    {"host", "content-length", "content-type", "transfer-encoding", "connection", "x-request-id", "traceparent"}
)
_NOT_IN_HEADER_NAMES = frozenset(' \t\r\n:()<>@,;\\"/[]?={}')


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class HealthSettings(_Frozen):
    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(1.0, gt=0)
    # Consecutive failed probes before a healthy replica is taken out of rotation.
    failures_to_down: int = Field(3, ge=1)
    # A probe timeout does not count against a replica that sent bytes on one of this
    # gateway's in-flight requests within this long (busy, not dead).
    progress_window_s: float = Field(10.0, gt=0)
    # A replica whose streams from this gateway have all gone this long without a byte is
    # stalled (``Replica.stalled``): shown in /admin/fleet and the metrics, and avoided by routing.
    stall_after_s: float = Field(DEFAULT_STALL_AFTER_S, gt=0)
    # How often each replica's LoRA adapters are read from its /v1/models (on a probe that
    # passes; also whenever one that was out of rotation passes). None: never.
    adapters_interval_s: float | None = Field(5.0, gt=0)
    # Consecutive proxy failures (connect errors, 5xx, timeouts) that open a replica's breaker.
    breaker_failures: int = Field(5, ge=1)
    breaker_cooldown_s: float = Field(5.0, gt=0)
    # How long a managed replica may take to answer /health after start.
    start_timeout_s: float = Field(600.0, gt=0)


class RestartSettings(_Frozen):
    """How managed replicas are restarted when they exit."""

    backoff_initial_s: float = Field(1.0, gt=0)
    backoff_max_s: float = Field(60.0, gt=0)
    # This many exits within the window marks the replica failed (no more restarts).
    crash_loop_count: int = Field(5, ge=1)
    crash_loop_window_s: float = Field(300.0, gt=0)
    # On shutdown, SIGTERM then this long before SIGKILL.
    stop_timeout_s: float = Field(10.0, gt=0)


class SimSettings(_Frozen):
    """Timing of a simulated replica (``engine: sim``)."""

    ttft_ms: float = Field(50.0, ge=0)
    tokens_per_s: float = Field(50.0, gt=0)
    # A calibrated GPU/model profile (``sim.profiles``); overrides the two above.
    profile: str | None = None
    seed: int = 0
    time_scale: float = Field(1.0, gt=0)
    # Answers end on their own (``sim.answer_lengths``); true: every answer runs to max_tokens,
    # as with vLLM's ignore_eos on each request (benchmarks that need exact output lengths).
    ignore_eos: bool = False
    # A model directory whose tokenizer and chat template make the prompts' token ids (chat and
    # completions), as the gateway's do: what KV events from a simulated replica need to match.
    tokenizer: str | None = None


@dataclass(frozen=True, slots=True)
class EventsEndpoint:
    """Where a replica publishes: the PUB endpoint, its replay endpoint (None: none), the topic."""

    endpoint: str
    replay: str | None = None
    topic: str = ""


class KubernetesSource(_Frozen):
    """vLLM pods found through the EndpointSlices of a Service (in-cluster credentials)."""

    service: str = Field(min_length=1)
    # Default: the namespace the gateway's pod runs in.
    namespace: str | None = None
    # The EndpointSlice port to use, by name or number (default: the slice's first port).
    port: str | int | None = None
    scheme: Literal["http", "https"] = "http"
    # Where each pod publishes vLLM's KV-cache events (`--kv-events-config`'s endpoint
    # `tcp://*:PORT`), and its replay socket: read at the pod's own address, into the exact
    # prefix index. Unset: the pods' events are not read.
    kv_events_port: int | None = Field(None, ge=1, le=65535)
    kv_events_replay_port: int | None = Field(None, ge=1, le=65535)

    @model_validator(mode="after")
    def _replay_needs_events(self) -> KubernetesSource:
        if self.kv_events_replay_port is not None and self.kv_events_port is None:
            raise ValueError("kv_events_replay_port needs kv_events_port, the publisher's port")
        return self

    def events_at(self, host: str, topic: str = "") -> EventsEndpoint | None:
        """Where the pod at ``host`` (an address, IPv6 without brackets) publishes; None: not read."""
        if self.kv_events_port is None:
            return None
        address = f"[{host}]" if ":" in host else host
        replay = self.kv_events_replay_port
        return EventsEndpoint(
            f"tcp://{address}:{self.kv_events_port}",
            None if replay is None else f"tcp://{address}:{replay}",
            topic,
        )


class ReplicaSettings(_Frozen):
    """One replica source: an external ``url``, a managed ``engine``, or ``kubernetes`` discovery."""

    url: str | None = None
    engine: Literal["sim", "vllm"] | None = None
    kubernetes: KubernetesSource | None = None
    count: int = Field(1, ge=1, le=64)
    sim: SimSettings = SimSettings()
    # engine: vllm
    python: str = "python3"
    model_path: str | None = None
    gpus: list[int] = []
    args: list[str] = []
    env: dict[str, str] = {}
    # How health is checked: "health" (GET /health), "models" (GET /v1/models) or "none"
    # (passive: the breaker only). Default "health"; managed replicas cannot use "none".
    probe: ProbeKind = "health"
    # Scrape /metrics for vLLM's load gauges (optional: without them, routing uses the
    # gateway's own counts). Default: on for managed and Kubernetes replicas, and for
    # `url:` replicas probed with "health"; off otherwise.
    metrics: bool | None = None
    # Sent as "Authorization: Bearer <key>" on every request and probe: "env:VARIABLE" or
    # the absolute path of a file holding the key (a mounted Kubernetes Secret). Never logged.
    api_key: str | None = None
    # Extra static headers sent upstream (e.g. an organisation or project id).
    headers: dict[str, str] = {}
    # The model name the upstream serves, when it differs from the public name.
    upstream_model: str | None = Field(None, min_length=1)
    # "priority": the replica runs vLLM's priority scheduler, so each request's band goes
    # with it as its `priority` field (0 the highest band; vLLM serves lower values first);
    # a managed vLLM replica is started with --scheduling-policy priority. Unset or "fcfs":
    # no priority field is sent.
    scheduling_policy: Literal["fcfs", "priority"] | None = None

    # vLLM's KV-cache events, read into the exact prefix index (routing.kv_index). Managed
    # replicas: true launches them publishing (the gateway picks the ports), false does not;
    # unset: on for `engine: vllm` when the gateway has the model's tokenizer. `url` replicas:
    # the publisher's endpoint, "tcp://host:port" (and `kv_events_replay`, its replay socket).
    kv_events: bool | str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str = ""

    @field_validator("kv_events", "kv_events_replay")
    @classmethod
    def _zmq_endpoint(cls, value: bool | str | None) -> bool | str | None:
        if isinstance(value, str) and not value.startswith(("tcp://", "ipc://")):
            raise ValueError("a KV events endpoint is 'tcp://host:port' (or 'ipc://path')")
        return value

    @field_validator("api_key")
    @classmethod
    def _api_key_ref(cls, ref: str | None) -> str | None:
        if ref is not None and not (ref.startswith("/") or (ref.startswith("env:") and len(ref) > 4)):
            raise ValueError("api_key must be 'env:VARIABLE' or an absolute file path, never the key itself")
        return ref

    @field_validator("headers")
    @classmethod
    def _header_names(cls, headers: dict[str, str]) -> dict[str, str]:
        for name, value in headers.items():
            if not name or any(c in name for c in _NOT_IN_HEADER_NAMES) or not name.isascii():
                raise ValueError(f"headers: {name!r} is not a valid header name")
            if name.lower() in _GATEWAY_HEADERS:
                raise ValueError(f"headers: {name!r} is set by the gateway")
            if "\r" in value or "\n" in value or not value.isascii():
                raise ValueError(f"headers: the value of {name!r} must be one line of ASCII")
        return headers

    @property
    def scrapes_metrics(self) -> bool:
        """``metrics``, or its default for this source."""
        if self.metrics is not None:
            return self.metrics
        return self.url is None or self.probe == "health"

    @model_validator(mode="after")
    def _one_source(self) -> ReplicaSettings:
        if sum(x is not None for x in (self.url, self.engine, self.kubernetes)) != 1:
            raise ValueError("give exactly one of 'url' (external), 'engine' (managed) or 'kubernetes' (discovered)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError("url must start with http:// or https://")
        if self.engine is None and self.count != 1:
            raise ValueError("'count' applies to managed replicas only")
        if self.engine == "vllm" and not self.model_path:
            raise ValueError("engine 'vllm' needs 'model_path' (a local directory or a model id)")
        if self.api_key is not None and any(n.lower() == "authorization" for n in self.headers):
            raise ValueError("give the credential once: 'api_key' or an Authorization header, not both")
        if self.kubernetes is not None and self.kv_events not in (None, False):
            raise ValueError("a 'kubernetes' source's KV events are kubernetes.kv_events_port (each pod's address)")
        if isinstance(self.kv_events, str) and self.url is None:
            raise ValueError("kv_events as an endpoint is for 'url' replicas; managed ones take true or false")
        if self.kv_events_replay is not None and not isinstance(self.kv_events, str):
            raise ValueError("kv_events_replay needs kv_events, the publisher's endpoint")
        if self.url is not None and self.kv_events is True:
            raise ValueError("a 'url' replica's kv_events is its publisher's endpoint, 'tcp://host:port'")
        if self.engine is not None and self.probe == "none":
            raise ValueError("probe 'none' is for external replicas: a managed one is probed to know it started")
        given = _flag_value(self.args, "--scheduling-policy")
        if given is not None and self.scheduling_policy is not None and given != self.scheduling_policy:
            raise ValueError(
                f"scheduling_policy {self.scheduling_policy!r} contradicts '--scheduling-policy {given}' in args"
            )
        return self


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value ``args`` give ``flag`` (``--flag value`` or ``--flag=value``), if any."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1 :]
    return None


class ModelReplicas(Protocol):
    """What the fleet reads of one configured model (``gateway.settings.ModelSettings``).

    The model's other settings (routing capacity, fallback chain) belong to the layers above.
    """

    @property
    def name(self) -> str: ...

    @property
    def tier(self) -> str: ...

    @property
    def replicas(self) -> Sequence[ReplicaSettings]: ...
