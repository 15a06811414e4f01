"""What the gateway sends a replica besides the request: its credentials and static headers.

A replica source names its key by reference (``env:VARIABLE``, or the path of a file such
as a mounted Kubernetes Secret), never by value; the key is read once, when the fleet is
built, and lives only in the headers of the replicas of that source (kept out of their
``repr`` and of every snapshot, so no log line can carry it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path


class CredentialError(ValueError):
    """A key reference that cannot be resolved (unset variable, unreadable or empty file)."""


def _read_text(path: str) -> str:
    return Path(path).read_text()


def resolve_key(ref: str, environ: Mapping[str, str], read: Callable[[str], str] = _read_text) -> str:
    """The key ``ref`` points at: ``env:VARIABLE``'s value, or a file's content (stripped)."""
    if ref.startswith("env:"):
        var = ref[4:]
        value = environ.get(var, "").strip()
        if not value:
            raise CredentialError(f"api_key: the variable {var} is not set")
        return value
    try:
        value = read(ref).strip()
    except OSError as exc:
        raise CredentialError(f"api_key: cannot read {ref}: {exc.strerror or exc}") from exc
    if not value:
        raise CredentialError(f"api_key: {ref} is empty")
    return value


def upstream_headers(
    api_key: str | None,
    headers: Mapping[str, str],
    environ: Mapping[str, str],
    read: Callable[[str], str] = _read_text,
) -> dict[str, str]:
    """Headers for every request to a source's replicas: its static ones, then the key."""
    out = dict(headers)
    if api_key is not None:
        key = resolve_key(api_key, environ, read)
        if any(c in key for c in "\r\n") or not key.isascii():
            raise CredentialError("api_key: the key must be one line of ASCII")
        out["Authorization"] = f"Bearer {key}"
    return out
