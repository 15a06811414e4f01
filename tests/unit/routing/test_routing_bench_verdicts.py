"""How ``bench/routing_vllm.py`` orders its rows and judges them (pure parts, no engine)."""

from __future__ import annotations

import dataclasses

import pytest

from bench.routing_fleet import FleetSpec, gateway_config
from bench.routing_vllm import (
    MULTITURN,
    ROWS,
    RowResult,
    affinity_settings,
    gateway_extra,
    merge,
    row_order,
    verdicts,
)
from gateway.settings import Settings
from routing.config import AffinitySettings


def _row(row: str, seed: int, ttft_ms: float, hit: float = 0.9, requests: int = 10) -> RowResult:
    return RowResult(row, seed, hit, [hit] * 4, [ttft_ms / 1000] * requests, 0, {"r0": hit, "r1": hit}, 1.0)


def test_the_reference_brackets_the_gateway_rows_whose_order_alternates() -> None:
    assert row_order(ROWS, 0) == ["client_hash", "prefix_affinity", "prefix_affinity x2", "round_robin",
                                  "least_requests", "client_hash"]  # fmt: skip
    assert row_order(ROWS, 1) == ["client_hash", "least_requests", "round_robin", "prefix_affinity x2",
                                  "prefix_affinity", "client_hash"]  # fmt: skip
    assert row_order(("prefix_affinity", "round_robin"), 1) == ["round_robin", "prefix_affinity"]


def test_merged_runs_keep_every_request_and_average_the_hit_rates() -> None:
    merged = merge([_row("client_hash", 1, 80, hit=0.88), _row("client_hash", 1, 90, hit=0.90)])
    assert merged.runs == 2
    assert len(merged.ttft_s) == 20
    assert abs(merged.hit_rate - 0.89) < 1e-9
    assert all(abs(q - 0.89) < 1e-9 for q in merged.quarters)


def test_ttft_is_judged_over_every_set_not_one_set_at_a_time() -> None:
    # Set 1 alone would fail (120 against 100 ms), set 2 alone pass: over both, the p50 is 95 ms.
    results = [
        _row("client_hash", 1, 100),
        _row("prefix_affinity", 1, 120),
        _row("client_hash", 2, 100),
        _row("prefix_affinity", 2, 95),
    ]
    ttft = [v for v in verdicts(results) if "TTFT" in v[0]]
    assert len(ttft) == 1
    bar, _, measured, passed = ttft[0]
    assert bar == "all sets: prefix_affinity TTFT p50"
    assert measured.startswith("95 ms vs 100 ms")
    assert "per set 1.20, 0.95" in measured
    assert passed is True

    slow = [*results[:2], _row("client_hash", 2, 100), _row("prefix_affinity", 2, 130)]
    assert [v[3] for v in verdicts(slow) if "TTFT" in v[0]] == [False]


def test_affinity_settings_reach_the_gateway_rows_config_beside_the_policy() -> None:
    config = dataclasses.replace(MULTITURN, affinity=affinity_settings(["margin_requests=8", "hot_share=0.75"]))
    spec = FleetSpec(policy="prefix_affinity", replicas=2, extra=gateway_extra(config, ["http://127.0.0.1:9"]))
    settings = Settings.model_validate(gateway_config(spec, port=8080))
    assert settings.routing.policy == "prefix_affinity"
    assert settings.routing.affinity.margin_requests == 8
    assert settings.routing.affinity.hot_share == 0.75
    assert settings.routing.affinity.factor == AffinitySettings().factor  # the rest at their defaults
    assert "affinity" not in gateway_extra(MULTITURN, ["http://127.0.0.1:9"]).get("routing", {})


@pytest.mark.parametrize("setting", ["margin=8", "margin_requests", "margin_requests=-1", "hot_share=none"])
def test_an_unknown_or_invalid_affinity_setting_is_refused(setting: str) -> None:
    with pytest.raises(ValueError):
        affinity_settings([setting])


def test_the_events_rows_are_judged_against_the_estimate_the_hash_and_the_ideal() -> None:
    from bench.routing_vllm import events_verdicts

    rows = [
        _row("client_hash", 1, 80, hit=0.88),
        _row("prefix_affinity", 1, 80, hit=0.86),
        _row("infinite_cache", 1, 80, hit=0.89),
        _row("events", 1, 80, hit=0.875),
        dataclasses.replace(
            _row("events x2", 1, 80, hit=0.873), per_pod={"pod0": 0.87, "pod1": 0.88}, moved=3, split=1
        ),
    ]
    judged = {(bar, asks): passed for bar, asks, _, passed in events_verdicts(rows)}
    assert judged[("set 1: events hit rate", ">= prefix_affinity's")]
    assert not judged[("set 1: events hit rate", ">= client_hash's")]
    assert judged[("set 1: events hit rate", ">= infinite_cache's - 0.02")]
    assert judged[("set 1: events x2 against one pod", "hit rates within 0.005")]
    assert not judged[
        ("set 1: events x2 pod against pod", "hit rates within 0.005 (cached prompt tokens, vLLM's usage)")
    ]
    assert not judged[("set 1: events x2 split conversations", "0 (turns back on a replica they had left)")]


def test_a_conversation_that_goes_back_to_a_replica_it_left_is_split() -> None:
    from bench.routing_vllm import Answer, Played

    played = Played()
    for conversation, replicas in enumerate((["a", "a", "a"], ["a", "b", "b"], ["a", "b", "a"])):
        for where in replicas:
            played.served("http://gateway", Answer(0.1, "", where, 100, 90), conversation)
    assert played.moved_and_split() == (2, 1)
    assert played.tokens["http://gateway"] == [900, 810]
