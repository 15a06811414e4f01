"""API key lookup."""

from __future__ import annotations

import pytest

from gateway.auth import KEY_ID_DIGITS, KeyOwner, KeyRing
from gateway.errors import Unauthorized
from gateway.settings import hash_key


def ring() -> KeyRing:
    keyring, missing = KeyRing.build(
        [
            ("acme", ["sha256:" + hash_key("sk-a"), ("batch", "sha256:" + hash_key("sk-a2"))]),
            ("beta", ["env:BETA_KEY", "env:UNSET_KEY"]),
        ],
        environ={"BETA_KEY": "sk-b"},
    )
    assert missing == ["UNSET_KEY"]
    return keyring


def test_keys_map_to_tenants_and_key_ids() -> None:
    keyring = ring()
    assert keyring.owner_of("Bearer sk-a") == KeyOwner("acme", hash_key("sk-a")[:KEY_ID_DIGITS])
    assert keyring.owner_of("Bearer sk-a2") == KeyOwner("acme", "batch")
    assert keyring.owner_of("bearer sk-b").owner == "beta"
    assert len(keyring) == 3


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic sk-a", "sk-a", "Bearer sk-c"])
def test_bad_credentials_are_401(header: str | None) -> None:
    with pytest.raises(Unauthorized) as info:
        ring().owner_of(header)
    assert info.value.status == 401
    assert info.value.code == "invalid_api_key"
    assert "sk-a" not in info.value.message


def test_one_key_for_two_tenants_is_refused() -> None:
    digest = "sha256:" + hash_key("k")
    with pytest.raises(ValueError, match="both"):
        KeyRing.build([("a", [digest]), ("b", [digest])], environ={})
