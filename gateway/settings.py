"""Settings: one YAML file plus ``FLEETGATE_*`` environment overrides, validated once.

Precedence (highest first): environment (``FLEETGATE_SERVER__PORT=9000``; nested keys
joined by ``__``; lists such as ``models`` as JSON), then the YAML file, then the defaults
below. With no file at all the defaults describe a laptop: two simulated replicas, memory
stores, one development tenant. ``docs/configuration.md`` documents every key.

Everything is parsed here and handed down as frozen models; no other module reads the
environment or the file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from batch.config import BatchSettings
from cache.config import CacheServiceSettings, CacheSettings
from conversations.config import ResponsesSettings
from limits.config import TenantLimits
from redisconn.config import RedisSettings
from redisconn.target import RedisTarget
from replicas.config import HealthSettings as HealthSettings
from replicas.config import KubernetesSource as KubernetesSource
from replicas.config import ReplicaSettings as ReplicaSettings
from replicas.config import RestartSettings as RestartSettings
from replicas.config import SimSettings as SimSettings
from replicas.lora import AdapterSettings
from routing.config import (
    BandSettings,
    CapacitySettings,
    DegradeSettings,
    Priority,
    RoutingSettings,
    band_list,
    default_bands,
)

# The built-in development key. Only present when no tenant is configured at all, and
# announced loudly at start-up, so a laptop works with zero setup and production does not
# silently inherit it.
DEV_API_KEY = "sk-fleetgate-dev"


DEV_TENANT_ID = "dev"
_DEV_KEY_REF = "sha256:" + hashlib.sha256(DEV_API_KEY.encode()).hexdigest()


class ConfigError(Exception):
    """The configuration is invalid; the message names the offending key path."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ServerSettings(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0)
    # The bound for an audio upload (/v1/audio/*, multipart), as OpenAI's 25 MB.
    max_audio_bytes: int = Field(25 * 1000 * 1000, gt=0)
    # How long a client may take to send its request body before a 408.
    body_timeout_s: float = Field(30.0, gt=0)
    # How long a client may take to send a request's line and headers, from its first byte
    # (from connecting, for a connection's first request), before a 408 and a close.
    header_timeout_s: float = Field(15.0, gt=0)
    # In-flight requests get this long to finish on SIGTERM before they are cut.
    shutdown_grace_s: float = Field(30.0, ge=0)
    # On SIGTERM /readyz turns 503 at once, but the listener keeps accepting (and serving) for
    # this long, while the endpoints controller and every kube-proxy take the pod out of the
    # Service; only then does it close. Kubernetes: terminationGracePeriodSeconds >
    # drain_delay_s + shutdown_grace_s (docs/kubernetes.md).
    drain_delay_s: float = Field(0.0, ge=0)
    # A second listener for /metrics and /admin/* (and the probes); set, they leave the API port.
    admin_port: int | None = Field(None, ge=0, le=65535)
    # Default: ``host``.
    admin_host: str | None = None
    # /metrics shows tenant ids and usage: ask for an admin key (admin_api_keys) to read it.
    metrics_require_key: bool = False
    access_log: bool = True
    # Prompt text never reaches the logs unless an operator asks for it.
    log_prompts: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # With no request in flight for this long, run the garbage collector and glibc's
    # malloc_trim once, so a burst's freed memory goes back to the system (common/idle_trim.py).
    # null: never.
    memory_trim_idle_s: float | None = Field(30.0, gt=0)

    @model_validator(mode="after")
    def _distinct_ports(self) -> ServerSettings:
        if self.admin_port is not None and self.admin_port == self.port and self.port != 0:
            raise ValueError("admin_port must differ from port")
        return self


class AutoscalingSettings(_Frozen):
    """The replica-count signal (``fleetgate_desired_replicas``): pending tokens per replica.

    ``target_pending_tokens``: the tokens (queued plus in flight) one replica should hold at
    the latency you want, by Little's law its token throughput times that latency
    (docs/kubernetes.md, "Autoscaling"). ``per_model`` overrides it by model name.
    """

    target_pending_tokens: int = Field(32_768, gt=0)
    per_model: dict[str, PositiveInt] = {}

    def target(self, model: str) -> int:
        return self.per_model.get(model, self.target_pending_tokens)


class TracingSettings(_Frozen):
    """What the OpenTelemetry spans hold (whether there are any, where they go and which
    requests are sampled: the standard ``OTEL_*`` variables, docs/operations.md)."""

    # Each stage's time is always an attribute of the request's server span; true adds a
    # child span per stage too (about three times the spans to export, store and pay for).
    stage_spans: bool = False


