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

Only deterministic requests are cached by default (temperature 0, or a fixed seed): replaying
a sampled answer to a client that asked for sampling would silently turn variety into
repetition, so that is an explicit per-tenant choice (``cache_nondeterministic``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

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
    """The semantic cache of one tenant (thresholds and guards live with its implementation)."""

    enabled: bool = False


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

    @property
    def lookup_timeout_s(self) -> float:
        return self.lookup_timeout_ms / 1000

    @property
    def store_timeout_s(self) -> float:
        return self.store_timeout_ms / 1000
