"""Shared fixtures of the integration tests: real redis-server processes.

``redis_server`` gives each test its own server (stop, kill and restart it freely);
``redis_session_server`` is one server for a whole session, for tests that only read and
write (use key prefixes of your own, and do not stop it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.integration.redis_server import REDIS_BINARY, RedisServer


def _require_binary() -> None:
    if not os.access(REDIS_BINARY, os.X_OK):
        pytest.skip(f"no redis-server binary at {REDIS_BINARY}")


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh redis-server on a free port, for this test only."""
    _require_binary()
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_session_server() -> Iterator[RedisServer]:
    """One redis-server shared by the session; never stop it in a test."""
    _require_binary()
    with RedisServer() as server:
        yield server
