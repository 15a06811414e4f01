"""What a replica's ``/v1/models`` says about its LoRA adapters (``replicas.lora``)."""

from __future__ import annotations

from replicas.lora import served_adapters

# vLLM 0.32's answer with one adapter from --lora-modules and one loaded at run time (trimmed).
VLLM_LISTING = {
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
    for listing in (None, [], "x", {"data": "x"}, {"data": [1, None, {"id": 3, "parent": "m"}]}):
        assert served_adapters(listing) == frozenset()
    # An entry naming itself as parent, or with an empty parent, is no adapter.
    assert served_adapters({"data": [{"id": "m", "parent": "m"}, {"id": "a", "parent": ""}]}) == frozenset()
