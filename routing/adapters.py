"""LoRA adapters: which base model's pool serves a request naming one, which replicas may take it,
and where to load it when none serves it.

A vLLM replica serves each adapter it has loaded under the adapter's own name
(``replicas.lora``). A request for an adapter therefore goes to its base model's pool, but
only to the replicas that list the adapter, chosen there by the pool's own policy
(``routing.pool.Pool.pick`` is given that narrower list). An adapter is known when the
configuration names it (``models[].adapters``, with the path to load it from when it
has one) or when some replica lists it; a name that is neither is an unknown model.

Pure: reads the replicas' state, never awaits (the loading is ``gateway.lora``'s).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from replicas.replica import Replica


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """A configured adapter: its name, its base model and where replicas load it from (if anywhere)."""

    name: str
    base: str
    path: str | None = None


class AdapterCatalog:
    """Every adapter the gateway knows: the configured ones, and those the replicas list.

    ``pools`` is the fleet's replicas by model (the fleet's own lists, which discovery
    updates in place). A configured adapter belongs to the model it is configured under;
    one only listed belongs to the model of the first replica (in configuration order)
    that lists it. A model's own name is never an adapter's.
    """

    __slots__ = ("_configured", "_pools")

    def __init__(self, configured: Iterable[AdapterSpec], pools: Mapping[str, Sequence[Replica]]) -> None:
        self._configured = {spec.name: spec for spec in configured}
        self._pools = pools

    @property
    def configured(self) -> Mapping[str, AdapterSpec]:
        return self._configured

    def spec(self, name: str) -> AdapterSpec | None:
        return self._configured.get(name)

    def base_of(self, name: str) -> str | None:
        """The model whose pool serves adapter ``name``; None when no such adapter is known."""
        if name in self._pools:
            return None
        spec = self._configured.get(name)
        if spec is not None:
            return spec.base
        for model, replicas in self._pools.items():
            if any(name in r.adapters for r in replicas):
                return model
        return None

    def listing(self) -> dict[str, str]:
        """Every known adapter and its base model (``/v1/models``), configured ones first."""
        out = {name: spec.base for name, spec in self._configured.items()}
        for model, replicas in self._pools.items():
            for replica in replicas:
                for name in sorted(replica.adapters):
                    if name not in out and name not in self._pools:
                        out[name] = model
        return out


def serving(replicas: Sequence[Replica], adapter: str) -> list[Replica]:
    """The replicas that list ``adapter`` (routable or not: the policy skips those that are not)."""
    return [r for r in replicas if adapter in r.adapters]


def serves(replicas: Sequence[Replica], adapter: str, now: float) -> bool:
    """Whether some routable replica lists ``adapter`` (no load needed)."""
    return any(adapter in r.adapters and r.routable(now) for r in replicas)


def load_target(replicas: Sequence[Replica], now: float) -> Replica | None:
    """The routable replica to load an adapter on: the least loaded one.

    Load is requests in flight (this gateway's, and those other gateway pods sent as of the
    last scrape), then this gateway's outstanding tokens; ties go to the replica listed
    first, so concurrent gateway pods tend to pick the same one. Loading is rare, and the
    replica that loads keeps the adapter: a sharper guess of load buys little here.
    """
    best: Replica | None = None
    best_key: tuple[float, int] | None = None
    for replica in replicas:
        if not replica.routable(now):
            continue
        key = (replica.outstanding_requests + replica.foreign_requests, replica.outstanding_tokens)
        if best_key is None or key < best_key:
            best, best_key = replica, key
    return best
