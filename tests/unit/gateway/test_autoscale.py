"""The autoscaling signal: pending tokens and Little's law."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gateway.autoscale import AutoscaleCollector, PendingTokens, desired_replicas


def test_desired_replicas_is_the_ceiling_of_pending_over_target() -> None:
    # A replica sustaining 4,000 tokens/s within an 8 s latency holds 4,000 * 8 = 32,000 tokens.
    target = 4_000 * 8
    assert desired_replicas(0, target) == 1  # never zero by itself
    assert desired_replicas(32_000, target) == 1
    assert desired_replicas(32_001, target) == 2
    # 100 requests of 1,000 prompt + 500 generated tokens pending: 150,000 / 32,000 -> 5.
    assert desired_replicas(100 * 1_500, target) == 5
    assert desired_replicas(-5, target, minimum=0) == 0
    with pytest.raises(ValueError):
        desired_replicas(1, 0)


def test_collector_reports_pending_and_desired_per_model() -> None:
    pending = PendingTokens(["small", "large"])
    pending.add("small", 50_000)
    pending.add("small", 20_000)
    pending.remove("small", 5_000)
    registry = CollectorRegistry()
    registry.register(AutoscaleCollector(pending, {"small": 32_000, "large": 10_000}.__getitem__))
    text = generate_latest(registry).decode()
    assert 'fleetgate_pending_tokens{model="small"} 65000.0' in text
    assert 'fleetgate_desired_replicas{model="small"} 3.0' in text  # ceil(65,000 / 32,000)
    assert 'fleetgate_pending_tokens{model="large"} 0.0' in text
    assert 'fleetgate_desired_replicas{model="large"} 1.0' in text
    assert 'fleetgate_autoscaling_target_pending_tokens{model="large"} 10000.0' in text


def test_settings_validate_the_target_and_the_admin_port() -> None:
    from pydantic import ValidationError

    from gateway.settings import Settings

    models = [{"name": "m", "replicas": [{"url": "http://127.0.0.1:1"}]}]
    settings = Settings(models=models, autoscaling={"target_pending_tokens": 1000, "per_model": {"m": 500}})
    assert settings.autoscaling.target("m") == 500 and settings.autoscaling.target("other") == 1000
    with pytest.raises(ValidationError, match="not configured models"):
        Settings(models=models, autoscaling={"per_model": {"nope": 500}})
    with pytest.raises(ValidationError):
        Settings(models=models, autoscaling={"per_model": {"m": 0}})
    with pytest.raises(ValidationError, match="admin_port must differ from port"):
        Settings(models=models, server={"port": 8080, "admin_port": 8080})
