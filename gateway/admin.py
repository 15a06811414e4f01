"""The admin API: look at the fleet, drain and undrain replicas (admin key required).

GET  /admin/fleet                     every replica: state, its probe and how the last one went
                                      (why it is down), load, scraped vLLM gauges; per model,
                                      whether prompt tokens are its tokenizer's or estimated
POST /admin/replicas/{id}/drain       stop routing new requests to it; its streams still running
                                      after upstream.migrate_after_s continue on other replicas
POST /admin/replicas/{id}/undrain     route to it again (once its probes pass)
POST /admin/replicas/{id}/restart     a replica the gateway runs: drained (its streams move
                                      to other replicas), stopped once nothing runs on it or
                                      after ``grace_s`` (query, default 30), started again;
                                      202 at once, the restart goes on (``/admin/fleet``)
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gateway.auth import KeyRing
from gateway.errors import BadRequest, Conflict, Forbidden, GatewayError, NotFound, error_response
from replicas.fleet import Fleet
from replicas.replica import Replica, ReplicaState

log = logging.getLogger("fleetgate.admin")

Handler = Callable[[web.Request], Awaitable[web.Response]]


class AdminApi:
    """Handlers over one fleet, behind the admin keys.

    ``keyring`` is asked on every request: a configuration reload replaces the keys.
    """

    def __init__(
        self,
        fleet: Fleet,
        keyring: Callable[[], KeyRing],
        on_drain: Callable[[Replica], None] | None = None,
        models: Callable[[], dict[str, dict[str, Any]]] | None = None,
        kv_events: Callable[[], dict[str, dict[str, object]]] | None = None,
    ) -> None:
        self._fleet = fleet
        self._keyring = keyring
        # Told of each drained replica: its streams under way move to other replicas.
        self._on_drain = on_drain
        # Per model: where its prompt tokens come from (tokens.counter.PromptCounter.describe).
        self._models = models
        # Per publishing replica: its KV event stream and exact index (routing.kv_subscriber).
        self._kv_events = kv_events

    def _authorize(self, request: web.Request) -> None:
        keyring = self._keyring()
        if not len(keyring):
            raise Forbidden("The admin API is disabled: configure admin_api_keys.")
        keyring.owner_of(request.headers.get("Authorization"))

    def guarded(self, handler: Handler) -> Handler:
        async def wrapper(request: web.Request) -> web.Response:
            try:
                self._authorize(request)
                return await handler(request)
            except GatewayError as err:
                return error_response(err, {})

        return wrapper

    async def fleet(self, _: web.Request) -> web.Response:
        fleet = self._fleet
        now = fleet.clock()
        replicas = [r.snapshot(now) for r in fleet.all()]
        body: dict[str, Any] = {"replicas": replicas, "healthy": fleet.healthy_count()}
        if self._models is not None:
            body["models"] = self._models()
        if self._kv_events is not None:
            body["kv_events"] = self._kv_events()
        return web.json_response(body)

    async def drain(self, request: web.Request) -> web.Response:
        replica = self._replica(request)
        if replica.state is not ReplicaState.FAILED:
            replica.state = ReplicaState.DRAINING
        if self._on_drain is not None:
            self._on_drain(replica)
        log.info("replica drained by operator", extra={"replica": replica.id})
        return web.json_response(replica.snapshot(self._fleet.clock()))

    async def undrain(self, request: web.Request) -> web.Response:
        replica = self._replica(request)
        if replica.state is ReplicaState.DRAINING:
            # Back in rotation only if its last probe passed; otherwise the next good one decides.
            replica.state = ReplicaState.HEALTHY if replica.consecutive_probe_failures == 0 else ReplicaState.DOWN
        log.info("replica undrained by operator", extra={"replica": replica.id})
        return web.json_response(replica.snapshot(self._fleet.clock()))

    async def restart(self, request: web.Request) -> web.Response:
        replica = self._replica(request)
        grace_s = _grace(request.query.get("grace_s", str(RESTART_GRACE_S)))
        if self._fleet.process(replica) is None:
            raise Conflict(
                f"Replica {replica.id!r} is not run by the gateway: "
                "drain it, restart it where it runs, then undrain it.",
                code="replica_not_managed",
            )
        if not self._fleet.restart(replica, grace_s):
            raise Conflict(f"Replica {replica.id!r} is already restarting.", code="replica_restarting")
        log.info("replica restart by operator", extra={"replica": replica.id, "grace_s": grace_s})
        return web.json_response(replica.snapshot(self._fleet.clock()), status=202)

    def _replica(self, request: web.Request) -> Replica:
        replica = self._fleet.get(request.match_info["replica_id"])
        if replica is None:
            raise NotFound(f"No replica {request.match_info['replica_id']!r}.", code="replica_not_found")
        return replica

    def add_routes(
        self, app: web.Application, logged: Callable[[Callable[[web.Request], Awaitable[web.StreamResponse]], str], Any]
    ) -> None:
        """The admin routes on ``app``, each through ``logged`` (its access-log line)."""
        app.router.add_get("/admin/fleet", logged(self.guarded(self.fleet), "admin"))
        app.router.add_post("/admin/replicas/{replica_id}/drain", logged(self.guarded(self.drain), "admin"))
        app.router.add_post("/admin/replicas/{replica_id}/undrain", logged(self.guarded(self.undrain), "admin"))
        app.router.add_post("/admin/replicas/{replica_id}/restart", logged(self.guarded(self.restart), "admin"))


# How long a restarted replica's requests that cannot move elsewhere get to finish.
RESTART_GRACE_S = 30.0


def _grace(value: str) -> float:
    try:
        grace_s = float(value)
    except ValueError:
        grace_s = -1.0
    if not 0 <= grace_s <= 3600:
        raise BadRequest(f"grace_s must be a number of seconds from 0 to 3600, not {value!r}.", param="grace_s")
    return grace_s
