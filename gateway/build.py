"""The composition root's parts: each component built from its own section of the settings,
and each API's request path built from the stages' own parts.

``Gateway`` (``gateway.app``) calls these once at start; ``paths`` again when tenants reload.
A component is handed only what it uses: a settings section, a frozen view of one
(``BodyLimits``, ``ModelRules``, ``QueueRules``), or another component.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry

from batch.files import LocalFileStore
from batch.loopback import InternalKeys
from batch.memory_store import MemoryBatchStore
from batch.metrics import BatchMetrics
from batch.redis_store import RedisBatchStore
from batch.store import BatchStore
from cache.metrics import CacheMetrics
from cache.service import ResponseCache, create_response_cache
from common.breaker import BreakerConfig
from conversations.factory import create_response_store
from dialects.base import Dialect
from dialects.registry import DIALECTS
from dialects.responses import RESPONSES_API
from gateway.auth import KeyRing
from gateway.autoscale import PendingTokens
from gateway.lora import AdapterLoader
from gateway.metrics import GatewayMetrics
from gateway.proxy import Proxy
from gateway.responses_state import ResponseState
from gateway.settings import ConfigError, ModelSettings, Settings, TenantSettings, chunk_gaps
from gateway.stages import Stage
from gateway.stages.admit import Admit
from gateway.stages.classify import Classify, ModelRules
from gateway.stages.forward import Forward, LoadAdapter
from gateway.stages.intake import Authenticate, BodyLimits, Parse
from gateway.stages.lookup import LookUpCache
from gateway.stages.queueing import Queue, QueueRules
from limits.limiter import Limiter, LimiterOptions, create_limiter
from limits.metrics import LimitsMetrics
from redisconn.config import RedisSecurity
from replicas.credentials import CredentialError
from replicas.fleet import Fleet
from routing.adapters import AdapterCatalog, AdapterSpec
from routing.bands import Bands
from routing.embedding_head import EmbeddingHeadError, load_head
from routing.kv_index import KvIndex
from routing.kv_subscriber import KvEventStreams
from routing.metrics import RoutingMetrics
from routing.pool import PoolSpec
from routing.router import Router
from routing.static_head import StaticHeadError, load_static_head
from tokens.counter import PromptCounter, TokenizerSpec
from tokens.model_tokenizer import TokenizerError

log = logging.getLogger("fleetgate")


def redis_security(settings: Settings) -> RedisSecurity:
    """The credentials and TLS every Redis store shares (a password's variable or file is
    only read at start, so a missing one fails here)."""
    try:
        return settings.redis.resolve(os.environ)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def proxy(settings: Settings, metrics: GatewayMetrics, clock: Callable[[], float]) -> Proxy:
    return Proxy(
        settings.upstream,
        metrics,
        clock,
        chunk_gaps=chunk_gaps(settings),
        preemptions=Bands.from_settings(settings.bands).max_preemptions,
    )


def fleet(
    settings: Settings, proxy: Proxy, log_dir: Path, clock: Callable[[], float], counter: PromptCounter | None = None
) -> Fleet:
    """The replicas of every model; one a health check takes down has its waiting requests
    moved elsewhere at once (``Proxy.abandon``), one discovery removes its streams
    (``Proxy.migrate``, among the replicas of its model). A model's replicas set to publish
    KV events whose tokenizer the gateway lacks stop the start: the exact index hashes the
    prompt's token ids, which only the model's tokenizer gives."""
    tokenized = [m.name for m in settings.models if counter is not None and counter.counts(m.name)]
    for model in settings.models:
        for i, rs in enumerate(model.replicas):
            discovered = rs.kubernetes is not None and rs.kubernetes.kv_events_port is not None
            if (discovered or rs.kv_events not in (None, False)) and model.name not in tokenized:
                raise ConfigError(
                    f"models.{model.name}.replicas.{i}.kv_events: the gateway has no tokenizer for this model, so it "
                    "cannot hash its prompts as the replica's KV events do; set models[].tokenizer, or kv_events: false"
                )
    try:
        built = Fleet(
            settings.models,
            settings.health,
            restart=settings.restart,
            log_dir=log_dir,
            clock=clock,
            on_down=proxy.abandon,
            on_removed=proxy.migrate,
            tokenized=tokenized,
        )
    except CredentialError as exc:
        raise ConfigError(str(exc)) from None
    proxy.bind_fleet(lambda replica: built.by_model.get(replica.model, ()))
    return built


def kv_events(settings: Settings, fleet: Fleet, router: Router, counter: PromptCounter) -> KvEventStreams:
    """A subscriber per replica that publishes KV events, into the router's exact index; the
    models they serve keep their prompts' token ids (``PromptCounter.count(ids=True)``)."""
    index = KvIndex(settings.routing.kv_events_max_blocks)
    streams = KvEventStreams(fleet.kv_endpoints, index, fleet.clock)
    fleet.bind_kv_events(streams.update)  # discovered replicas come and go
    models = frozenset(fleet.kv_models)
    if models:
        router.kv, router.kv_models = index, models
        log.info("KV events read for routing", extra={"models": sorted(models), "replicas": len(fleet.kv_endpoints)})
    return streams


