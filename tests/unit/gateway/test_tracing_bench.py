"""How bench/shared_core.py combines the shared-core pairs of ``bench/tracing_overhead.py`` (pure part, no gateway)."""

from __future__ import annotations

import math

from bench.shared_core import Shared, geometric_ratios


def _pair(first_rps: float, second_rps: float) -> Shared:
    return Shared((first_rps, second_rps), (1e6 / first_rps, 1e6 / second_rps), (0.0, 0.5), 0)


def test_a_gain_of_the_first_of_a_pair_cancels_over_both_orders() -> None:
    # `on` truly serves 0.9 of `off`; whichever is listed first gains 4%.
    pairs = {"on/off": [_pair(900 * 1.04, 1000)], "off/on": [_pair(1000 * 1.04, 900)]}
    got = geometric_ratios(pairs, ("on",), ("off",))
    assert math.isclose(got["rate"][0], 0.9)
    assert math.isclose(got["cpu"][0], 1 / 0.9)


def test_two_processes_of_each_kind_average_a_faster_one() -> None:
    # `on` truly serves 0.9 of `off`, but the `twin` process runs 5% faster than `off`: one
    # process of each reads 0.9 or 0.857 by which `off` it meets; two of each read their average.
    rps = {"on": 900.0, "on2": 900.0, "off": 1000.0, "twin": 1050.0}
    pairs = {f"{a}/{b}": [_pair(rps[a], rps[b]), _pair(rps[a], rps[b])] for a in rps for b in rps if a != b}
    single = geometric_ratios(pairs, ("on",), ("twin",))["rate"]
    balanced = geometric_ratios(pairs, ("on", "on2"), ("off", "twin"))["rate"]
    assert math.isclose(single[0], 900 / 1050)
    assert len(balanced) == 2
    assert math.isclose(balanced[0], 0.9 / math.sqrt(1.05))
