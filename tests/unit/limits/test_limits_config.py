"""Tenant limits from YAML: defaults, validation messages, plans and reservations."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from limits.config import DEFAULT_MAX_TOKENS, ScopeLimits, TenantLimits, reservation
from limits.plan import Scope, Subject, build_plan, escape

YAML = """
requests_per_minute: 600
tokens_per_minute: 120000
request_burst: 100
max_concurrent: 8
tokens_per_day: 1000000
on_store_failure: fail_closed
per_key:
  batch: {requests_per_minute: 60, max_concurrent: 2}
per_model:
  big-model: {tokens_per_minute: 30000, token_burst: 10000}
"""


def test_yaml_shape_parses() -> None:
    limits = TenantLimits.model_validate(yaml.safe_load(YAML))
    assert limits.requests_per_minute == 600
    assert limits.effective_request_burst == 100
    assert limits.effective_token_burst == 120000  # default burst: the per-minute limit
    assert limits.on_store_failure == "fail_closed"
    assert limits.per_key["batch"].max_concurrent == 2
    assert limits.per_model["big-model"].effective_token_burst == 10000
    assert limits.default_max_tokens == DEFAULT_MAX_TOKENS


def test_empty_means_unlimited() -> None:
    limits = TenantLimits()
    assert limits.is_unlimited
    assert limits.on_store_failure == "fail_open"
    assert build_plan(Subject("t"), limits, 500).empty


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"requests_per_minute": 0}, "requests_per_minute"),
        ({"tokens_per_day": -5}, "tokens_per_day"),
        ({"rpm": 10}, "rpm"),
        ({"on_store_failure": "fail_sideways"}, "on_store_failure"),
        ({"request_burst": 10}, "request_burst"),
        ({"per_key": {"k": {"max_concurrent": 0}}}, "max_concurrent"),
        ({"per_model": {"m": {"tokens_per_day": 5}}}, "tokens_per_day"),
    ],
)
def test_validation_errors_name_the_field(data: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        TenantLimits.model_validate(data)
    assert needle in str(info.value)


def test_frozen() -> None:
    with pytest.raises(ValidationError):
        TenantLimits().requests_per_minute = 5  # type: ignore[misc]


def test_reservation() -> None:
    limits = TenantLimits(default_max_tokens=512)
    assert reservation(100, 200, limits) == 300
    assert reservation(100, None, limits) == 100 + 512
    assert reservation(-3, None, limits) == 512
    # n choices may each use max_tokens; the prompt is counted once
    assert reservation(100, 200, limits, 8) == 100 + 8 * 200
    assert reservation(100, None, limits, 3) == 100 + 3 * 512


def test_plan_scopes_and_fields() -> None:
    limits = TenantLimits.model_validate(yaml.safe_load(YAML))
    plan = build_plan(Subject("acme", key_id="batch", model="big-model"), limits, 700)
    fields = [b.field for b in plan.buckets]
    assert fields == ["t|rpm", "t|tpm", "k:batch|rpm", "m:big-model|tpm"]
    assert [c.field for c in plan.caps] == ["t|c", "k:batch|c"]
    assert [plan.cost(b) for b in plan.buckets] == [1, 700, 1, 700]
    assert plan.tokens_per_day == 1_000_000 and plan.tokens_per_month is None
    assert plan.holds_lease and plan.needs_settle
    # 600 rpm with a burst of 100: one request per 0.1 s, 10 s of tolerance.
    rpm = plan.buckets[0]
    assert rpm.rate.interval == 0.1 and rpm.rate.tolerance == 100 * 0.1
    # An unknown key or model adds nothing.
    other = build_plan(Subject("acme", key_id="x", model="y"), limits, 700)
    assert [b.field for b in other.buckets] == ["t|rpm", "t|tpm"]


def test_rpm_only_plan_needs_no_settle() -> None:
    plan = build_plan(Subject("t"), TenantLimits(requests_per_minute=10), 100)
    assert not plan.holds_lease and not plan.needs_settle


def test_fallback_share_divides_rates_and_drops_quotas() -> None:
    limits = TenantLimits(
        requests_per_minute=600,
        tokens_per_minute=10_000,
        max_concurrent=9,
        tokens_per_day=50_000,
    )
    plan = build_plan(Subject("t"), limits, 4000, fallback_share=4)
    rpm, tpm = plan.buckets
    assert (rpm.limit, rpm.burst) == (150, 150)
    # 10000 / 4 = 2500 would refuse a 4000-token request the shared bucket admits.
    assert (tpm.limit, tpm.burst) == (2500, 4000)
    assert plan.caps[0].cap == 2  # 9 // 4
    assert plan.tokens_per_day is None
    tiny = build_plan(Subject("t"), TenantLimits(max_concurrent=2), 0, fallback_share=8)
    assert tiny.caps[0].cap == 1  # never zero


def test_escape_keeps_fields_unambiguous() -> None:
    assert escape("plain-key_1.2") == "plain-key_1.2"
    assert escape("a|rpm") == "a%7Crpm"
    assert escape("{x}:y,z;%") == "%7Bx%7D%3Ay%2Cz%3B%25"
    assert Scope("key", "a|rpm").field == "k:a%7Crpm"
    assert ScopeLimits(max_concurrent=1).is_unlimited is False
