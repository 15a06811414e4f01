"""Which band a request waits in: the tenant's, a lower one asked for, never a higher one."""

from __future__ import annotations

import pytest

from routing.bands import Bands
from routing.config import default_bands

BANDS = Bands.from_settings(default_bands())


def test_default_bands_highest_first() -> None:
    assert BANDS.names == ("interactive", "standard", "batch")
    assert BANDS.lowest == "batch"
    assert BANDS.index(None) == 0 and BANDS.index("batch") == 2
    with pytest.raises(KeyError):
        BANDS.index("bulk")


def test_a_request_may_lower_its_band() -> None:
    interactive = BANDS.index("interactive")
    assert BANDS.resolve(interactive, None) == 0
    assert BANDS.resolve(interactive, "batch") == 2
    assert BANDS.resolve(interactive, "standard") == 1
    assert BANDS.resolve(interactive, " Batch ") == 2  # spelled loosely, still the band


def test_asking_a_higher_band_is_clamped_to_the_tenants() -> None:
    assert BANDS.resolve(BANDS.index("batch"), "interactive") == 2
    assert BANDS.resolve(BANDS.index("standard"), "interactive") == 1


def test_an_unknown_band_is_none() -> None:
    assert BANDS.resolve(0, "urgent") is None
    assert BANDS.resolve(0, "") is None
