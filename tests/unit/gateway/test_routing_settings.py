"""The routing keys of the configuration: defaults, environment override, validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings import ConfigError, load_settings
from routing.classifier import DEFAULT_TIERS

MODELS = """
models:
  - {name: small, tier: small, replicas: [{url: 'http://s'}]}
  - {name: large, tier: large, replicas: [{url: 'http://l'}], fallback: [small],
     capacity: {max_requests: 64, max_outstanding_tokens: 200000}}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    s = load_settings(None)
    assert s.routing.policy == "prefix_affinity"
    assert s.routing.tier_ranges() == DEFAULT_TIERS
    assert s.routing.capacity.max_requests == 256
    assert s.routing.capacity.max_prefill_tokens == 4096
    assert s.routing.queue.max_wait_s.for_priority("low") == 2.0
    tenant = s.tenants[0]
    assert (tenant.weight, tenant.priority, tenant.allow_force_tier) == (1.0, "normal", False)


def test_full_routing_block(tmp_path: Path) -> None:
    text = (
        MODELS
        + """
routing:
  policy: least_requests
  tiers: [{name: small, min_score: 0, max_score: 0.5}, {name: large, min_score: 0.5, max_score: 1}]
  affinity: {factor: 2, margin_requests: 0, anchor_blocks: 2, block_chars: 128, index_keys: 1000}
  retry_budget: {ratio: 0.1, min_per_s: 0.5, burst: 5}
  queue: {max_queue_length: 8, max_wait_s: {high: 5, normal: 3, low: 1}}
tenants:
  - id: a
    api_keys: ['env:A_KEY']
    weight: 3
    priority: high
    allow_force_tier: [large]
    classify_models: [large]
    degrade: {overflow: true, max_tokens: 256}
"""
    )
    s = load_settings(write(tmp_path, text))
    assert s.routing.policy == "least_requests"
    assert [t.name for t in s.routing.tiers] == ["small", "large"]
    assert s.models[1].fallback == ["small"] and s.models[1].capacity is not None
    assert s.models[1].capacity.max_outstanding_tokens == 200000
    t = s.tenants[0]
    assert (t.weight, t.priority, t.allow_force_tier, t.classify_models) == (3.0, "high", ["large"], ["large"])
    assert t.degrade.overflow and t.degrade.max_tokens == 256


def test_policy_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETGATE_ROUTING__POLICY", "round_robin")
    assert load_settings(write(tmp_path, MODELS)).routing.policy == "round_robin"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("routing: {policy: random}\n", "routing.policy"),
        ("routing: {tiers: [{name: a, min_score: 0, max_score: 0.5}]}\n", "routing"),
        (
            "routing: {tiers: [{name: a, min_score: 0, max_score: 0.4}, {name: b, min_score: 0.5, max_score: 1}]}\n",
            "routing",
        ),
        ("routing: {affinity: {factor: 0.5}}\n", "routing.affinity.factor"),
        ("routing: {queue: {max_wait_s: {normal: 0}}}\n", "routing.queue.max_wait_s.normal"),
        ("models: [{name: a, replicas: [{url: 'http://a'}], fallback: [a]}]\n", "models.0.fallback"),
        ("models: [{name: a, replicas: [{url: 'http://a'}], fallback: [nope]}]\n", "models.0.fallback"),
        ("models: [{name: a, replicas: [{url: 'http://a'}], capacity: {max_requests: 0}}]\n", "capacity"),
        ("tenants: [{id: a, api_keys: ['env:K'], weight: 0}]\n", "tenants.0.weight"),
        ("tenants: [{id: a, api_keys: ['env:K'], priority: urgent}]\n", "tenants.0.priority"),
        ("tenants: [{id: a, api_keys: ['env:K'], allow_force_tier: [huge]}]\n", "tenants.0.allow_force_tier"),
        ("tenants: [{id: a, api_keys: ['env:K'], classify_models: [nope]}]\n", "tenants.0.classify_models"),
    ],
)
def test_invalid_routing_config_names_the_key(tmp_path: Path, text: str, where: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, text))
    assert where in str(info.value)