class UpstreamSettings(_Frozen):
    connect_timeout_s: float = Field(2.0, gt=0)
    # Until the first token (prefill under load can be slow).
    first_byte_timeout_s: float = Field(120.0, gt=0)
    # Silence between two chunks of a stream past which it is cut, unless the health checks
    # vouch for its replica (``Replica.alive``): then it waits, up to ``stall_timeout_s``.
    # A model may set its own (``models[].chunk_gap_timeout_s``).
    chunk_gap_timeout_s: float = Field(30.0, gt=0)
    # The longest silence any stream is given, however alive its replica looks: nothing
    # waits forever on an engine that is hung for good behind a /health that still answers.
    stall_timeout_s: float = Field(300.0, gt=0)
    # Whole non-streaming request.
    request_timeout_s: float = Field(600.0, gt=0)
    # Largest non-streamed answer read from a replica (it is held whole in memory); a larger
    # one is a 502 upstream_response_too_large, not retried. Streams are relayed, not held.
    max_response_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    # SSE comment sent to a waiting streaming client so proxies do not cut it.
    keepalive_interval_s: float = Field(10.0, gt=0)
    # Tries per request across replicas (1 = no retry); only before a byte reached the client.
    max_attempts: int = Field(3, ge=1, le=10)
    # A stream whose replica fails after its first byte is finished on another replica of
    # the same model, at most this many times (0: cut it with an error event, as before).
    max_continuations: int = Field(2, ge=0, le=10)
    # A drained or removed replica's streams still running this long after the drain are
    # moved to another replica (continued there), instead of being waited for to their end.
    migrate_after_s: float = Field(2.0, ge=0)
    # A LoRA adapter's load on a replica (POST /v1/load_lora_adapter, gateway.lora).
    adapter_load_timeout_s: float = Field(60.0, gt=0)
    pool_size: int = Field(1024, ge=1)


class LimitsServiceSettings(_Frozen):
    """Process-wide behaviour of the limiter (per-tenant limits live under ``tenants``)."""

    # A Redis call slower than this counts as a failure (the tenant's fail policy applies).
    redis_timeout_ms: float = Field(250.0, gt=0, le=10_000)
    # A dead gateway's concurrency slots and reservations come back within this.
    lease_ttl_s: float = Field(60.0, ge=3)
    # Gateways announce themselves this often; fail_open divides limits by the live count.
    heartbeat_s: float = Field(10.0, gt=0)
    # Consecutive failures that open the breaker, and how long it stays open.
    breaker_failures: int = Field(3, ge=1)
    breaker_cooldown_s: float = Field(2.0, gt=0)


class ModelSettings(_Frozen):
    """A model name clients ask for, its tier, and the replicas that serve it."""

    name: str = Field(min_length=1)
    tier: str = "default"
    replicas: list[ReplicaSettings] = Field(min_length=1)
    # Context window, used to reject prompts that cannot fit (None: the replica decides).
    max_model_len: int | None = Field(None, gt=0)
    # Where the model's tokenizer and chat template are (a directory, or a model id in the
    # Hugging Face cache) so prompt tokens are counted as the replica counts them; "none":
    # estimated from characters. Unset: a managed vLLM replica's model_path, if any (tokens/).
    tokenizer: str | None = Field(None, min_length=1)
    # Models tried, in order, when no replica of this one can serve (down, or every attempt failed).
    fallback: list[str] = []
    # Per replica; unset: routing.capacity.
    capacity: CapacitySettings | None = None
    # LoRA adapters of this model: requests naming one go to the replicas that serve it;
    # one with a path is loaded on a replica when none does (routing.adapters, gateway.lora).
    adapters: list[AdapterSettings] = []
    # This model's chunk gap (upstream.chunk_gap_timeout_s when unset).
    chunk_gap_timeout_s: float | None = Field(None, gt=0)


class ApiKeySettings(_Frozen):
    """A named key: the name is what ``limits.per_key`` refers to (and appears in logs)."""

    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    key: str

    @field_validator("key")
    @classmethod
    def _key_ref(cls, ref: str) -> str:
        _check_key_ref(ref)
        return ref


class TenantSettings(_Frozen):
    """A tenant: who it is, which keys authenticate it, and its limits."""

    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    # Each entry: "sha256:<64 hex>" (see `fleetgate hash-key`), "env:VARIABLE", or
    # {id: NAME, key: "sha256:..."} to name the key for per-key limits.
    api_keys: list[str | ApiKeySettings] = Field(min_length=1)
    limits: TenantLimits = TenantLimits()
    cache: CacheSettings = CacheSettings()
    # Share of a saturated pool in the fair queue, relative to other tenants (default 1).
    weight: float = Field(1.0, gt=0)
    # Longest queue wait: routing.queue.max_wait_s by priority.
    priority: Priority = "normal"
    # Priority band (one of `bands`); its requests may ask for a lower one with the
    # x-fleetgate-band header, never a higher one. Unset: the first (highest) band.
    band: str | None = None
    # Tiers the x-fleetgate-tier request header may force: true (any), false, or a list.
    allow_force_tier: bool | list[str] = False
    # Model names this tenant's requests are classified for, as if they asked for "auto".
    classify_models: list[str] = []
    # Model names a client may send for this tenant, each served by a fleet model (or "auto"),
    # e.g. {"claude-sonnet-4-5": "auto"} for a client that only knows its vendor's names.
    model_aliases: dict[str, str] = {}
    degrade: DegradeSettings = DegradeSettings()

    @field_validator("api_keys")
    @classmethod
    def _key_refs(cls, keys: list[str | ApiKeySettings]) -> list[str | ApiKeySettings]:
        for ref in keys:
            if isinstance(ref, str):
                _check_key_ref(ref)
        return keys


