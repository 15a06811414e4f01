"""Decoding vLLM's KV-cache event batches, from vLLM 0.32's own encoder (tests/data/vllm_kv_events.json,
written by vLLM's ``KVEventBatch`` structs and msgspec encoder) and the older array form."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from replicas.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventDecodeError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)

VECTORS = json.loads((Path(__file__).parents[2] / "data" / "vllm_kv_events.json").read_text())


def _vllm(i: int) -> bytes:
    return bytes.fromhex(VECTORS["batches"][i])


def test_a_vllm_block_stored_batch_decodes() -> None:
    batch = decode_batch(0, _vllm(0))
    assert batch.seq == 0 and batch.ts == 1.5
    assert batch.events == (
        BlockStored(
            block_hashes=(111, 222),
            parent_block_hash=None,
            token_ids=(1, 2, 3, 4, 5, 6, 7, 8),
            block_size=4,
            lora_name=None,
            extra_keys=None,  # [None, None]: no block has extra keys
            medium="GPU",
        ),
    )


def test_bytes_hashes_lora_and_removal_decode() -> None:
    batch = decode_batch(1, _vllm(1))
    stored, removed = batch.events
    assert stored == BlockStored((b"\x01" * 32,), 222, (9, 10, 11, 12), 4, "sql", None, "GPU")
    assert removed == BlockRemoved((222,), "GPU")


def test_all_blocks_cleared_decodes() -> None:
    assert decode_batch(2, _vllm(2)).events == (AllBlocksCleared(),)


def test_the_array_form_of_older_vllm_decodes() -> None:
    payload = msgpack.packb(
        [0.0, [["BlockStored", [5], None, [1, 2], 2, None, "GPU"], ["BlockRemoved", [5], "GPU"], ["AllBlocksCleared"]]]
    )
    assert decode_batch(3, payload).events == (
        BlockStored((5,), None, (1, 2), 2, None, None, "GPU"),
        BlockRemoved((5,), "GPU"),
        AllBlocksCleared(),
    )


def test_our_encoding_reads_back_and_matches_vllms_bytes() -> None:
    events = decode_batch(0, _vllm(0)).events
    assert decode_batch(0, encode_batch(1.5, events)).events == events
    cleared = decode_batch(2, _vllm(2))
    assert encode_batch(3.5, cleared.events) == _vllm(2)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never used in msgpack
        msgpack.packb({"ts": 1}),
        msgpack.packb([1.0, [{"type": "Nope"}]]),
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),  # no token ids
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]]),
        msgpack.packb(["x", []]),
    ],
)
def test_malformed_batches_raise_the_decode_error(payload: bytes) -> None:
    with pytest.raises(KvEventDecodeError):
        decode_batch(0, payload)


def test_sequence_frames() -> None:
    assert decode_seq(encode_seq(7)) == 7
    assert decode_seq((7).to_bytes(8, "big")) == 7
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == -1
    with pytest.raises(KvEventDecodeError):
        decode_seq(b"\x00\x01")
