"""LoRA adapters in the simulator, as vLLM serves them.

The same flags and variable as vLLM, so one replica configuration serves either engine:
``--enable-lora`` turns LoRA on, ``--lora-modules name=path ...`` loads adapters at start,
and with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` in the environment
``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) loads one at run time
(the route does not exist otherwise: a 404, as vLLM's). ``/v1/models`` lists each adapter
with ``parent`` naming the served model, and chat and completions answer a request whose
``model`` is a loaded adapter (the generation is the base model's: the simulator has no
weights to adapt). vLLM's refusals are reproduced: a missing name or path (400), an adapter
already loaded (400), a path with nothing at it (404). Loads are counted (``loads``) so tests
can tell how many reached the replica; ``load_s`` makes each take that long.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from sim.wire import MODEL_KEY, Rejection, invalid, openai_error, read_body

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass
class LoraState:
    """The adapters a simulated replica serves (name -> path) and how it loads more."""

    enabled: bool = False
    modules: dict[str, str] = field(default_factory=dict)
    # Seconds a load takes (vLLM reads the adapter's weights from disk).
    load_s: float = 0.0
    loads: int = 0


LORA_KEY = web.AppKey("lora", LoraState)


def runtime_updating(environ: Mapping[str, str]) -> bool:
    """vLLM's reading of ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: "1" or "true", any case."""
    return environ.get(RUNTIME_ENV, "0").strip().lower() in ("1", "true")


def parse_modules(values: list[str]) -> dict[str, str]:
    """``--lora-modules`` values, ``name=path`` each (vLLM also takes JSON; the simulator does not)."""
    modules = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, not {value!r}")
        modules[name] = path
    return modules


def served_name(app: web.Application, body: dict[str, Any]) -> str:
    """The name a generation request is served under: its adapter's when it names one
    loaded here, else the base model's (whose check then refuses other names)."""
    model = body.get("model")
    if isinstance(model, str) and model in app[LORA_KEY].modules:
        return model
    return app[MODEL_KEY]


def model_cards(app: web.Application) -> list[dict[str, Any]]:
    """The adapters' entries of ``/v1/models``, shaped as vLLM's."""
    served = app[MODEL_KEY]
    return [
        {"id": name, "object": "model", "created": 0, "owned_by": "vllm", "root": path, "parent": served}
        for name, path in app[LORA_KEY].modules.items()
    ]


async def load_lora_adapter(request: web.Request) -> web.Response:
    body = await read_body(request)
    if isinstance(body, Rejection):
        return openai_error(body)
    state = request.app[LORA_KEY]
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not isinstance(path, str):
        return openai_error(invalid("lora_name and lora_path must be strings"))
    if not name or not path:
        return openai_error(Rejection(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"))
    if name == request.app[MODEL_KEY]:
        return openai_error(
            Rejection(400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput")
        )
    if name in state.modules:
        message = (
            f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
            "set 'load_inplace' to True."
        )
        return openai_error(Rejection(400, message, "InvalidUserInput"))
    if not state.enabled:
        disabled = "LoRA is not enabled. Use --enable-lora to enable LoRA."
        return openai_error(Rejection(500, disabled, "InternalServerError"))
    state.loads += 1
    if state.load_s:
        await asyncio.sleep(state.load_s)
    # A stat of a local path: not worth a thread in a simulator.
    if not os.path.isdir(path):  # noqa: ASYNC240
        return openai_error(Rejection(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError"))
    state.modules[name] = path
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")
