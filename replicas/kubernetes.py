"""Kubernetes discovery: a model's replicas are the ready pods behind a Service.

The gateway lists the EndpointSlices of the Service (label
``kubernetes.io/service-name=<service>``), then watches them from the list's
resourceVersion: the list-then-watch protocol of
https://kubernetes.io/docs/reference/using-api/api-concepts/#efficient-detection-of-changes.
It keeps every slice it has seen and, after each change, hands the Fleet the full desired
set ``{replica id: base URL}``; ``Fleet.sync`` diffs it and applies only real changes.

Two halves, as everywhere in fleetgate:

* ``desired_replicas`` decides: slices (plain JSON, exactly as the API sends them) to the
  desired set. Pure, so every readiness, port, IPv6 and duplicate rule is unit-tested.
* ``watch_endpoint_slices`` acts: list, watch, re-list on 410 Gone, reconnect with capped
  exponential backoff and jitter, never crash. It asks the client library for raw
  responses (``_preload_content=False``) so the decision half sees the API's own JSON.
  The library's ``Watch`` helper is not used: it answers a 410 by watching again rather
  than listing, and opens a second client from the default configuration.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol, cast

import aiohttp
import orjson
from kubernetes_asyncio.client import ApiClient, Configuration, DiscoveryV1Api
from kubernetes_asyncio.config import load_incluster_config
from kubernetes_asyncio.config.config_exception import ConfigException

from replicas.config import KubernetesSource

log = logging.getLogger("fleetgate.kubernetes")

ApiClientFactory = Callable[[], ApiClient]
Slice = Mapping[str, Any]


class OnChange(Protocol):
    """Told the full desired set ``{replica id: base URL}`` after every change (``Fleet.sync``).

    A protocol rather than a ``Callable`` alias so that the Fleet's
    ``lambda d, m=model: ...`` (a default argument binding the model) type-checks.
    """

    def __call__(self, desired: dict[str, str], /) -> object: ...


# Where Kubernetes mounts the pod's own namespace next to its service-account token.
POD_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# The label the EndpointSlice controller puts on every slice of a Service.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# HTTP 410: the resourceVersion we asked for has been compacted away; only a new list helps.
GONE = 410


@dataclass(frozen=True, slots=True)
class WatchTiming:
    """How long each network step may take, and how retries back off."""

    list_timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    # Sent as timeoutSeconds: the server ends each watch after this long, so a connection
    # that died silently (no FIN, no RST) is replaced within about a minute.
    watch_timeout_s: int = 60
    # The client's read timeout is the server's plus this: a healthy server ends first.
    read_grace_s: float = 15.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    # A watch that ends cleanly this fast without one event counts as a failure, so a
    # server or proxy that closes watches at once is not hit in a tight loop.
    min_quiet_watch_s: float = 1.0


DEFAULT_TIMING = WatchTiming()

# -- deciding (pure) ---------------------------------------------------------------------


def slice_port(endpoint_slice: Slice, wanted: str | int | None) -> int | None:
    """The port to dial on this slice's endpoints, or None when it has none that fits.

    ``wanted`` is a port name or number (``None``: the slice's first port). Port names
    must contain a letter (IANA service names), so a digit-only string is a number.
    A number must be one of the slice's ports, unless the slice numbers none: no ports
    (a headless Service without any) or a port entry without a number, which the API
    defines as "all ports". Then the configured number is the only one there is.
    """
    ports = [p for p in endpoint_slice.get("ports") or () if isinstance(p.get("port"), int)]
    if wanted is None:
        return int(ports[0]["port"]) if ports else None
    if isinstance(wanted, int) or wanted.isdigit():
        number = int(wanted)
        return number if not ports or any(p["port"] == number for p in ports) else None
    return next((int(p["port"]) for p in ports if p.get("name") == wanted), None)


def endpoint_routable(endpoint: Mapping[str, Any]) -> bool:
    """Ready and not terminating.

    The API says a missing ``ready`` means true and a missing ``terminating`` false
    (https://kubernetes.io/docs/reference/kubernetes-api/service-resources/endpoint-slice-v1/).
    ``terminating`` is checked on its own because a Service with
    ``publishNotReadyAddresses`` keeps terminating pods "ready": the gateway must still
    stop sending them new requests.
    """
    conditions = endpoint.get("conditions") or {}
    return conditions.get("ready") is not False and conditions.get("terminating") is not True


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def desired_replicas(slices: Iterable[Slice], source: KubernetesSource) -> dict[str, str]:
    """The replicas the slices describe: ``{"<service>-<pod>": "scheme://address:port"}``.

    An endpoint without a pod reference is named by its address. Slices are read in name
    order so the result does not depend on event order; an address:port seen in several
    slices (the controller may briefly list a pod twice while it rebalances) counts once.
    """
    desired: dict[str, str] = {}
    urls: set[str] = set()
    for endpoint_slice in sorted(slices, key=slice_name):
        port = slice_port(endpoint_slice, source.port)
        if port is None:
            continue
        for endpoint in endpoint_slice.get("endpoints") or ():
            addresses = endpoint.get("addresses") or ()
            if not addresses or not endpoint_routable(endpoint):
                continue
            # Addresses of one endpoint are fungible; the API says to use the first.
            address = str(addresses[0])
            url = f"{source.scheme}://{_host(address)}:{port}"
            pod = (endpoint.get("targetRef") or {}).get("name")
            replica_id = f"{source.service}-{pod or address}"
            if url in urls or replica_id in desired:
                continue
            urls.add(url)
            desired[replica_id] = url
    return desired


def slice_name(endpoint_slice: Slice) -> str:
    return str((endpoint_slice.get("metadata") or {}).get("name", ""))


def backoff_delay(failures: int, timing: WatchTiming, rng: random.Random) -> float:
    """Seconds to wait before the next try: doubling from the initial delay, capped.

    "Equal jitter": half the delay is fixed, half random, so many gateways that lost the
    API server together do not come back in step, and none retries at once.
    """
    if failures <= 0:
        return 0.0
    ceiling = min(timing.backoff_max_s, timing.backoff_initial_s * 2.0 ** min(failures - 1, 30))
    return ceiling / 2 + rng.uniform(0, ceiling / 2)


# -- acting (network) --------------------------------------------------------------------

_factory_override: ApiClientFactory | None = None


def set_api_client_factory(factory: ApiClientFactory | None) -> ApiClientFactory | None:
    """Tests only: make discovery started by the Fleet use ``factory``; returns the old one.

    Everywhere else configuration flows in through constructors, but the Fleet starts
    discovery with ``(source, on_change)`` alone and the in-cluster credentials live at
    fixed paths no test can provide. An end-to-end test through a real gateway points
    discovery at a stand-in API server here, and restores the previous value after.
    """
    global _factory_override
    previous, _factory_override = _factory_override, factory
    return previous


def in_cluster_api_client() -> ApiClient:
    """A client with the pod's service-account token and CA (refreshed as they rotate)."""
    configuration = Configuration()
    # The library leaves this one function unannotated.
    load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    return ApiClient(configuration)


def pod_namespace(path: Path = POD_NAMESPACE_FILE) -> str:
    return path.read_text().strip()


async def _get_raw(api: DiscoveryV1Api, namespace: str, **params: Any) -> aiohttp.ClientResponse:
    """GET the Service's EndpointSlices (list or watch) as aiohttp's own response.

    With ``_preload_content=False`` the client returns the unread response instead of
    the model object its annotations promise; the status is then ours to check.
    """
    response = await api.list_namespaced_endpoint_slice(namespace, _preload_content=False, **params)
    return cast(aiohttp.ClientResponse, response)


class _Expired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class _BadResponse(Exception):
    """The API server answered with an unexpected status or document."""


class _SliceWatch:
    """The slices of one Service as last seen, kept current by list and watch."""

    def __init__(
        self,
        api: DiscoveryV1Api,
        namespace: str,
        source: KubernetesSource,
        on_change: OnChange,
        timing: WatchTiming,
    ) -> None:
        self._api, self._namespace, self._source = api, namespace, source
        self._on_change, self._timing = on_change, timing
        self._selector = f"{SERVICE_NAME_LABEL}={source.service}"
        self.slices: dict[str, Slice] = {}
        self.resource_version: str | None = None
        # Times the resourceVersion moved forward: how the retry loop tells progress.
        self.progress = 0
        self._published: dict[str, str] | None = None

    async def relist(self) -> None:
        t = self._timing
        response = await _get_raw(
            self._api,
            self._namespace,
            label_selector=self._selector,
            _request_timeout=aiohttp.ClientTimeout(total=t.list_timeout_s, connect=t.connect_timeout_s),
        )
        async with response:
            body = await response.read()
            if response.status != 200:
                raise _BadResponse(f"list answered {response.status}: {body[:200]!r}")
        document = orjson.loads(body)
        version = (document.get("metadata") or {}).get("resourceVersion")
        if not version:
            raise _BadResponse("list has no resourceVersion to watch from")
        self.slices = {slice_name(s): s for s in document.get("items") or ()}
        self.resource_version = str(version)
        for endpoint_slice in self.slices.values():
            self._check_port(endpoint_slice)
        self._publish()

    async def watch(self) -> None:
        """Follow changes from ``resource_version`` until the server ends the watch."""
        t = self._timing
        response = await _get_raw(
            self._api,
            self._namespace,
            label_selector=self._selector,
            watch=True,
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=t.watch_timeout_s,
            _request_timeout=aiohttp.ClientTimeout(
                connect=t.connect_timeout_s, sock_read=t.watch_timeout_s + t.read_grace_s
            ),
        )
        # close(), not release(): an unfinished stream must not go back to the pool.
        try:
            if response.status == GONE:
                raise _Expired
            if response.status != 200:
                raise _BadResponse(f"watch answered {response.status}: {(await response.read())[:200]!r}")
            while line := await response.content.readline():
                if line.strip():
                    self._apply(orjson.loads(line))
        finally:
            response.close()

    def _apply(self, event: Mapping[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == GONE:
                raise _Expired
            raise _BadResponse(f"watch error {obj.get('code')}: {obj.get('message')}")
        if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
            raise _BadResponse(f"not a watch event: {str(event)[:200]}")
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if version and str(version) != self.resource_version:
            # Progress is a newer version, so repeated bookmarks alone never count.
            self.resource_version = str(version)
            self.progress += 1
        if kind == "BOOKMARK":  # only the resourceVersion moves
            return
        if kind == "DELETED":
            self.slices.pop(slice_name(obj), None)
        else:
            self.slices[slice_name(obj)] = obj
            self._check_port(obj)
        self._publish()

    def _check_port(self, endpoint_slice: Slice) -> None:
        if endpoint_slice.get("endpoints") and slice_port(endpoint_slice, self._source.port) is None:
            log.warning(
                "endpoint slice has no matching port; its endpoints are ignored",
                extra={"slice": slice_name(endpoint_slice), "port": self._source.port},
            )

    def _publish(self) -> None:
        desired = desired_replicas(self.slices.values(), self._source)
        if desired != self._published:
            self._on_change(dict(desired))
            self._published = desired

    async def run(self, rng: random.Random, clock: Callable[[], float]) -> NoReturn:
        """List and watch forever; every failure is logged and retried after a backoff.

        While the API server is out of reach the last known set stays in force: the
        health checker still takes pods that really died out of rotation.
        """
        timing, failures = self._timing, 0
        where = {"service": self._source.service, "namespace": self._namespace}
        while True:
            if failures:
                await asyncio.sleep(backoff_delay(failures, timing, rng))
            progress_before, started = self.progress, clock()
            try:
                if self.resource_version is None:
                    await self.relist()
                    started = clock()
                await self.watch()
                # Watch expiry: resume from the last version seen, no new list needed.
                quick = clock() - started < timing.min_quiet_watch_s
                failures = failures + 1 if quick and self.progress == progress_before else 0
                continue
            except _Expired:
                log.info("endpoint slice watch expired (410 Gone): listing again", extra=where)
                self.resource_version = None
            except (aiohttp.ClientError, TimeoutError, _BadResponse, ValueError) as exc:
                # ValueError covers undecodable JSON and over-long lines.
                log.warning("endpoint slice watch failed; retrying", extra={**where, "error": repr(exc)})
            except Exception:
                log.exception("endpoint slice watch failed unexpectedly; retrying", extra=where)
            # Progress since the last failure resets the backoff: one drop, one short wait.
            failures = 1 if self.progress != progress_before else failures + 1


async def watch_endpoint_slices(
    source: KubernetesSource,
    on_change: OnChange,
    *,
    api_client_factory: ApiClientFactory | None = None,
    timing: WatchTiming = DEFAULT_TIMING,
    rng: random.Random | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Keep ``on_change`` told of the Service's ready endpoints until cancelled.

    ``on_change`` gets the full desired set after the first list and after every change
    to it. ``api_client_factory`` defaults to in-cluster credentials; failures to build
    a client (not in a pod, no token mounted yet) are logged and retried like the rest.
    """
    factory = api_client_factory or _factory_override or in_cluster_api_client
    rng = rng if rng is not None else random.Random()
    failures = 0
    while True:
        try:
            namespace = source.namespace or pod_namespace()
            api_client = factory()
        except (ConfigException, OSError) as exc:
            failures += 1
            log.error(
                "kubernetes discovery has no namespace or in-cluster credentials; retrying",
                extra={"service": source.service, "error": repr(exc)},
            )
            await asyncio.sleep(backoff_delay(failures, timing, rng))
            continue
        async with api_client:
            await _SliceWatch(DiscoveryV1Api(api_client), namespace, source, on_change, timing).run(rng, clock)
