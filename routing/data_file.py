"""What the classifier's models (the static head, the embedding head, the n-gram model)
share: reading their data files, and the calibration those files carry."""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from importlib import resources
from pathlib import Path
from typing import Any


def read_data_file(
    path: str | Path | None, shipped: str, formats: Collection[int], error: type[ValueError], what: str
) -> dict[str, Any]:
    """A classifier data file's JSON object: ``path``, or the ``shipped`` file of ``routing/data``.

    Raises ``error`` when it cannot be read or is of none of the ``formats`` read.
    """
    try:
        if path is None:
            raw = resources.files("routing").joinpath("data", shipped).read_text()
        else:
            raw = Path(path).read_text()
        data = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise error(f"cannot read {what}: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") not in formats:
        names = " or ".join(str(f) for f in sorted(formats))
        raise error(f"{what} is not format {names}")
    return data


def calibrated(logit: float, scale: float, shift: float) -> float:
    """The score in [0, 1] of a model's ``logit``: ``sigmoid(scale * logit + shift)``, without
    overflow for large ``|z|``. Every model is calibrated so the same tier boundaries hold."""
    z = scale * logit + shift
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)
