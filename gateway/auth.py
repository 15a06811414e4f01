"""API keys -> tenants.

Keys are stored as SHA-256 digests (or read from the environment and hashed at load), so
neither the config nor memory holds a usable key. A request's key is hashed and looked up
by digest. That is the constant-time comparison: the timing of a dict lookup depends only
on the digest, and an attacker cannot steer a digest towards a stored one (that would need
a SHA-256 preimage), so comparing the raw key byte by byte never happens.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gateway.errors import Unauthorized


@dataclass(frozen=True)
class KeyRef:
    """Where a key comes from: a stored digest, or an environment variable."""

    digest: str | None
    env_var: str | None

    @classmethod
    def parse(cls, ref: str) -> KeyRef:
        kind, _, value = ref.partition(":")
        return cls(digest=value, env_var=None) if kind == "sha256" else cls(digest=None, env_var=value)

    def resolve(self, environ: Mapping[str, str]) -> str | None:
        if self.digest is not None:
            return self.digest
        key = environ.get(self.env_var or "")
        return hashlib.sha256(key.encode()).hexdigest() if key else None


@dataclass(frozen=True, slots=True)
class KeyOwner:
    """Who a key belongs to, and the key's own name (for per-key limits and logs)."""

    owner: str
    key_id: str


# A key without a configured name is known by this many hex digits of its digest:
# enough to tell a tenant's keys apart in logs, far too few to help guess the key.
KEY_ID_DIGITS = 8


class KeyRing:
    """Digest -> owner (a tenant id, or "admin") and key id."""

    def __init__(self, owners: Mapping[str, KeyOwner]) -> None:
        self._owners = dict(owners)

    @classmethod
    def build(
        cls,
        entries: Iterable[tuple[str, Iterable[str | tuple[str, str]]]],
        environ: Mapping[str, str] | None = None,
    ) -> tuple[KeyRing, list[str]]:
        """From (owner, key refs) pairs, each ref plain or ``(key id, ref)``; also returns the
        environment variables that were unset."""
        env = os.environ if environ is None else environ
        owners: dict[str, KeyOwner] = {}
        missing: list[str] = []
        for owner, refs in entries:
            for entry in refs:
                key_id, ref = entry if isinstance(entry, tuple) else (None, entry)
                key_ref = KeyRef.parse(ref)
                digest = key_ref.resolve(env)
                if digest is None:
                    missing.append(key_ref.env_var or "")
                    continue
                found = owners.setdefault(digest, KeyOwner(owner, key_id or digest[:KEY_ID_DIGITS]))
                if found.owner != owner:
                    raise ValueError(f"one API key is configured for both {found.owner!r} and {owner!r}")
        return cls(owners), missing

    def owner_of(self, authorization: str | None) -> KeyOwner:
        """The owner of the bearer key in an ``Authorization`` header, or ``Unauthorized``."""
        if not authorization:
            raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise Unauthorized("Malformed Authorization header: expected 'Bearer <key>'.")
        digest = hashlib.sha256(key.encode()).hexdigest()
        owner = self._owners.get(digest)
        if owner is None:
            raise Unauthorized("Incorrect API key provided.")
        return owner

    def __len__(self) -> int:
        return len(self._owners)


def credential(headers: Mapping[str, str]) -> str | None:
    """The request's API key as an ``Authorization`` value: the header itself, else an
    ``x-api-key`` (how Anthropic's SDK sends its key; Claude Code sends either) as a bearer key."""
    authorization = headers.get("Authorization")
    if authorization is None:
        key = headers.get("x-api-key")
        if key:
            return f"Bearer {key}"
    return authorization
