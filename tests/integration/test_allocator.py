"""``fleetgate serve`` runs on glibc's malloc (common/allocator.py): a real gateway process and
the managed simulator replica it starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.harness import gateway_process


def environ(pid: int) -> dict[str, str]:
    """The environment a process was started (``execve``) with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.decode().partition("=")[::2] for entry in raw.split(b"\0") if entry)


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_serve_runs_on_malloc_and_its_replicas_on_their_usual_allocator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONMALLOC", raising=False)
    config = {"models": [{"name": "m", "replicas": [{"engine": "sim", "sim": {"ttft_ms": 1}}]}]}
    with gateway_process(config, tmp_path) as gw:
        assert gw.proc is not None
        # The same process (execve keeps the pid), started again with PYTHONMALLOC=malloc.
        assert environ(gw.proc.pid).get("PYTHONMALLOC") == "malloc"
        replicas = children(gw.proc.pid)
        assert replicas  # the managed simulator
        for pid in replicas:
            assert "PYTHONMALLOC" not in environ(pid)


def test_an_allocator_chosen_in_the_environment_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONMALLOC", "pymalloc")
    config = {"models": [{"name": "m", "replicas": [{"engine": "sim", "sim": {"ttft_ms": 1}}]}]}
    with gateway_process(config, tmp_path) as gw:
        assert gw.proc is not None
        assert environ(gw.proc.pid).get("PYTHONMALLOC") == "pymalloc"
        assert all(environ(pid).get("PYTHONMALLOC") == "pymalloc" for pid in children(gw.proc.pid))
