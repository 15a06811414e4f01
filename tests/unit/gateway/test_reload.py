"""ConfigWatcher.check on real files (no event loop needed)."""

from __future__ import annotations

import os
from pathlib import Path

from gateway.reload import ConfigWatcher, restart_needed
from gateway.settings import Settings, hash_key, load_settings

TENANT = "tenants: [{id: a, api_keys: ['sha256:" + hash_key("k") + "']}]\n"


def test_valid_edit_is_applied_invalid_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(TENANT)
    applied: list[Settings] = []
    counted: list[str] = []
    watcher = ConfigWatcher(path, load_settings(path), applied.append, counted.append)
    assert not watcher.check()  # unchanged

    path.write_text(TENANT.replace("id: a", "id: b"))
    os.utime(path, ns=(1, 10**18))  # a new mtime even within the clock's granularity
    assert watcher.check()
    assert [t.id for t in applied[-1].tenants] == ["b"]

    path.write_text("tenants: [{id: c, api_keys: [plaintext]}]\n")
    os.utime(path, ns=(1, 2 * 10**18))
    assert not watcher.check()
    assert counted == ["ok", "error"]
    assert [t.id for t in watcher.current.tenants] == ["b"]  # the last good one stays


def test_sections_needing_a_restart() -> None:
    old = Settings()
    new = Settings(server={"port": 9999}, tenants=[{"id": "x", "api_keys": ["env:X"]}])  # type: ignore[arg-type]
    assert restart_needed(old, new) == ["server"]


def test_a_key_shared_by_two_tenants_is_refused_on_reload(tmp_path: Path) -> None:
    from gateway.app import Gateway

    path = tmp_path / "c.yaml"
    path.write_text(TENANT)
    gateway = Gateway(load_settings(path), log_dir=tmp_path)
    counted: list[str] = []
    watcher = ConfigWatcher(path, load_settings(path), gateway.apply_settings, counted.append)
    digest = hash_key("k")
    path.write_text(f"tenants: [{{id: a, api_keys: ['sha256:{digest}']}}, {{id: b, api_keys: ['sha256:{digest}']}}]\n")
    os.utime(path, ns=(1, 10**18))
    assert not watcher.check()
    assert counted == ["error"]
    assert set(gateway.tenants) == {"a"}  # unchanged
