"""LoRA adapters on a replica: what its ``GET /v1/models`` says it serves.

vLLM lists its base model (``"parent": null``) and every LoRA adapter it has loaded, each
with ``"parent"`` naming the base model it was loaded on (adapters given with
``--lora-modules`` at start and those loaded since through ``POST /v1/load_lora_adapter``):
https://docs.vllm.ai/en/latest/features/lora.html. A request whose ``model`` is an
adapter's name is served with that adapter, so the gateway must send it only to replicas
that list it. The health checker reads the list (``replicas.health``); this module only
parses it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class AdapterSettings(BaseModel):
    """One LoRA adapter of a model (``models[].adapters[]``).

    ``path`` is where a replica can load it from (on the replica's filesystem, or whatever
    vLLM accepts as ``lora_path``): with it, a request for the adapter that no replica
    serves has it loaded on one (``POST /v1/load_lora_adapter``); without it, only
    replicas that already list the adapter serve it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    path: str | None = Field(None, min_length=1)


def served_adapters(listing: Any) -> frozenset[str]:
    """The adapter names in a ``/v1/models`` answer: the entries that name a ``parent``.

    Anything that is not OpenAI's list shape yields no adapters (a server without LoRA
    support, or one that lists models its own way, serves none the gateway can tell).
    """
    if not isinstance(listing, dict):
        return frozenset()
    data = listing.get("data")
    if not isinstance(data, list):
        return frozenset()
    names = set()
    for entry in data:
        if not isinstance(entry, dict):
            continue
        name, parent = entry.get("id"), entry.get("parent")
        if isinstance(name, str) and name and isinstance(parent, str) and parent and parent != name:
            names.add(name)
    return frozenset(names)
