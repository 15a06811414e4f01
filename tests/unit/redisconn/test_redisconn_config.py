"""The shared Redis settings: where the password comes from, and what goes together."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from redisconn.config import RedisSecurity, RedisSettings


def test_password_from_the_environment() -> None:
    s = RedisSettings(password_env="REDIS_PW", username="fg")
    assert s.resolve({"REDIS_PW": "pw"}) == RedisSecurity(username="fg", password="pw")
    with pytest.raises(ValueError, match="REDIS_PW is not set"):
        s.resolve({})


def test_password_from_a_file_without_its_newline(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    assert RedisSettings(password_file=secret).resolve({}).password == "s3cret"
    with pytest.raises(ValueError, match="cannot read"):
        RedisSettings(password_file=tmp_path / "missing").resolve({})


def test_no_password_and_tls_files() -> None:
    s = RedisSettings(tls_ca_file=Path("/ca.pem"), tls_check_hostname=False)
    assert s.resolve({}) == RedisSecurity(tls_ca_file="/ca.pem", tls_check_hostname=False)


def test_conflicting_settings_fail_at_load() -> None:
    with pytest.raises(ValidationError, match="not both"):
        RedisSettings(password_env="A", password_file=Path("/b"))
    with pytest.raises(ValidationError, match="go together"):
        RedisSettings(tls_cert_file=Path("/c.pem"))
