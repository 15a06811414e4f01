"""``models[].adapters``: names clients send, so unique and never a model's (``gateway.settings``)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.settings import Settings


def models(*adapters: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"name": f"m{i}", "replicas": [{"url": "http://127.0.0.1:1"}], "adapters": a} for i, a in enumerate(adapters)
    ]


def test_adapters_with_and_without_a_path() -> None:
    settings = Settings(models=models([{"name": "sql"}, {"name": "chat", "path": "/adapters/chat"}]))
    assert [(a.name, a.path) for a in settings.models[0].adapters] == [("sql", None), ("chat", "/adapters/chat")]
    assert settings.upstream.adapter_load_timeout_s == 60
    assert settings.health.adapters_interval_s == 5


@pytest.mark.parametrize(
    ("adapters", "message"),
    [
        (([{"name": "m1"}], []), "models.0.adapters.0.name: 'm1' is a model's name"),
        (([{"name": "auto"}],), "'auto' is a model's name"),
        (([{"name": "x"}], [{"name": "x"}]), "models.1.adapters.0.name: 'x' is configured twice"),
        (([{"name": "x", "path": ""}],), "at least 1 character"),
        (([{"name": "x", "lora_path": "/p"}],), "Extra inputs are not permitted"),
    ],
)
def test_bad_adapters_are_refused_with_their_key(adapters: tuple[list[dict[str, Any]], ...], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(models=models(*adapters))