def response_cache(settings: Settings, metrics: GatewayMetrics, security: RedisSecurity) -> ResponseCache:
    return create_response_cache(
        settings.redis_url,
        settings.cache,
        CacheMetrics(metrics.registry),
        # The embedder also loads at start for a classifier told to embed every auto request.
        start_semantic=any(t.cache.enabled and t.cache.semantic.enabled for t in settings.tenants)
        or settings.routing.classifier.embedding == "always",
        security=security,
    )


def response_state(
    settings: Settings, metrics: GatewayMetrics, security: RedisSecurity, clock: Callable[[], float]
) -> ResponseState:
    store = create_response_store(settings.redis_url, settings.responses, security, clock=clock)
    return ResponseState(store, settings.responses, metrics)


def batch_parts(
    settings: Settings, registry: CollectorRegistry, security: RedisSecurity
) -> tuple[BatchStore, LocalFileStore, BatchMetrics, InternalKeys]:
    """The Batch API's store (Redis with ``redis_url``, else memory), files, metrics and the
    process's internal keys (``batch.loopback``)."""
    batch = settings.batch
    store: BatchStore
    if settings.redis_url is not None:
        store = RedisBatchStore.from_url(settings.redis_url, batch, security)
    else:
        store = MemoryBatchStore()
    return store, LocalFileStore(Path(batch.files_dir)), BatchMetrics(registry), InternalKeys()


def loopback_url(settings: Settings) -> str:
    """Where the runner reaches this process's own listener (``batch.loopback_url``, else
    ``server.host:port``; a wildcard host is reached on 127.0.0.1)."""
    if settings.batch.loopback_url is not None:
        return settings.batch.loopback_url
    host = settings.server.host
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.server.port}"


def prompt_counter(settings: Settings, env: Mapping[str, str]) -> PromptCounter:
    """Each model's tokenizer (``models[].tokenizer``, else a managed vLLM replica's model),
    loaded now; one configured but unreadable is a ``ConfigError``."""
    try:
        return PromptCounter.load([_tokenizer_spec(m, env) for m in settings.models])
    except TokenizerError as exc:
        raise ConfigError(f"models[].tokenizer: {exc}") from exc


def _tokenizer_spec(model: ModelSettings, env: Mapping[str, str]) -> TokenizerSpec:
    if model.tokenizer == "none":
        return TokenizerSpec(model.name, None, explicit=False)
    if model.tokenizer is not None:
        return TokenizerSpec(model.name, model.tokenizer, explicit=True, env=env)
    for replica in model.replicas:
        if replica.engine != "vllm" or replica.model_path is None:
            continue
        args = replica.args
        if "--chat-template" in args or any(a.startswith("--chat-template=") for a in args):
            log.warning(
                "the replicas render another chat template (--chat-template): prompt tokens are estimated; "
                "set models[].tokenizer to a directory holding that template to count them",
                extra={"model": model.name},
            )
            return TokenizerSpec(model.name, None, explicit=False)
        reference = _arg(args, "--tokenizer") or replica.model_path
        return TokenizerSpec(model.name, reference, explicit=False, env={**env, **replica.env})
    return TokenizerSpec(model.name, None, explicit=False)


