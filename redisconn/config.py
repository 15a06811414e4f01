"""Connection settings shared by every Redis client of a gateway (``redis:`` in the YAML).

Example::

    redis_url: redis+cluster://redis-0:6379,redis-1:6379,redis-2:6379
    redis:
      password_env: REDIS_PASSWORD       # or password_file: /run/secrets/redis-password
      username: fleetgate                # ACL user (optional)
      tls_ca_file: /etc/redis-tls/ca.crt # with a rediss:// scheme

The limiter and the caches keep their own deadlines (``limits.redis_timeout_ms``,
``cache.lookup_timeout_ms``...), which bound connecting too; what is here is the same for
all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, model_validator


@dataclass(frozen=True, slots=True)
class RedisSecurity:
    """Credentials and TLS files, resolved (the password read from its variable or file)."""

    username: str | None = None
    password: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_check_hostname: bool = True


class RedisSettings(BaseModel):
    """How to authenticate to Redis and verify it; applies to every URL scheme."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    username: str | None = None
    # The password's source: an environment variable or a file (a mounted secret), never
    # the YAML itself. A password in the URL is also accepted (and then neither of these).
    password_env: str | None = None
    password_file: Path | None = None
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_check_hostname: bool = True

    @model_validator(mode="after")
    def _one_password_source(self) -> RedisSettings:
        if self.password_env and self.password_file:
            raise ValueError("redis: set password_env or password_file, not both")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("redis: tls_cert_file and tls_key_file go together")
        return self

    def resolve(self, environ: Mapping[str, str]) -> RedisSecurity:
        """Read the password from its variable or file; a missing source is a config error."""
        password: str | None = None
        if self.password_env:
            password = environ.get(self.password_env)
            if password is None:
                raise ValueError(f"redis.password_env: variable {self.password_env} is not set")
        elif self.password_file is not None:
            try:
                password = self.password_file.read_text(encoding="utf-8").rstrip("\r\n")
            except OSError as exc:
                raise ValueError(f"redis.password_file: cannot read {self.password_file}: {exc.strerror}") from exc
        return RedisSecurity(
            username=self.username,
            password=password,
            tls_ca_file=_str(self.tls_ca_file),
            tls_cert_file=_str(self.tls_cert_file),
            tls_key_file=_str(self.tls_key_file),
            tls_check_hostname=self.tls_check_hostname,
        )


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)
