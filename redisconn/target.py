"""Where a Redis URL points: a single node, a Redis Cluster, or a Sentinel-managed master.

Pure parsing, no I/O. The schemes::

    redis://[user:password@]host:port[/db]             one node (rediss:// with TLS)
    redis+cluster://[user:password@]h:p[,h:p...]        Redis Cluster: any reachable nodes
                                                        seed the topology (rediss+cluster://)
    redis+sentinel://[user:password@]h:p[,h:p...]/service[/db]
                                                        the master Sentinel names ``service``
                                                        (rediss+sentinel://: TLS to both)

Single-node URLs keep every query option redis-py understands; the cluster and sentinel
forms take none (options come from settings, the same for all three).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote, urlsplit

Kind = Literal["single", "cluster", "sentinel"]

SCHEMES: dict[str, tuple[Kind, bool]] = {
    "redis": ("single", False),
    "rediss": ("single", True),
    "unix": ("single", False),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
}
DEFAULT_PORT = {"single": 6379, "cluster": 6379, "sentinel": 26379}


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A parsed Redis URL. ``url`` is kept as given for single nodes (redis-py parses it)."""

    kind: Kind
    tls: bool
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> RedisTarget:
        """Parse ``url``; a ``ValueError`` names what is wrong (never the password)."""
        scheme, sep, _ = url.partition("://")
        if not sep or scheme.lower() not in SCHEMES:
            known = ", ".join(f"{s}://" for s in SCHEMES)
            raise ValueError(f"redis_url: unknown scheme {scheme!r} (expected one of {known})")
        kind, tls = SCHEMES[scheme.lower()]
        if kind == "single":
            return cls(kind, tls, url)
        parts = urlsplit(url)
        if parts.query or parts.fragment:
            raise ValueError(f"redis_url: {scheme}:// takes no query options; set them under `redis:`")
        userinfo, _, hosts = parts.netloc.rpartition("@")
        username, password = _credentials(userinfo)
        nodes = tuple(_node(h, DEFAULT_PORT[kind]) for h in hosts.split(","))
        path = [unquote(p) for p in parts.path.split("/") if p]
        if kind == "cluster":
            if path:
                raise ValueError("redis_url: a cluster has one database; no path after the nodes")
            return cls(kind, tls, url, nodes, username=username, password=password)
        if not path or len(path) > 2:
            raise ValueError("redis_url: redis+sentinel://host:port[,host:port...]/service_name[/db]")
        db = _db(path[1]) if len(path) == 2 else 0
        return cls(kind, tls, url, nodes, path[0], db, username, password)


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    if not userinfo:
        return None, None
    user, sep, password = userinfo.partition(":")
    return (unquote(user) or None), (unquote(password) if sep else None)


def _node(text: str, default_port: int) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ValueError(f"redis_url: empty host in {text!r}")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"redis_url: bad port in {text!r}")
    return host, int(port_text)


def _db(text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"redis_url: database must be a number, not {text!r}")
    return int(text)