class Settings(BaseSettings):
    """The whole configuration."""

    model_config = SettingsConfigDict(
        env_prefix="FLEETGATE_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    server: ServerSettings = ServerSettings()
    upstream: UpstreamSettings = UpstreamSettings()
    health: HealthSettings = HealthSettings()
    restart: RestartSettings = RestartSettings()
    cache: CacheServiceSettings = CacheServiceSettings()
    limits: LimitsServiceSettings = LimitsServiceSettings()
    routing: RoutingSettings = RoutingSettings()
    autoscaling: AutoscalingSettings = AutoscalingSettings()
    tracing: TracingSettings = TracingSettings()
    # Stored Responses (/v1/responses with store, previous_response_id): kept in Redis when
    # redis_url is set, else in this process's memory.
    responses: ResponsesSettings = ResponsesSettings()
    # The Batch API (/v1/files, /v1/batches; docs/batch.md): its state and work queue in Redis
    # when redis_url is set, else in this process's memory; file bodies under files_dir.
    batch: BatchSettings = BatchSettings()
    # Unset: limits and caches live in this process's memory. redis://, rediss://,
    # redis+cluster://h:p[,h:p...] or redis+sentinel://h:p[,h:p...]/service (redisconn.target).
    redis_url: str | None = None
    # Credentials and TLS for whichever scheme redis_url uses.
    redis: RedisSettings = RedisSettings()
    # What model "auto" means when no model serves a routing tier; default: the first model.
    default_model: str | None = None
    models: list[ModelSettings] = Field(
        default_factory=lambda: [ModelSettings(name="fleetgate-sim", replicas=[ReplicaSettings(engine="sim", count=2)])]
    )
    tenants: list[TenantSettings] = []
    admin_api_keys: list[str] = []
    # Priority bands, highest first: a saturated pool serves them in this order, tenants
    # fairly by weight inside each (routing.band_queue). Names, or {name, max_wait_s, max_queued}.
    bands: list[BandSettings] = Field(default_factory=default_bands, min_length=1, max_length=16)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, url: str | None) -> str | None:
        if url is not None:
            RedisTarget.parse(url)
        return url

    _band_names = field_validator("bands", mode="before")(band_list)

    @field_validator("admin_api_keys")
    @classmethod
    def _admin_refs(cls, keys: list[str]) -> list[str]:
        for ref in keys:
            _check_key_ref(ref)
        return keys

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        names = [m.name for m in self.models]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise ValueError(f"models: duplicate name(s) {sorted(dupes)}")
        if "auto" in names:
            raise ValueError("models: 'auto' is reserved for tier routing")
        if self.default_model is not None and self.default_model not in names:
            raise ValueError(f"default_model: {self.default_model!r} is not a configured model")
        ids = [t.id for t in self.tenants]
        if len(ids) != len(set(ids)):
            raise ValueError("tenants: duplicate tenant id")
        _check_routing_refs(self)
        _check_bands(self)
        _check_adapters(self)
        _check_stream_timeouts(self)
        unknown = sorted(set(self.autoscaling.per_model) - set(names))
        if unknown:
            raise ValueError(f"autoscaling.per_model: {unknown} are not configured models")
        return self

    @property
    def uses_dev_tenant(self) -> bool:
        return any(t.id == DEV_TENANT_ID and t.api_keys == [_DEV_KEY_REF] for t in self.tenants)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        yaml_file = settings_cls.model_config.get("yaml_file")
        if yaml_file:
            sources += (YamlConfigSettingsSource(settings_cls),)
        return sources


def _check_bands(settings: Settings) -> None:
    """Band names are distinct, and each tenant's band is one of them."""
    names = [b.name for b in settings.bands]
    if len(names) != len(set(names)):
        raise ValueError("bands: duplicate band name")
    for tenant in settings.tenants:
        if tenant.band is not None and tenant.band not in names:
            raise ValueError(f"tenants.{tenant.id}.band: {tenant.band!r} is not one of bands {names}")


