"""How ``bench/allocator.py`` pairs its four gateways and reads their runs (pure part, no gateway)."""

from __future__ import annotations

import math
from pathlib import Path

from bench.allocator import Measured, _history, latency_ratios, matches, ratios, report, spread
from bench.machine import spare_share
from bench.shared_core import Shared, pairings


def test_pairings_are_every_pair_in_both_orders() -> None:
    assert pairings(("a", "b"), ("x",)) == [("a", "x"), ("x", "a"), ("b", "x"), ("x", "b")]


def test_a_round_is_every_malloc_with_every_pymalloc_then_the_twins() -> None:
    got = matches()
    assert len(got) == 2 * 2 * 2 + 2 + 2
    assert len(set(got)) == len(got)
    assert got[:2] == [("malloc", "pymalloc"), ("pymalloc", "malloc")]
    assert got[-4:] == [
        ("malloc", "malloc2"),
        ("malloc2", "malloc"),
        ("pymalloc", "pymalloc2"),
        ("pymalloc2", "pymalloc"),
    ]


def _runs(rps: dict[str, float], rounds: int) -> dict[str, list[Shared]]:
    return {
        f"{a}/{b}": [Shared((rps[a], rps[b]), (1e6 / rps[a], 1e6 / rps[b]), (0.0, 0.3), 0)] * rounds
        for a, b in matches()
    }


def test_ratios_average_a_faster_process_of_each_kind() -> None:
    # malloc truly serves 0.98 of pymalloc; `malloc2` and `pymalloc2` run 4% faster than their twins.
    rps = {"malloc": 980.0, "malloc2": 980.0 * 1.04, "pymalloc": 1000.0, "pymalloc2": 1040.0}
    got = ratios(_runs(rps, 3))
    assert len(got["malloc/pymalloc"]["rate"]) == 3
    # (0.98 * 0.98/1.04 * 0.98*1.04 * 0.98) ** (1/4) per direction: the 4% cancels.
    assert math.isclose(got["malloc/pymalloc"]["rate"][0], 0.98)
    assert math.isclose(got["malloc/pymalloc"]["cpu"][0], 1 / 0.98)
    assert math.isclose(got["malloc/malloc2"]["rate"][0], 1 / 1.04)
    assert math.isclose(got["pymalloc/pymalloc2"]["rate"][0], 1 / 1.04)


def test_latency_ratio_is_geometric_mean_of_each_kind() -> None:
    p50 = {"malloc": [0.50, 0.40], "malloc2": [0.32, 0.40], "pymalloc": [0.40, 0.40], "pymalloc2": [0.40, 0.40]}
    got = latency_ratios(p50)
    assert math.isclose(got[0], math.sqrt(0.50 * 0.32) / 0.40)  # 0.4 / 0.4
    assert math.isclose(got[1], 1.0)


def test_spread_is_median_min_max() -> None:
    assert spread([1.02, 0.97, 1.10, 1.00]) == (1.01, 0.97, 1.10)


def test_spare_share_counts_the_jiffies_between_readings() -> None:
    assert spare_share((100, 50), (130, 60)) == 10 / 40
    assert spare_share((100, 50), (100, 50)) == 0.0


def test_the_history_paragraph_survives_a_rerun(tmp_path: Path) -> None:
    out = tmp_path / "allocator.md"
    assert _history(out) == ""
    out.write_text("# title\n\nWhy: it exists\nbecause.\n\nCommand: old\n")
    assert _history(out) == "Why: it exists\nbecause."
    rps = {"malloc": 980.0, "malloc2": 1000.0, "pymalloc": 1000.0, "pymalloc2": 1000.0}
    measured = Measured(
        "2026-11-27 09:00 UTC",
        9.0,
        4,
        2,
        16,
        "2 cores (test)",
        (1.0, 1.0, 1.0),
        (2.0, 1.0, 1.0),
        _runs(rps, 2),
        _runs(rps, 2),
        {name: [0.4, 0.4] for name in rps},
    )
    text = report(measured, _history(out))
    assert "Why: it exists\nbecause.\n\nCommand:" in text
    assert "| malloc/pymalloc req/s | 0.990 | 0.990-0.990 | 0.990, 0.990 |" in text
    assert "## Streams" in text
