"""What a replica's ``/v1/models`` says about its LoRA adapters, and when the health checker reads it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from common.breaker import BreakerConfig, CircuitBreaker
from replicas.health import HealthChecker
from replicas.lora import served_adapters
from replicas.replica import Replica, ReplicaState

# vLLM 0.32's answer with one adapter from --lora-modules and one loaded at run time (trimmed).
VLLM_LISTING: dict[str, Any] = {
    "object": "list",
    "data": [
        {"id": "tiny", "object": "model", "root": "/models/tiny", "parent": None, "max_model_len": 4096},
        {"id": "sql-lora", "object": "model", "root": "/adapters/sql", "parent": "tiny"},
        {"id": "chat-lora", "object": "model", "root": "/adapters/chat", "parent": "tiny"},
    ],
}


def test_adapters_are_the_entries_with_a_parent() -> None:
    assert served_adapters(VLLM_LISTING) == {"sql-lora", "chat-lora"}


def test_a_listing_without_adapters_has_none() -> None:
    # A base model only (no --enable-lora), and a hosted API's list, which has no parent field.
    assert served_adapters({"object": "list", "data": [VLLM_LISTING["data"][0]]}) == frozenset()
    assert served_adapters({"object": "list", "data": [{"id": "gpt-4o", "object": "model"}]}) == frozenset()


def test_malformed_listings_yield_nothing_rather_than_fail() -> None:
    malformed: list[Any] = [None, [], "x", {"data": "x"}, {"data": [1, None, {"id": 3, "parent": "m"}]}]
    for listing in malformed:
        assert served_adapters(listing) == frozenset()
    # An entry naming itself as parent, or with an empty parent, is no adapter.
    assert served_adapters({"data": [{"id": "m", "parent": "m"}, {"id": "a", "parent": ""}]}) == frozenset()


class _Answer:
    """What the health checker reads of an aiohttp response: a status and a body."""

    def __init__(self, status: int, body: bytes, during: Callable[[], None] | None) -> None:
        self.status, self._body, self._during = status, body, during

    async def __aenter__(self) -> _Answer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def read(self) -> bytes:
        if self._during is not None:
            self._during()  # something happens while the listing is on its way
        return self._body


class _Session:
    def __init__(self, status: int, listing: object, during: Callable[[], None] | None = None) -> None:
        self.answer = _Answer(status, json.dumps(listing).encode(), during)
        self.urls: list[str] = []

    def get(self, url: str, **_: object) -> _Answer:
        self.urls.append(url)
        return self.answer


def checker(session: _Session, clock: list[float]) -> HealthChecker:
    return HealthChecker(
        session,  # type: ignore[arg-type]
        interval_s=1.0,
        timeout_s=1.0,
        failures_to_down=3,
        adapters_interval_s=5.0,
        clock=lambda: clock[0],
    )


def replica() -> Replica:
    return Replica("r", "http://r", "tiny", "t", "tiny", True, CircuitBreaker(BreakerConfig(3, 5.0)))


def test_adapters_are_read_every_interval_and_whenever_out_of_rotation() -> None:
    clock = [100.0]
    health = checker(_Session(200, VLLM_LISTING), clock)
    r = replica()
    assert health._adapters_due(r, 100.0)  # never read
    r.adapters_listed_at = 100.0
    assert health._adapters_due(r, 100.5)  # starting: read on every passing probe
    r.state = ReplicaState.HEALTHY
    assert not health._adapters_due(r, 104.9)
    assert health._adapters_due(r, 105.0)
    r.state = ReplicaState.DOWN  # it may have restarted without its run-time adapters
    assert health._adapters_due(r, 101.0)
    never = HealthChecker(None, interval_s=1.0, timeout_s=1.0, failures_to_down=3)  # type: ignore[arg-type]
    assert not never._adapters_due(replica(), 0.0)


async def test_a_listing_replaces_the_set_but_keeps_a_load_it_may_predate() -> None:
    clock = [7.0]
    r = replica()
    r.adapters = frozenset({"gone-lora"})

    def loaded_meanwhile() -> None:
        r.adapters = r.adapters | {"fresh-lora"}  # gateway.lora loaded it while the GET was out

    session = _Session(200, VLLM_LISTING, during=loaded_meanwhile)
    await checker(session, clock)._list_adapters(r)
    assert session.urls == ["http://r/v1/models"]
    assert r.adapters == {"sql-lora", "chat-lora", "fresh-lora"}
    assert r.adapters_listed_at == 7.0


async def test_a_failed_listing_keeps_the_last_list() -> None:
    r = replica()
    r.adapters = frozenset({"sql-lora"})
    await checker(_Session(500, {"error": "x"}), [1.0])._list_adapters(r)
    assert r.adapters == {"sql-lora"} and r.adapters_listed_at is None
    session = _Session(200, {})
    session.answer._body = b"not json"
    await checker(session, [1.0])._list_adapters(r)
    assert r.adapters == {"sql-lora"}
