"""Cache keys of existing chat and completions requests are the ones the gateway wrote before
the dialect layer (``dialects``): a change of their bytes would empty every shared cache on
upgrade. The expected values were computed with the commit before that layer existed."""

from __future__ import annotations

from typing import Any

import pytest

from cache.keys import exact_key, semantic_query
from dialects.registry import BY_PATH

CASES: list[tuple[str, dict[str, Any], str, str | None, str | None]] = [
    (
        "/v1/chat/completions",
        {
            "model": "m",
            "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
            "temperature": 0,
            "max_tokens": 16,
        },
        "tenant-a:addfe28082fd239d918125a67af16422a590513c02b062a22d4fb6c8d93a3d3e",
        "tenant-a:ac2e98127db4599f670deb02872a653a4ebfeb30fcd68a4d116e6e1b7c0847f4",
        "What is 2+2?",
    ),
    (
        "/v1/chat/completions",
        {
            "model": "auto",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "seed": 7,
            "stop": "x",
            "max_completion_tokens": 9,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        "tenant-a:669b49c918eb573b229d3ba1e922ca91ba7a65271144d7508d0ab2988ea51274",
        None,
        None,
    ),
    (
        "/v1/chat/completions",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "Tools?"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "temperature": 0.0,
            "n": 1,
            "top_p": 1,
        },
        "tenant-a:dc2b45dc82e85cb5038d589095bab0f36e68cb930a88ca597260e80df6ef6072",
        "tenant-a:6270b1454160f45afa73bdd853a2abe19ca541f7b7fc53fb6fe9cb6078623a3d",
        "Tools?",
    ),
    (
        "/v1/completions",
        {"model": "m", "prompt": "Once upon a time", "temperature": 0, "max_tokens": 5},
        "tenant-a:07338913cd74d46c56234a7d00e0038488e1e7245d7f2ee5593ea1235505fd2b",
        "tenant-a:c09fa635646a1e5aa944d01f6b7e39598c025950f0b30215a3bb2cecc7381630",
        "Once upon a time",
    ),
    (
        "/v1/completions",
        {"model": "m", "prompt": ["Only one"], "seed": 1, "echo": False},
        "tenant-a:efaea874a3f4d0214ef77f9e967df89512eea2d143b32abe538cd0953434e389",
        "tenant-a:7b1bbe72e33330c2d1709b4872a6c4f105cafa20b5ac8a13cbef7e38bb5b2624",
        "Only one",
    ),
]


@pytest.mark.parametrize(("endpoint", "body", "key", "scope", "text"), CASES)
def test_keys_are_byte_identical_to_the_pre_dialect_ones(
    endpoint: str, body: dict[str, Any], key: str, scope: str | None, text: str | None
) -> None:
    dialect = BY_PATH[endpoint]
    assert exact_key("tenant-a", body["model"], dialect, body) == key
    query = semantic_query("tenant-a", body["model"], dialect, body)
    assert (query.scope if query else None, query.text if query else None) == (scope, text)
