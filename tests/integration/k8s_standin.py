"""A stand-in for the Kubernetes API server: EndpointSlice list and watch, nothing more.

It stands in for the Kubernetes API because no cluster can run here: there is no
container runtime, no kube-apiserver or etcd binary, and the tests may use loopback only.
It serves the one endpoint fleetgate's discovery uses, the way kube-apiserver does::

    GET /apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices
        ?labelSelector=k=v[,k=v]                      equality terms only
        ?watch=1&resourceVersion=N&timeoutSeconds=S   newline-delimited JSON events

A list answers an ``EndpointSliceList`` stamped with the store's current resourceVersion.
A watch streams ``{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}`` for
every change after ``resourceVersion`` (missing or "0": the current objects as ADDED
first), then ends cleanly after ``timeoutSeconds``. A resourceVersion older than the last
compaction gets 410 Gone: as an ERROR event carrying a ``Status`` (what kube-apiserver
sends on a watch) or, with ``gone_as_status``, as the HTTP status itself.

Faults on cue: ``gone()`` (compact the history; open watches get the 410 ERROR event
unless ``notify=False``),
``expire_watches()`` (end them cleanly, as their timeout would), ``drop_watches()`` (cut
the connections mid-stream), ``fail_next(n)`` (the next n requests answer 500) and
``stall_watches`` (watches never end and never speak: only the client's read timeout helps).
Not modelled: authentication, field selectors, pagination, label changes that move an
object out of a selector.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import web

from tests.integration.harness import serve_app

SERVICE_LABEL = "kubernetes.io/service-name"
_END, _DROP = "end", "drop"


def endpoint(
    address: str, pod: str | None = None, *, ready: bool | None = True, terminating: bool = False
) -> dict[str, Any]:
    """One endpoint of a slice, as the EndpointSlice controller writes it."""
    conditions: dict[str, Any] = {"serving": ready is not False, "terminating": terminating}
    if ready is not None:
        conditions["ready"] = ready
    ep: dict[str, Any] = {"addresses": [address], "conditions": conditions}
    if pod is not None:
        ep["targetRef"] = {"kind": "Pod", "name": pod, "namespace": "ns"}
    return ep


def endpoint_slice(
    name: str, service: str, port: int, endpoints: list[dict[str, Any]], *, namespace: str = "ns"
) -> dict[str, Any]:
    """An IPv4 EndpointSlice of ``service`` with one port named "http"."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": namespace, "labels": {SERVICE_LABEL: service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def _flag(value: str) -> bool:
    # The API server parses booleans with Go's strconv.ParseBool; the Python client sends "True".
    return value in ("1", "t", "T", "TRUE", "true", "True")


def _matches(obj: dict[str, Any], namespace: str, selector: str) -> bool:
    meta = obj["metadata"]
    labels = meta.get("labels") or {}
    terms = [t.split("=", 1) for t in selector.split(",") if t]
    return meta["namespace"] == namespace and all(labels.get(k) == v for k, v in terms)


class StandInApiServer:
    """The EndpointSlices of a pretend cluster, with list and watch over HTTP."""

    def __init__(self, *, gone_as_status: bool = False) -> None:
        self.gone_as_status = gone_as_status
        self._objects: dict[tuple[str, str], dict[str, Any]] = {}
        self._version = 100
        # (resourceVersion, event type, object) since the last compaction.
        self._history: list[tuple[int, str, dict[str, Any]]] = []
        self._oldest = 0
        self._watches: set[asyncio.Queue[tuple[str, dict[str, Any]] | str]] = set()
        self._failures_left = 0
        # True: watches ignore timeoutSeconds and hang silently, like a half-open connection.
        self.stall_watches = False
        # Query parameters of every request, oldest first, for assertions.
        self.requests: list[dict[str, str]] = []

    # -- changes ---------------------------------------------------------------------------

    def apply(self, obj: dict[str, Any]) -> int:
        """Create or replace a slice; returns its new resourceVersion."""
        meta = obj["metadata"]
        key = (meta["namespace"], meta["name"])
        kind = "MODIFIED" if key in self._objects else "ADDED"
        self._objects[key] = obj = copy.deepcopy(obj)
        return self._record(kind, obj)

    def delete(self, name: str, namespace: str = "ns") -> int:
        return self._record("DELETED", self._objects.pop((namespace, name)))

    def _record(self, kind: str, obj: dict[str, Any]) -> int:
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)
        snapshot = copy.deepcopy(obj)
        self._history.append((self._version, kind, snapshot))
        for queue in self._watches:
            queue.put_nowait((kind, snapshot))
        return self._version

    # -- faults ----------------------------------------------------------------------------

    def gone(self, *, notify: bool = True) -> None:
        """Compact: every version up to now is too old; open watches get 410 Gone.

        ``notify=False`` leaves open watches alone: the 410 then comes when they reconnect.
        """
        # The cluster moved on (other objects changed) and etcd compacted up to here: any
        # version before this one is gone, a list from now on is current.
        self._version += 1
        self._oldest = self._version
        self._history.clear()
        for queue in self._watches if notify else ():
            queue.put_nowait(("ERROR", self._gone_status(self._version)))

    def expire_watches(self) -> None:
        for queue in self._watches:
            queue.put_nowait(_END)

    def drop_watches(self) -> None:
        for queue in self._watches:
            queue.put_nowait(_DROP)

    def fail_next(self, n: int) -> None:
        self._failures_left = n

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    # -- HTTP ------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices", self._get)
        return app

    @staticmethod
    def _gone_status(version: int) -> dict[str, Any]:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": f"too old resource version: {version}",
            "reason": "Expired",
            "code": 410,
        }

    async def _get(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append(query)
        if self._failures_left:
            self._failures_left -= 1
            return web.json_response({"kind": "Status", "code": 500, "message": "etcd unavailable"}, status=500)
        namespace = request.match_info["namespace"]
        selector = query.get("labelSelector", "")
        if _flag(query.get("watch", "")):
            return await self._watch(request, namespace, selector)
        items = [o for o in self._objects.values() if _matches(o, namespace, selector)]
        return web.json_response(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": str(self._version)},
                "items": sorted(items, key=lambda o: str(o["metadata"]["name"])),
            }
        )

    async def _watch(self, request: web.Request, namespace: str, selector: str) -> web.StreamResponse:
        since = int(request.query.get("resourceVersion") or 0)
        if since and since < self._oldest and self.gone_as_status:
            return web.json_response(self._gone_status(since), status=410)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)

        async def send(kind: str, obj: dict[str, Any]) -> None:
            if kind == "ERROR" or _matches(obj, namespace, selector):
                await response.write(orjson.dumps({"type": kind, "object": obj}) + b"\n")

        if since and since < self._oldest:
            await send("ERROR", self._gone_status(since))
            await response.write_eof()
            return response
        # Backlog and subscription with no await between them: no change can slip through.
        if since:
            backlog = [(kind, obj) for version, kind, obj in self._history if version > since]
        else:
            backlog = [("ADDED", obj) for obj in self._objects.values()]
        queue: asyncio.Queue[tuple[str, dict[str, Any]] | str] = asyncio.Queue()
        self._watches.add(queue)
        try:
            timeout = None if self.stall_watches else float(request.query.get("timeoutSeconds", 1800))
            with contextlib.suppress(TimeoutError):  # timeoutSeconds: the normal, clean end
                async with asyncio.timeout(timeout):
                    for kind, obj in backlog:
                        await send(kind, obj)
                    while (item := await queue.get()) != _END:
                        if item == _DROP:
                            assert request.transport is not None
                            request.transport.close()
                            return response
                        assert isinstance(item, tuple)
                        await send(*item)
                        if item[0] == "ERROR":
                            break
            await response.write_eof()
        except ConnectionError:
            pass  # the client went away first
        finally:
            self._watches.discard(queue)
        return response


@contextlib.asynccontextmanager
async def standin_api_server(**kwargs: Any) -> AsyncIterator[tuple[str, StandInApiServer]]:
    """Serve a ``StandInApiServer`` on a loopback port; yields (base URL, server)."""
    server = StandInApiServer(**kwargs)
    async with serve_app(server.app()) as url:
        try:
            yield url, server
        finally:
            # Open watches would otherwise hold the shutdown for their whole timeout.
            server.expire_watches()