def _check_routing_refs(settings: Settings) -> None:
    """Names that routing settings use must exist: fallback models, classified models, tiers."""
    names = {m.name for m in settings.models}
    for i, model in enumerate(settings.models):
        for name in model.fallback:
            if name == model.name:
                raise ValueError(f"models.{i}.fallback: {name!r} cannot be its own fallback")
            if name not in names:
                raise ValueError(f"models.{i}.fallback: {name!r} is not a configured model")
        if len(set(model.fallback)) != len(model.fallback):
            raise ValueError(f"models.{i}.fallback: a model is listed twice")
    tiers = {t.name for t in settings.routing.tiers}
    for i, tenant in enumerate(settings.tenants):
        for name in tenant.classify_models:
            if name not in names:
                raise ValueError(f"tenants.{i}.classify_models: {name!r} is not a configured model")
        if isinstance(tenant.allow_force_tier, list):
            unknown = sorted(set(tenant.allow_force_tier) - tiers)
            if unknown:
                raise ValueError(f"tenants.{i}.allow_force_tier: {unknown} are not routing tiers")


def _check_stream_timeouts(settings: Settings) -> None:
    """A chunk gap past the stall timeout would never apply: the longer wait would cut first."""
    limit = settings.upstream.stall_timeout_s
    if settings.upstream.chunk_gap_timeout_s > limit:
        raise ValueError(f"upstream.chunk_gap_timeout_s: more than upstream.stall_timeout_s ({limit:g})")
    for i, model in enumerate(settings.models):
        if model.chunk_gap_timeout_s is not None and model.chunk_gap_timeout_s > limit:
            raise ValueError(f"models.{i}.chunk_gap_timeout_s: more than upstream.stall_timeout_s ({limit:g})")


def chunk_gaps(settings: Settings) -> dict[str, float]:
    """Each model's chunk gap: its own, else ``upstream.chunk_gap_timeout_s``."""
    default = settings.upstream.chunk_gap_timeout_s
    return {m.name: m.chunk_gap_timeout_s or default for m in settings.models}


def _check_adapters(settings: Settings) -> None:
    """An adapter's name is a model name clients send: unique, and no configured model's."""
    names = {m.name for m in settings.models} | {"auto"}
    seen: set[str] = set()
    for i, model in enumerate(settings.models):
        for j, adapter in enumerate(model.adapters):
            if adapter.name in names:
                raise ValueError(f"models.{i}.adapters.{j}.name: {adapter.name!r} is a model's name")
            if adapter.name in seen:
                raise ValueError(f"models.{i}.adapters.{j}.name: {adapter.name!r} is configured twice")
            seen.add(adapter.name)


def hash_key(key: str) -> str:
    """The SHA-256 hex digest a config stores instead of the key itself."""
    return hashlib.sha256(key.encode()).hexdigest()


def _check_key_ref(ref: str) -> None:
    kind, _, value = ref.partition(":")
    if kind == "sha256":
        if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
            raise ValueError("a 'sha256:' key must be 64 lowercase hex digits")
    elif kind == "env":
        if not value:
            raise ValueError("an 'env:' key needs a variable name")
    else:
        raise ValueError("an API key must be 'sha256:<hex>' or 'env:VARIABLE', never plain text")


def load_settings(path: str | Path | None = None) -> Settings:
    """Read, merge and validate; raise ``ConfigError`` naming the key path on any problem."""
    try:
        if path is None:
            # No file at all: a laptop. Give it the development tenant, unless the
            # environment configured tenants. (A file with no tenants gets none: deleting
            # every tenant must never open the gateway to the well-known dev key.)
            settings = Settings()
            if settings.tenants:
                return settings
            dev = TenantSettings(id=DEV_TENANT_ID, api_keys=[_DEV_KEY_REF])
            return settings.model_copy(update={"tenants": [dev]})
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"{file}: no such file")
        # Parse once here so a YAML syntax error is reported as such, with its line.
        data = yaml.safe_load(file.read_text())
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"{file}: the top level must be a mapping")

        class _FromFile(Settings):
            model_config = SettingsConfigDict(yaml_file=file)

        return _FromFile()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path)) from exc


def _describe(exc: ValidationError, path: str | Path | None) -> str:
    where = f"{path}: " if path else ""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"]) or "(top level)"
        lines.append(f"{where}{loc}: {err['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def settings_digest(settings: Settings) -> dict[str, Any]:
    """A loggable view of the settings: no key hashes, no Redis credentials."""
    return {
        "models": [
            {"name": m.name, "tier": m.tier, "replicas": sum(r.count for r in m.replicas)} for m in settings.models
        ],
        "tenants": [t.id for t in settings.tenants],
        "redis": RedisTarget.parse(settings.redis_url).kind if settings.redis_url else "memory",
    }