def _arg(args: list[str], name: str) -> str | None:
    """The value of ``name`` in a command line (``--name V`` or ``--name=V``)."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1 :]
    return None


def limiter(settings: Settings, metrics: GatewayMetrics, security: RedisSecurity) -> Limiter:
    ls = settings.limits
    options = LimiterOptions(
        lease_ttl_s=ls.lease_ttl_s,
        heartbeat_s=ls.heartbeat_s,
        breaker=BreakerConfig(failures=ls.breaker_failures, cooldown_s=ls.breaker_cooldown_s),
        redis_timeout_s=ls.redis_timeout_ms / 1000,
    )
    metered = LimitsMetrics(metrics.registry)
    return create_limiter(settings.redis_url, options=options, metrics=metered, security=security)


def router(
    settings: Settings, fleet: Fleet, metrics: RoutingMetrics, rng: random.Random, clock: Callable[[], float]
) -> Router:
    """Every model's pool, and the classifier with the heads its settings name."""
    classifier = settings.routing.classifier
    try:
        head = None if classifier.embedding == "never" else load_head(classifier.embedding_head_path)
    except EmbeddingHeadError as exc:
        raise ConfigError(f"routing.classifier.embedding_head_path: {exc}") from exc
    try:
        static = load_static_head(classifier.static_head_path) if classifier.static_head_path else None
    except StaticHeadError as exc:
        raise ConfigError(f"routing.classifier.static_head_path: {exc}") from exc
    return Router.build(
        settings.routing,
        [PoolSpec(m.name, m.tier, tuple(m.fallback), m.capacity) for m in settings.models],
        fleet.by_model,
        rng=rng,
        clock=clock,
        metrics=metrics,
        head=head,
        static=static,
        bands=Bands.from_settings(settings.bands).limits,
    )


def adapters(settings: Settings, fleet: Fleet, proxy: Proxy, clock: Callable[[], float]) -> AdapterLoader:
    configured = [AdapterSpec(a.name, m.name, a.path) for m in settings.models for a in m.adapters]
    return AdapterLoader(
        AdapterCatalog(configured, fleet.by_model),
        fleet.by_model,
        lambda: proxy.client,
        timeout_s=settings.upstream.adapter_load_timeout_s,
        clock=clock,
    )


class PathParts:
    """What the stages are built from: the gateway's components and the settings' views."""

    def __init__(
        self,
        settings: Settings,
        *,
        fleet: Fleet,
        router: Router,
        limiter: Limiter,
        cache: ResponseCache,
        proxy: Proxy,
        pending: PendingTokens,
        routing_metrics: RoutingMetrics,
        responses: ResponseState,
        adapters: AdapterLoader,
        counter: PromptCounter,
        clock: Callable[[], float],
    ) -> None:
        self.parse = Parse(BodyLimits.from_settings(settings.server))
        self.classify = Classify(
            ModelRules.from_settings(settings), router, fleet, adapters.catalog, pending, cache, counter, clock
        )
        self.admit = Admit(limiter, clock)
        self.look_up_cache = LookUpCache(cache, settings.upstream, clock)
        self.load_adapter = LoadAdapter(adapters) if adapters.loads else None
        self.queue = Queue(QueueRules.from_settings(settings), router, fleet.tiers, routing_metrics, clock)
        self.forward = Forward(proxy)
        self.recall = responses
        self.clock = clock

    def paths(self, keyring: KeyRing, tenants: Mapping[str, TenantSettings]) -> dict[Dialect, tuple[Stage, ...]]:
        """Each API's path, top to bottom: the same for all but Responses, whose stored
        conversation is recalled before anything reads its prompt. Built with the tenants:
        their keys, and whether any uses the cache."""
        authenticate = Authenticate(keyring, tenants, self.clock)
        uses_cache = any(t.cache.enabled for t in tenants.values())
        return {
            dialect: (
                authenticate,
                self.parse,
                *((self.recall,) if dialect is RESPONSES_API else ()),
                self.classify,
                self.admit,
                *((self.look_up_cache,) if uses_cache else ()),
                *((self.load_adapter,) if self.load_adapter is not None else ()),
                self.queue,
                self.forward,
            )
            for dialect in DIALECTS
        }
