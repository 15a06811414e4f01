"""How ``bench/routing_vllm.py`` orders its rows and judges them (pure parts, no engine)."""

from __future__ import annotations

from bench.routing_vllm import ROWS, RowResult, merge, row_order, verdicts


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
