"""Which model serves each tier: the classifier picks a tier, this picks the model pool.

Models name their tier in config (``models[].tier``). The first model of a tier (in config
order) serves it; further models of the same tier are reachable by name or as fallbacks.
A tier that no model serves borrows its nearest neighbour's model, distance counted in
tiers; on a tie the larger tier wins, because a bigger model answers a simple question
well while a smaller one may fail a hard one. When no configured model serves any tier,
the map is inactive and ``auto`` keeps meaning ``default_model`` (no classification).
"""

from __future__ import annotations

from collections.abc import Sequence

from routing.classifier import TierRange


class TierMap:
    """Tier name -> serving model, with the nearest-tier rule for tiers without a model."""

    __slots__ = ("_models", "_order", "ranges")

    def __init__(self, ranges: Sequence[TierRange], model_tiers: Sequence[tuple[str, str]]) -> None:
        """``ranges`` as validated by ``validate_tiers``; ``model_tiers`` as (model, tier) in config order."""
        self.ranges = tuple(ranges)
        names = [t.name for t in self.ranges]
        own: dict[str, str] = {}
        for model, tier in model_tiers:
            own.setdefault(tier, model)
        self._order = tuple(names)
        self._models: dict[str, str] = {}
        if not any(n in own for n in names):
            return
        for i, name in enumerate(names):
            self._models[name] = own.get(name) or _nearest(names, i, own)

    @property
    def active(self) -> bool:
        """Whether any tier has a model (else classification would change nothing)."""
        return bool(self._models)

    @property
    def names(self) -> tuple[str, ...]:
        return self._order

    def model_for(self, tier: str) -> str | None:
        return self._models.get(tier)

    def smaller(self, tier: str) -> list[str]:
        """Models of the tiers below ``tier``, nearest first, each once, excluding ``tier``'s own."""
        if tier not in self._models:
            return []
        own = self._models[tier]
        out: list[str] = []
        for name in reversed(self._order[: self._order.index(tier)]):
            model = self._models[name]
            if model != own and model not in out:
                out.append(model)
        return out


def _nearest(names: Sequence[str], i: int, own: dict[str, str]) -> str:
    for distance in range(1, len(names)):
        for j in (i + distance, i - distance):  # larger tier first on a tie
            if 0 <= j < len(names) and names[j] in own:
                return own[names[j]]
    raise AssertionError("unreachable: some tier has a model")
