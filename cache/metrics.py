"""Prometheus metrics of the response caches, all prefixed ``fleetgate_cache_``.

Label values come from fixed sets: ``kind`` is ``exact`` or ``semantic``, ``result`` and
``reason`` the values listed on each metric (``reason`` is a ``cache.keys.Cacheability``).
No tenant label: per-tenant cache traffic follows from the gateway's request metrics and the
``x-fleetgate-cache`` header in the access log. Metrics live on the registry passed in
(the gateway's own), never implicitly on the process-wide one, so several gateways can share
a test process.

Semantic lookups embed the text first, so their latency has its own, longer buckets in the
same histogram (``kind="semantic"``); the embedder's own cost is in
``fleetgate_cache_embed_seconds`` and its batching in ``fleetgate_cache_embed_batches_total``
/ ``fleetgate_cache_embed_texts_total`` (mean batch size = the ratio of their rates) and in
``fleetgate_cache_embed_batch_size``, the distribution behind that mean (a lone text costs
the model two to three times as much as a text in a batch of 32: many batches of one under
load mean lookups arrive too far apart to share the model).

The hit ratio is exported for convenience over the process's lifetime; dashboards should
use rates: ``sum(rate(fleetgate_cache_lookups_total{result="hit"}[5m])) /
sum(rate(fleetgate_cache_lookups_total[5m]))``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from common.metrics import MetricSet

KINDS = ("exact", "semantic")
LOOKUP_RESULTS = ("hit", "miss", "timeout", "unavailable", "error")
# A memory lookup takes microseconds, a Redis one a fraction of a millisecond; the buckets
# stretch to the lookup timeout and a bit beyond, so slow calls show before they fail.
# A semantic lookup embeds its text (~13 ms alone, more when queued behind a batch), so the
# top buckets reach past its embed timeout.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
EMBED_BUCKETS = (0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
# Texts per embedder batch: powers of two up to the default batch_size (64).
EMBED_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Why a semantic lookup found no answer, or which rule made it a hit (SemanticVerifier's
# reasons, plus answer_gone: the verified entry's answer had expired or been evicted).
SEMANTIC_VERDICTS = ("verified", "same_words", "below_cosine_floor", "low_score", "no_candidate", "answer_gone")
SYNC_EVENTS = ("applied", "reload", "gap", "error")


class EmbedderStatsCollector(Collector):
    """Batches and texts an embedder has run, read from its ``stats`` when scraped."""

    def __init__(self, stats: Callable[[], tuple[int, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        batches, texts = self._stats()
        yield CounterMetricFamily("fleetgate_cache_embed_batches", "Batches the embedder ran.", value=batches)
        yield CounterMetricFamily("fleetgate_cache_embed_texts", "Texts the embedder embedded.", value=texts)


class CacheMetrics(MetricSet):
    """The counters, histogram and gauges the cache service updates."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        r = self.registry
        self.lookups = Counter(
            "fleetgate_cache_lookups_total",
            "Cache lookups by kind and result (hit, miss, timeout, unavailable, error).",
            ["kind", "result"],
            registry=r,
        )
        self.lookup_latency = Histogram(
            "fleetgate_cache_lookup_seconds",
            "Time spent in cache lookups, by kind.",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.stores = Counter(
            "fleetgate_cache_stores_total",
            "Answers offered to the cache, by kind and result (stored, too_large, timeout, unavailable, error).",
            ["kind", "result"],
            registry=r,
        )
        self.evictions = Counter(
            "fleetgate_cache_evictions_total",
            "Live entries evicted to keep a tenant within max_entries.",
            ["kind"],
            registry=r,
        )
        self.entries = Gauge(
            "fleetgate_cache_entries",
            "Entries held in this process (memory store only; Redis entries are not counted here).",
            ["kind"],
            registry=r,
        )
        self.bypass = Counter(
            "fleetgate_cache_bypass_total",
            "Requests that did not use the cache, by reason (nondeterministic, no_cache, disabled, ...).",
            ["reason"],
            registry=r,
        )
        self.coalesced = Counter(
            "fleetgate_cache_coalesced_total",
            "Requests that waited on an identical in-flight request, by outcome (hit, handoff, solo, timeout).",
            ["result"],
            registry=r,
        )
        self.degraded = Gauge(
            "fleetgate_cache_store_degraded",
            "1 while the shared cache store is bypassed (circuit breaker open or probing).",
            registry=r,
        )
        self.hit_ratio = Gauge(
            "fleetgate_cache_hit_ratio",
            "Hits over lookups since the process started, by kind (use rates for dashboards).",
            ["kind"],
            registry=r,
        )
        self.embed_latency = Histogram(
            "fleetgate_cache_embed_seconds",
            "Time from asking for an embedding to getting it (queueing and batching included).",
            buckets=EMBED_BUCKETS,
            registry=r,
        )
        self.embed_batch_size = Histogram(
            "fleetgate_cache_embed_batch_size",
            "Texts per batch the embedding model ran (concurrent lookups share a batch).",
            buckets=EMBED_BATCH_BUCKETS,
            registry=r,
        )
        self.embed_pending = Gauge(
            "fleetgate_cache_embed_pending",
            "Texts waiting for or being embedded (lookups skip the semantic cache past max_pending).",
            registry=r,
        )
        self.semantic_verdicts = Counter(
            "fleetgate_cache_semantic_verdicts_total",
            "Semantic lookups that reached the verifier, by its reason (verified, same_words, low_score, ...).",
            ["reason"],
            registry=r,
        )
        self.semantic_sync = Counter(
            "fleetgate_cache_semantic_sync_total",
            "Shared semantic index: events applied, full reloads, sequence gaps found, errors.",
            ["event"],
            registry=r,
        )
        # Plain tallies for the ratio: reading the counters back would re-enter the registry
        # while it is being collected.
        self._hits = dict.fromkeys(KINDS, 0)
        self._total = dict.fromkeys(KINDS, 0)
        for kind in KINDS:
            self.hit_ratio.labels(kind).set_function(self._ratio(kind))
        self._embedder_stats: EmbedderStatsCollector | None = None

    def bypassed(self, reason: str) -> Any:
        """The bypass counter of ``reason`` (a fixed set)."""
        return self.series(self.bypass, reason)

    def record_lookup(self, kind: str, result: str, seconds: float) -> None:
        """One lookup of ``kind`` ended with ``result`` (one of ``LOOKUP_RESULTS``) after ``seconds``."""
        self.series(self.lookups, kind, result).inc()
        self.series(self.lookup_latency, kind).observe(seconds)
        self._total[kind] = self._total.get(kind, 0) + 1
        if result == "hit":
            self._hits[kind] = self._hits.get(kind, 0) + 1

    def watch_embedder(self, stats: Callable[[], tuple[int, int]]) -> None:
        """Export an embedder's batch and text counts (once per registry)."""
        if self._embedder_stats is None:
            self._embedder_stats = EmbedderStatsCollector(stats)
            self.registry.register(self._embedder_stats)

    def record_embed_batch(self, texts: int) -> None:
        """The embedder ran a batch of ``texts`` texts (its per-batch callback)."""
        self.embed_batch_size.observe(texts)

    def _ratio(self, kind: str) -> Callable[[], float]:
        def ratio() -> float:
            total = self._total[kind]
            return self._hits[kind] / total if total else 0.0

        return ratio
