"""How the runner's items reach the gateway's own request path: HTTP over loopback to this
process's listener, with a key only this process knows.

Each tenant gets an internal API key for the life of the process, derived from a random
secret with HMAC (``InternalKeys``); the gateway adds its SHA-256 digest to the keyring
beside the tenant's own keys (key id ``batch``), so the authenticate stage treats an item
exactly as it treats the tenant's requests, in constant time as for every key
(``gateway.auth``). The key never leaves the process: it is not logged, not forwarded
upstream (the proxy sends the replica's own credentials), and a restart makes a new one.
So an item passes every stage a client's request passes: authentication, limits and
quotas, the cache, routing, queueing, metrics and the access log.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

import aiohttp

# The header the priority bands read (issue #44: a request may ask for a lower band).
BAND_HEADER = "x-fleetgate-band"
REQUEST_ID_HEADER = "x-request-id"
# The key id internal keys carry in logs and per-key limits.
KEY_ID = "batch"


class InternalKeys:
    """One key per tenant, from a secret drawn when the process starts."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else os.urandom(32)

    def key(self, tenant: str) -> str:
        return "fg-batch-" + hmac.new(self._secret, tenant.encode(), hashlib.sha256).hexdigest()

    def digest_ref(self, tenant: str) -> str:
        """The key as the keyring stores it (``sha256:<hex>``)."""
        return "sha256:" + hashlib.sha256(self.key(tenant).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    request_id: str
    retry_after_s: float | None


class LoopbackSender:
    """Sends an item to ``base_url`` as its tenant, in ``band``; owns its client session."""

    def __init__(self, base_url: str, keys: InternalKeys, band: str, concurrency: int, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.keys = keys
        self.band = band
        self._concurrency = concurrency
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> LoopbackSender:
        connector = aiohttp.TCPConnector(limit=self._concurrency)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def send(self, tenant: str, path: str, body: bytes, request_id: str) -> Answer:
        """The gateway's answer to the item (``aiohttp.ClientError`` when it could not be asked)."""
        assert self._session is not None, "LoopbackSender used outside its context"
        headers = {
            "Authorization": f"Bearer {self.keys.key(tenant)}",
            "Content-Type": "application/json",
            BAND_HEADER: self.band,
            REQUEST_ID_HEADER: request_id,
        }
        async with self._session.post(self.base_url + path, data=body, headers=headers) as response:
            raw = await response.read()
            answered_id = response.headers.get(REQUEST_ID_HEADER, request_id)
            return Answer(response.status, raw, answered_id, _retry_after(response))


def _retry_after(response: aiohttp.ClientResponse) -> float | None:
    value = response.headers.get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
