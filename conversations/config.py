"""Settings of the response store: the top-level ``responses:`` block.

::

    responses:
      ttl_s: 2592000                # a stored response lives this long (30 days)
      max_bytes_per_tenant: 67108864   # 64 MiB of records per tenant; the oldest go first past it
      max_record_bytes: 16777216    # 16 MiB: a larger record (response + full input) is not kept
      redis_timeout_ms: 500         # every Redis call; slower is a failure (503 for that request)
      breaker_failures: 3
      breaker_cooldown_s: 2.0

The store is Redis when ``redis_url`` is set (shared by every gateway pod, so a follow-up
turn or a ``GET /v1/responses/{id}`` may land on any pod), otherwise this process's memory.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

# OpenAI keeps a stored response for 30 days by default
# (https://platform.openai.com/docs/guides/your-data); clients written against it expect
# a previous_response_id to work for that long.
DEFAULT_TTL_S = 30 * 24 * 3600.0
# Per tenant. A record holds a response and the whole conversation before it, so a long
# agent session reaches hundreds of KB; 64 MiB keeps a few hundred such sessions and caps
# what one tenant can make the shared Redis hold.
DEFAULT_MAX_BYTES_PER_TENANT = 64 * 1024 * 1024
# One record: a quarter of the tenant bound, so a single huge conversation (inline images,
# files as base64) cannot flush most of a tenant's other conversations on its own.
DEFAULT_MAX_RECORD_BYTES = 16 * 1024 * 1024
# Reads sit on the request path (previous_response_id, GET) and a stored response cannot
# be skipped like a cache entry, so waiting a little is better than failing; but a Redis on
# the same LAN moves even a multi-MB record in a few ms, so half a second means trouble.
DEFAULT_REDIS_TIMEOUT_MS = 500.0


class ResponsesSettings(BaseModel):
    """The top-level ``responses:`` block: how long and how much the gateway keeps."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # A stored response (and the input that produced it) is kept this long after it was stored.
    ttl_s: float = Field(DEFAULT_TTL_S, gt=0)
    # The sizes of one tenant's live records summed; storing past it evicts that tenant's oldest.
    max_bytes_per_tenant: int = Field(DEFAULT_MAX_BYTES_PER_TENANT, gt=0)
    # A larger record is not stored (the caller checks it before ``put``; the store only
    # knows the tenant bound).
    max_record_bytes: int = Field(DEFAULT_MAX_RECORD_BYTES, gt=0)
    # The deadline of every Redis call: connecting, waiting for a pooled connection, the reply.
    redis_timeout_ms: float = Field(DEFAULT_REDIS_TIMEOUT_MS, gt=0, le=60_000)
    # Consecutive Redis failures that stop all store traffic to Redis for the cool-down.
    breaker_failures: int = Field(3, ge=1)
    # Then one trial call; its success restores the store.
    breaker_cooldown_s: float = Field(2.0, gt=0)

    @model_validator(mode="after")
    def _record_fits_the_bound(self) -> ResponsesSettings:
        if self.max_record_bytes > self.max_bytes_per_tenant:
            raise ValueError(
                f"max_record_bytes ({self.max_record_bytes}) exceeds max_bytes_per_tenant "
                f"({self.max_bytes_per_tenant}): such a record could never be stored"
            )
        return self

    @property
    def redis_timeout_s(self) -> float:
        return self.redis_timeout_ms / 1000
