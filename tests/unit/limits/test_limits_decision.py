"""Decisions: messages that name the limit, OpenAI headers and error fields."""

from __future__ import annotations

import pytest

from limits.config import ScopeLimits, TenantLimits
from limits.decision import Outcome, RateView, Reason, decide, format_duration, unavailable
from limits.plan import Subject, build_plan

LIMITS = TenantLimits(
    requests_per_minute=600,
    tokens_per_minute=10_000,
    max_concurrent=4,
    tokens_per_day=100_000,
    tokens_per_month=2_000_000,
    per_key={"k1": ScopeLimits(requests_per_minute=60)},
    per_model={"m1": ScopeLimits(max_concurrent=2)},
)
PLAN = build_plan(Subject("acme", key_id="k1", model="m1"), LIMITS, 1200)
NOW = 1_741_996_800.0  # 2025-03-15T00:00:00Z


def outcome(failed: str = "", retry: float = 0.0) -> Outcome:
    return Outcome(
        allowed=not failed,
        failed=failed,
        retry_after_s=retry,
        requests=RateView("k:k1|rpm", 7, 3.25),
        tokens=RateView("t|tpm", 8800, 7.2),
        now=NOW,
    )


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.0201, "21ms"), (1, "1s"), (8.64, "8.64s"), (360, "6m0s"), (3723.5, "1h2m3.5s")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_allowed_headers_use_the_most_constraining_bucket() -> None:
    d = decide(PLAN, outcome(), None)
    assert d.allowed and d.status == 200 and d.error_type is None
    assert d.headers() == {
        "x-ratelimit-limit-requests": "60",  # the key's bucket had fewer left
        "x-ratelimit-remaining-requests": "7",
        "x-ratelimit-reset-requests": "3.25s",
        "x-ratelimit-limit-tokens": "10000",
        "x-ratelimit-remaining-tokens": "8800",
        "x-ratelimit-reset-tokens": "7.2s",
    }


def test_requests_per_minute_rejection() -> None:
    d = decide(PLAN, outcome("t|rpm", 0.1), None)
    assert (d.allowed, d.status, d.reason) == (False, 429, Reason.REQUESTS_PER_MINUTE)
    assert d.message == "Rate limit reached for requests per minute (limit 600). Retry after 0.1 s."
    assert d.error_code == "rate_limit_exceeded" and d.error_type == "requests"
    assert d.headers()["retry-after"] == "1" and d.headers()["retry-after-ms"] == "100"


def test_key_and_model_scopes_are_named() -> None:
    d = decide(PLAN, outcome("k:k1|rpm", 2.5), None)
    assert d.message == ("Rate limit reached for requests per minute for this API key (limit 60). Retry after 2.5 s.")
    d = decide(PLAN, outcome("m:m1|c"), None, concurrency_retry_s=1.0)
    assert d.reason is Reason.CONCURRENCY
    assert d.message == "Too many concurrent requests for model 'm1' (limit 2). Retry after 1 s."


def test_tokens_rejections() -> None:
    d = decide(PLAN, outcome("t|tpm", 4.0), None)
    assert d.reason is Reason.TOKENS_PER_MINUTE and d.error_type == "tokens"
    assert "tokens per minute (limit 10000, requested 1200)" in d.message
    too_big = decide(PLAN, outcome("t|tpm", -1.0), None)
    assert too_big.message.startswith("Request too large for tokens per minute")
    assert too_big.retry_after_s == 0.0 and "retry-after" not in too_big.headers()


def test_quota_rejections_are_insufficient_quota() -> None:
    d = decide(PLAN, outcome("q|d", 86_400.0), None)
    assert d.reason is Reason.TOKENS_PER_DAY
    assert d.error_code == "insufficient_quota" and d.error_type == "insufficient_quota"
    assert d.status == 429
    assert d.message == (
        "You exceeded your daily token quota (limit 100000 tokens; this request reserves "
        "1200). The quota resets at 2025-03-16T00:00:00Z."
    )
    m = decide(PLAN, outcome("q|m", 100.0), None)
    assert m.reason is Reason.TOKENS_PER_MONTH and "resets at 2025-04-01T00:00:00Z" in m.message


def test_store_unavailable_is_503() -> None:
    d = unavailable()
    assert d.status == 503 and d.reason is Reason.STORE_UNAVAILABLE
    assert d.error_type == "server_error" and d.error_code == "service_unavailable"


def test_unknown_failed_field_is_a_bug() -> None:
    with pytest.raises(ValueError, match="unknown failed check"):
        decide(PLAN, outcome("zz|rpm", 1.0), None)
