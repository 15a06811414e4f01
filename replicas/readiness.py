"""When the fleet's state is known: the gateway's readiness at start.

A gateway that takes traffic before it knows its fleet answers every request 503
``no_healthy_replica``: in a rolling update the new pod would join the Service and fail its
first requests. So readiness waits, once, until the fleet's state is known:

- every Kubernetes discovery source has handed over its first list;
- every external and discovered replica has had the verdict of its first probe (up or
  down: either is known);
- every model with managed replicas (the ones this process launches) has a replica
  healthy, or has none left to wait for (each crash-looped to ``failed``).

The gateway gives up waiting after ``health.start_timeout_s``. After that first time,
readiness no longer follows replica health: a pod that is up stays in its Service when the
whole fleet is down, and answers 503 ``no_healthy_replica`` in OpenAI's shape, which a
client can act on (a pod outside the Service gives connection errors).

Pure: the fleet's replicas in, a verdict out; ``Fleet.state_known`` applies it, the
gateway's start-up task waits on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from replicas.replica import Replica, ReplicaState


def fleet_state_known(by_model: Mapping[str, Sequence[Replica]], *, unlisted_sources: int) -> bool:
    """Whether the fleet's state is known (see the module's docstring).

    ``unlisted_sources``: discovery sources whose first list has not arrived yet.
    """
    if unlisted_sources:
        return False
    return all(model_state_known(replicas) for replicas in by_model.values())


def model_state_known(replicas: Iterable[Replica]) -> bool:
    """One model's replicas: the external ones probed, the managed ones up (or given up on)."""
    managed: list[Replica] = []
    healthy = False
    for replica in replicas:
        healthy = healthy or replica.state is ReplicaState.HEALTHY
        if replica.managed:
            managed.append(replica)
        elif not replica.probed:
            return False
    if not managed or healthy:
        return True
    return all(r.state is ReplicaState.FAILED for r in managed)
