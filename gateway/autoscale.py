"""The autoscaling signal: pending tokens per model pool, and the replicas they call for.

Little's law in tokens. For a pool in a steady state, the tokens in the system (queued plus in
flight) equal the rate tokens arrive at times the time each spends in the system:
``L = lambda * W``. A replica that sustains ``mu`` tokens/s of prompt and generation while
keeping its requests within the latency you accept (``W_slo``) holds ``L_1 = mu * W_slo``
tokens at that point; that is ``autoscaling.target_pending_tokens``. Holding ``L`` tokens at
that latency then takes ``ceil(L / L_1)`` replicas. ``fleetgate bench`` measures ``mu`` and the
latency curve of a replica (docs/capacity-planning.md); docs/kubernetes.md works an example.

A request's tokens are its cost as the router sees it (prompt estimate plus ``max_tokens``),
counted from the moment it enters its pool (queued or sent) until it is settled. Each gateway
process counts its own requests: across pods, add them up (KEDA's query is
``sum(fleetgate_pending_tokens{model=...})`` with the target as threshold, which gives the
same ``ceil``). ``fleetgate_desired_replicas`` is this process's view, exact for one gateway.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


def desired_replicas(pending_tokens: int, target_per_replica: int, minimum: int = 1) -> int:
    """``ceil(pending / target)``, at least ``minimum`` (a pool never asks for zero by itself)."""
    if target_per_replica <= 0:
        raise ValueError("target_per_replica must be positive")
    return max(minimum, math.ceil(max(0, pending_tokens) / target_per_replica))


class PendingTokens:
    """Tokens of the requests each model pool holds now (queued plus in flight)."""

    __slots__ = ("_by_model",)

    def __init__(self, models: Iterable[str]) -> None:
        self._by_model = dict.fromkeys(models, 0)

    def add(self, model: str, tokens: int) -> None:
        self._by_model[model] = self._by_model.get(model, 0) + tokens

    def remove(self, model: str, tokens: int) -> None:
        self._by_model[model] -= tokens

    def snapshot(self) -> dict[str, int]:
        return dict(self._by_model)


class AutoscaleCollector(Collector):
    """``fleetgate_pending_tokens`` and ``fleetgate_desired_replicas`` by model, read at scrape time."""

    def __init__(self, pending: PendingTokens, target: Callable[[str], int]) -> None:
        self._pending = pending
        self._target = target

    def collect(self) -> Iterator[Metric]:
        pending = GaugeMetricFamily(
            "fleetgate_pending_tokens",
            "Tokens of requests this gateway holds for the model's pool: queued plus in flight.",
            labels=["model"],
        )
        desired = GaugeMetricFamily(
            "fleetgate_desired_replicas",
            "Replicas the model's pending tokens call for: ceil(pending / autoscaling target), at least 1.",
            labels=["model"],
        )
        target = GaugeMetricFamily(
            "fleetgate_autoscaling_target_pending_tokens",
            "The configured pending tokens per replica (autoscaling.target_pending_tokens).",
            labels=["model"],
        )
        for model, tokens in self._pending.snapshot().items():
            per_replica = self._target(model)
            pending.add_metric([model], tokens)
            desired.add_metric([model], desired_replicas(tokens, per_replica))
            target.add_metric([model], per_replica)
        yield from (pending, desired, target)

    def describe(self) -> Iterator[Metric]:
        return iter(())
