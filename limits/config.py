"""Per-tenant limits as written under ``tenants[].limits`` in the YAML.

Every field is optional; an absent field means "no limit of that kind". Bursts default to
the per-minute limit itself (see ``docs/limits.md``): a bucket that holds one minute of
rate keeps OpenAI's header semantics (``x-ratelimit-remaining-requests`` starts at the
limit) and lets any single request up to the TPM limit through, which a smaller token
burst would turn into "request too large" errors. Operators who want smoother traffic set
``request_burst`` lower, e.g. to ten seconds of rate.

Example::

    limits:
      requests_per_minute: 600
      tokens_per_minute: 200000
      request_burst: 100          # optional, default: requests_per_minute
      max_concurrent: 32
      tokens_per_day: 20000000
      tokens_per_month: 400000000
      on_store_failure: fail_open  # or fail_closed (503 while Redis is unreachable)
      default_max_tokens: 1024     # reserved when a request sends no max_tokens
      per_key:
        batch-key: {requests_per_minute: 60, max_concurrent: 4}
      per_model:
        llama-70b: {tokens_per_minute: 50000}
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

FailPolicy = Literal["fail_open", "fail_closed"]

# Reserved for a request that sends no max_tokens. Large enough for a typical chat answer,
# small enough that one client without max_tokens does not pin a whole TPM bucket.
DEFAULT_MAX_TOKENS = 1024


class ScopeLimits(BaseModel):
    """Rate and concurrency limits of one scope (a tenant, one of its keys, or a model)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    requests_per_minute: int | None = Field(None, gt=0)
    tokens_per_minute: int | None = Field(None, gt=0)
    request_burst: int | None = Field(None, gt=0)
    token_burst: int | None = Field(None, gt=0)
    max_concurrent: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _burst_needs_rate(self) -> ScopeLimits:
        # A burst alone would silently do nothing; say so at load time.
        if self.request_burst is not None and self.requests_per_minute is None:
            raise ValueError("request_burst is set but requests_per_minute is not")
        if self.token_burst is not None and self.tokens_per_minute is None:
            raise ValueError("token_burst is set but tokens_per_minute is not")
        return self

    @property
    def effective_request_burst(self) -> int | None:
        """Bucket capacity in requests (None: no request rate limit)."""
        if self.requests_per_minute is None:
            return None
        return self.request_burst or self.requests_per_minute

    @property
    def effective_token_burst(self) -> int | None:
        """Bucket capacity in tokens (None: no token rate limit)."""
        if self.tokens_per_minute is None:
            return None
        return self.token_burst or self.tokens_per_minute

    @property
    def is_unlimited(self) -> bool:
        return self.requests_per_minute is None and self.tokens_per_minute is None and self.max_concurrent is None


class TenantLimits(ScopeLimits):
    """A tenant's limits: its own scope, quotas, failure policy and per key/model overrides.

    ``per_key`` is keyed by the key id the gateway passes in ``Subject.key_id``;
    ``per_model`` by the model name the client asked for. Overrides add limits: a request
    must pass the tenant's limits *and* those of its key and model.
    """

    tokens_per_day: int | None = Field(None, gt=0)
    tokens_per_month: int | None = Field(None, gt=0)
    on_store_failure: FailPolicy = "fail_open"
    default_max_tokens: int = Field(DEFAULT_MAX_TOKENS, gt=0)
    per_key: dict[str, ScopeLimits] = Field(default_factory=dict)
    per_model: dict[str, ScopeLimits] = Field(default_factory=dict)

    @property
    def is_unlimited(self) -> bool:
        return (
            super().is_unlimited
            and self.tokens_per_day is None
            and self.tokens_per_month is None
            and all(s.is_unlimited for s in self.per_key.values())
            and all(s.is_unlimited for s in self.per_model.values())
        )


def reservation(prompt_tokens: int, max_tokens: int | None, limits: TenantLimits, choices: int = 1) -> int:
    """Tokens to reserve at admission: the prompt estimate plus what the answer may use.

    ``choices`` is the request's ``n``: each choice may generate up to ``max_tokens``, and
    the prompt is counted once (the replica's usage reports it once). The reservation is
    settled to the real usage when the response ends, so erring high only delays other
    requests briefly; erring low could overrun a quota.
    """
    completion = max_tokens if max_tokens is not None else limits.default_max_tokens
    return max(0, prompt_tokens) + max(0, completion) * max(1, choices)
