"""Cache settings: a tenant's ``cache:`` block, and the process-wide ``cache:`` block.

Per tenant (``tenants[].cache``)::

    cache:
      enabled: true                 # the exact cache (deterministic requests only, see below)
      ttl_s: 3600                   # an entry lives this long after it was stored
      max_entries: 10000            # least recently used entries are evicted past this
      max_entry_bytes: 262144       # larger answers are not stored
      cache_nondeterministic: false # also cache temperature > 0 without a seed
      hits_count_tokens: false      # a hit charges the tenant's token rate (requests always count)
      semantic:
        enabled: false

Process-wide (top-level ``cache:``)::

    cache:
      lookup_timeout_ms: 30
      store_timeout_ms: 200
      breaker_failures: 3
      breaker_cooldown_s: 2.0
      coalesce: true
      coalesce_max_wait_s: 300
      coalesce_linger_s: 1.0
      semantic:                     # the semantic cache's runtime (on for the tenants that enable it)
        model_dir: null             # a sentence-transformers model; default: all-MiniLM-L6-v2 (package)
                                    # with its layers fine-tuned on question pairs (shipped)
        verifier_path: null         # verifier parameters trained for that model; default: shipped
        threshold: null             # the verifier's score threshold; default: the trained one
        embed_timeout_ms: 100       # a lookup whose text is not embedded by then is a miss
        max_pending: 64             # texts queued or being embedded; past it, lookups skip
        max_text_chars: 1000        # longer texts are not matched by meaning
        batch_size: 64
        batch_wait_ms: 1.5
        stream_max_len: 10000       # Redis: events kept for other processes to catch up
        sync_block_ms: 1000         # Redis: longest blocking read of the event stream
        load_timeout_s: 30          # Redis: start-up waits this long for the initial load

Only deterministic requests are cached by default (temperature 0, or a fixed seed): replaying
a sampled answer to a client that asked for sampling would silently turn variety into
repetition, so that is an explicit per-tenant choice (``cache_nondeterministic``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

# One hour: long enough to absorb retries, batch re-runs and popular prompts, short enough
# that an answer from a replaced model version does not outlive the rollout by much.
DEFAULT_TTL_S = 3600.0
# Entries per tenant. At the default entry bound this caps a tenant at ~2.5 GiB in the worst
# case and a few tens of MB in practice (a typical answer is a few KB).
DEFAULT_MAX_ENTRIES = 10_000
# 256 KiB of JSON is ~60k tokens of text: longer answers are rare and costly to keep.
DEFAULT_MAX_ENTRY_BYTES = 256 * 1024

# A lookup sits on every cacheable request's path: Redis on the same LAN answers in well
# under a millisecond, so 30 ms means "Redis is in trouble" and the request goes on uncached.
DEFAULT_LOOKUP_TIMEOUT_MS = 30.0
# Stores run after the response was sent; they may wait longer, but not forever.
DEFAULT_STORE_TIMEOUT_MS = 200.0
# A follower never waits longer than this for the leader, whatever its own deadline.
DEFAULT_COALESCE_MAX_WAIT_S = 300.0
# After the leader published, its answer stays joinable this long, covering the gap between
# a request's (missed) lookup and the store finishing, which would otherwise start a second
# upstream request. Must exceed lookup + store timeouts.
DEFAULT_COALESCE_LINGER_S = 1.0


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SemanticCacheSettings(_Frozen):
    """The semantic cache of one tenant (thresholds and guards live with its implementation).

    It answers only requests the exact cache may answer (``enabled`` and the same rules),
    and finds the answers through the exact cache's entries.
    """

    enabled: bool = False


# A lone text costs ~5-9 ms on one thread, a batch of 32 ~80-150 ms: 100 ms lets an idle or
# moderately busy embedder answer and turns a backlog into a quick miss instead of a wait.
DEFAULT_EMBED_TIMEOUT_MS = 100.0
# At ~2.5-5 ms per text in a batch, 64 queued texts already take ~160-320 ms, past the embed
# timeout: more would only be embedded for lookups that have given up.
DEFAULT_MAX_PENDING = 64
# all-MiniLM-L6-v2 reads at most 256 word pieces (~1,000 characters of English) and ignores
# the rest: two long prompts that differ only past that point would embed identically. The
# verifier was also trained on questions, not documents.
DEFAULT_MAX_TEXT_CHARS = 1000
# Events kept in the Redis stream: a process that falls further behind reloads everything.
DEFAULT_STREAM_MAX_LEN = 10_000


# Settings the semantic cache no longer has, each with what replaced it. The embedding model
# runs in float32 on ONNX Runtime, always (cache.semantic.embedder): a config that still
# asks for another precision or runtime is refused at load rather than silently run in a
# way it did not ask for.
REMOVED_SEMANTIC_SETTINGS = {
    "precision": "the embedding model always computes in float32",
    "runtime": "the embedding model always runs on ONNX Runtime",
}


class SemanticServiceSettings(_Frozen):
    """Process-wide semantic cache runtime (``cache.semantic.cache``); tenants opt in one by one.

    Nothing here loads a model: the embedder starts only when a tenant enables the
    semantic cache (``tenants[].cache.semantic.enabled``).
    """

    model_dir: str | None = None
    verifier_path: str | None = None
    threshold: float | None = Field(None, ge=0, le=1)
    embed_timeout_ms: float = Field(DEFAULT_EMBED_TIMEOUT_MS, gt=0, le=60_000)
    max_pending: int = Field(DEFAULT_MAX_PENDING, ge=1)
    max_text_chars: int = Field(DEFAULT_MAX_TEXT_CHARS, ge=1)
    batch_size: int = Field(64, ge=1, le=4096)
    batch_wait_ms: float = Field(1.5, ge=0, le=1000)
    stream_max_len: int = Field(DEFAULT_STREAM_MAX_LEN, ge=100)
    sync_block_ms: int = Field(1000, ge=10, le=60_000)
    load_timeout_s: float = Field(30.0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _refuse_removed_settings(cls, data: Any) -> Any:
        removed = [name for name in REMOVED_SEMANTIC_SETTINGS if isinstance(data, dict) and name in data]
        if removed:
            raise ValueError(
                "; ".join(f"'{name}' was removed: {REMOVED_SEMANTIC_SETTINGS[name]}" for name in removed)
                + f" (docs/configuration.md); delete {' and '.join(repr(name) for name in removed)} from cache.semantic"
            )
        return data

    @property
    def embed_timeout_s(self) -> float:
        return self.embed_timeout_ms / 1000


class CacheSettings(_Frozen):
    """The ``cache:`` block of one tenant."""

    enabled: bool = True
    ttl_s: float = Field(DEFAULT_TTL_S, gt=0)
    max_entries: int = Field(DEFAULT_MAX_ENTRIES, gt=0)
    max_entry_bytes: int = Field(DEFAULT_MAX_ENTRY_BYTES, gt=0)
    cache_nondeterministic: bool = False
    hits_count_tokens: bool = False
    semantic: SemanticCacheSettings = SemanticCacheSettings()


class CacheServiceSettings(_Frozen):
    """Process-wide cache behaviour (top-level ``cache:``); the store is ``redis_url``'s."""

    lookup_timeout_ms: float = Field(DEFAULT_LOOKUP_TIMEOUT_MS, gt=0, le=10_000)
    store_timeout_ms: float = Field(DEFAULT_STORE_TIMEOUT_MS, gt=0, le=60_000)
    # Consecutive store failures that stop all cache traffic to Redis for the cool-down.
    breaker_failures: int = Field(3, ge=1)
    breaker_cooldown_s: float = Field(2.0, gt=0)
    coalesce: bool = True
    coalesce_max_wait_s: float = Field(DEFAULT_COALESCE_MAX_WAIT_S, gt=0)
    coalesce_linger_s: float = Field(DEFAULT_COALESCE_LINGER_S, ge=0)
    semantic: SemanticServiceSettings = SemanticServiceSettings()

    @property
    def lookup_timeout_s(self) -> float:
        return self.lookup_timeout_ms / 1000

    @property
    def store_timeout_s(self) -> float:
        return self.store_timeout_ms / 1000
