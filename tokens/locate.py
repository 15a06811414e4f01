"""Where a model's tokenizer lives: a directory, or a model id in the Hugging Face cache the
replicas read (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ``~/.cache/huggingface/hub``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def tokenizer_directory(reference: str, env: Mapping[str, str]) -> Path | None:
    """``reference`` as a directory: itself when it is one, else the cached snapshot of the
    model id it names (the revision ``refs/main`` points at, or the only snapshot); None
    when neither exists. ``env`` is the replicas' environment (their HF_* variables)."""
    path = Path(reference).expanduser()
    if path.is_dir():
        return path
    if reference.count("/") != 1 or reference.startswith(("/", ".", "~")):
        return None
    repo = hub_cache(env) / ("models--" + reference.replace("/", "--"))
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = snapshots / ref.read_text().strip()
        if snapshot.is_dir():
            return snapshot
    found = sorted(p for p in snapshots.glob("*") if p.is_dir()) if snapshots.is_dir() else []
    return found[0] if len(found) == 1 else None


def hub_cache(env: Mapping[str, str]) -> Path:
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    home = env.get("HOME")
    base = Path(home) if home else Path.home()
    return base / ".cache" / "huggingface" / "hub"
