"""vLLM's KV-cache events on the wire: one published batch decoded into plain values.

vLLM (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``) publishes each scheduler
step's cache changes as a three-frame ZMQ message ``(topic, seq, payload)``: the topic
(``kv_events_config.topic``, empty by default), an 8-byte big-endian sequence number that
counts batches from 0 since the engine started, and the batch encoded by msgspec's msgpack
encoder. The batch is an array ``[ts, events, data_parallel_rank]`` (``array_like``); each
event is a map tagged ``{"type": "BlockStored", ...}`` (msgspec's ``tag=True``), or, in vLLM
releases before 0.11, an array ``["BlockStored", block_hashes, ...]``: both are read.

- ``BlockStored``: blocks that became cached, in chain order: their hashes, the hash of the
  block before the first one (None: they start a prompt), their token ids (``block_size``
  per block), the LoRA adapter's name and per-block extra keys (multimodal inputs, a
  cache salt), which the engine hashed with the tokens.
- ``BlockRemoved``: blocks evicted.
- ``AllBlocksCleared``: the whole cache reset (``/reset_prefix_cache``).

A block hash is bytes (sha256 family) or an int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``);
either is kept as it came, only compared. Pure: no sockets here (``routing.kv_subscriber``
reads them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


def _unpackb(payload: bytes) -> Any:
    # Imported on first use: routing's request path (policies -> kv_index) loads this module's
    # types, and a gateway whose replicas publish nothing never needs the codec.
    import msgpack  # type: ignore[import-untyped]  # no annotations

    unpack: Callable[..., Any] = msgpack.unpackb
    try:
        return unpack(payload, raw=False, strict_map_key=False)
    except msgpack.UnpackException as exc:  # OutOfData (a cut frame) is no ValueError
        raise ValueError(str(exc) or type(exc).__name__) from exc


def _packb(obj: Any) -> bytes:
    import msgpack

    pack: Callable[..., bytes] = msgpack.packb
    return pack(obj, use_bin_type=True)


# The sequence frame's width, and the replay socket's end-of-replay marker (seq -1).
SEQ_BYTES = 8
END_OF_REPLAY = -1

EngineHash = bytes | int


class KvEventDecodeError(ValueError):
    """A frame that is not a vLLM KV event batch (counted and dropped by the subscriber)."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    # One entry per block (None where a block has none); any entry set means the engine's
    # hash covers more than the tokens (an image, a cache salt) that the gateway cannot see.
    extra_keys: tuple[Any, ...] | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published batch: its sequence number, the engine's timestamp and its events."""

    seq: int
    ts: float
    events: tuple[KvEvent, ...]


def decode_seq(frame: bytes) -> int:
    """The sequence frame's number (-1 marks the end of a replay)."""
    if len(frame) != SEQ_BYTES:
        raise KvEventDecodeError(f"sequence frame of {len(frame)} bytes, expected {SEQ_BYTES}")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(seq: int, payload: bytes) -> EventBatch:
    """The batch in ``payload`` (msgpack), or ``KvEventDecodeError``."""
    try:
        raw = _unpackb(payload)
    except ValueError as exc:
        raise KvEventDecodeError(f"not msgpack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KvEventDecodeError("a batch is an array [ts, events, ...]")
    ts = raw[0]
    if not isinstance(ts, int | float):
        raise KvEventDecodeError("a batch's timestamp is a number")
    return EventBatch(seq, float(ts), tuple(_event(e) for e in raw[1]))


# Field order of the array form (vLLM < 0.11, ``array_like=True`` events).
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _event(raw: Any) -> KvEvent:
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _ARRAY_FIELDS.get(kind, ())
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise KvEventDecodeError(f"an event is a tagged map or array, not {type(raw).__name__}")
    try:
        if kind == "BlockStored":
            extra = fields.get("extra_keys")
            return BlockStored(
                block_hashes=_hashes(fields["block_hashes"]),
                parent_block_hash=_hash_or_none(fields.get("parent_block_hash")),
                token_ids=tuple(int(t) for t in fields["token_ids"]),
                block_size=int(fields["block_size"]),
                lora_name=fields.get("lora_name"),
                extra_keys=tuple(extra) if extra and any(k for k in extra) else None,
                medium=fields.get("medium"),
            )
        if kind == "BlockRemoved":
            return BlockRemoved(_hashes(fields["block_hashes"]), fields.get("medium"))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
    except (KeyError, TypeError, ValueError) as exc:
        raise KvEventDecodeError(f"malformed {kind}: {exc!r}") from exc
    raise KvEventDecodeError(f"unknown event type {kind!r}")


def _hashes(raw: Sequence[Any]) -> tuple[EngineHash, ...]:
    out = tuple(raw)
    for h in out:
        if not isinstance(h, bytes | int):
            raise TypeError(f"a block hash is bytes or an int, not {type(h).__name__}")
    return out


def _hash_or_none(raw: Any) -> EngineHash | None:
    if raw is None or isinstance(raw, bytes | int):
        return raw
    raise TypeError(f"a parent block hash is bytes, an int or nil, not {type(raw).__name__}")


def encode_batch(ts: float, events: Sequence[KvEvent], data_parallel_rank: int = 0) -> bytes:
    """``events`` as vLLM 0.32 encodes them (the simulator's publisher and the tests write this)."""
    out: list[Any] = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(
                {
                    "type": "BlockStored",
                    "block_hashes": list(e.block_hashes),
                    "parent_block_hash": e.parent_block_hash,
                    "token_ids": list(e.token_ids),
                    "block_size": e.block_size,
                    "lora_id": None,
                    "medium": e.medium,
                    "lora_name": e.lora_name,
                    **({"extra_keys": list(e.extra_keys)} if e.extra_keys else {}),
                }
            )
        elif isinstance(e, BlockRemoved):
            out.append({"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium})
        else:
            out.append({"type": "AllBlocksCleared"})
    return _packb([ts, out, data_parallel_rank])


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)
