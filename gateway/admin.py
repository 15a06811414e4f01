"""The admin API: look at the fleet, drain and undrain replicas (admin key required).

GET  /admin/fleet                     every replica: state, its probe and how the last one went
                                      (why it is down), load, scraped vLLM gauges
POST /admin/replicas/{id}/drain       stop routing new requests to it; its streams still running
                                      after upstream.migrate_after_s continue on other replicas
POST /admin/replicas/{id}/undrain     route to it again (once its probes pass)
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gateway.auth import KeyRing
from gateway.errors import Forbidden, GatewayError, NotFound, error_response
from replicas.fleet import Fleet
from replicas.replica import Replica, ReplicaState

log = logging.getLogger("fleetgate.admin")

Handler = Callable[[web.Request], Awaitable[web.Response]]


class AdminApi:
    """Handlers over one fleet, behind the admin keys.

    ``keyring`` is asked on every request: a configuration reload replaces the keys.
    """

    def __init__(
        self, fleet: Fleet, keyring: Callable[[], KeyRing], on_drain: Callable[[Replica], None] | None = None
    ) -> None:
        self._fleet = fleet
        self._keyring = keyring
        # Told of each drained replica: its streams under way move to other replicas.
        self._on_drain = on_drain

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
        return web.json_response({"replicas": replicas, "healthy": fleet.healthy_count()})

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
