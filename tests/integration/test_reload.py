"""Editing the config file applies tenants within 2 s, without a restart; a bad file is
refused whole; SIGHUP reloads at once; a Kubernetes ConfigMap's symlink swap is seen."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.settings import hash_key
from tests.integration.harness import API_KEY, GatewayProcess, gateway_process, tenants

NEW_KEY = "sk-test-added"
MODEL = "m"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}


def base_config() -> dict[str, Any]:
    return {"models": [{"name": MODEL, "replicas": [{"engine": "sim", "sim": {"ttft_ms": 1}}]}]}


def status(gw: GatewayProcess, key: str) -> int:
    return httpx.post(
        f"{gw.url}/v1/chat/completions", json=BODY, headers={"Authorization": f"Bearer {key}"}
    ).status_code


def until(predicate, timeout: float = 2.0) -> float | None:  # type: ignore[no-untyped-def]
    """Seconds until ``predicate()`` held, or None if it did not within ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def reloads(gw: GatewayProcess, result: str) -> float:
    for line in httpx.get(f"{gw.url}/metrics").text.splitlines():
        if line.startswith(f'fleetgate_config_reloads_total{{result="{result}"}}'):
            return float(line.split()[-1])
    return 0.0


def rewrite(gw: GatewayProcess, config: dict[str, Any]) -> None:
    tmp = gw.config_path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(config))
    os.replace(tmp, gw.config_path)


def test_tenant_edits_apply_live_and_bad_files_are_refused(tmp_path: Path) -> None:
    with gateway_process(base_config(), tmp_path) as gw:
        config = yaml.safe_load(gw.config_path.read_text())
        assert status(gw, NEW_KEY) == 401

        # add a key and a limit: live within 2 s
        config["tenants"][0]["api_keys"].append("sha256:" + hash_key(NEW_KEY))
        config["tenants"][0]["limits"] = {"requests_per_minute": 2}
        rewrite(gw, config)
        assert until(lambda: status(gw, NEW_KEY) == 200) is not None
        assert reloads(gw, "ok") == 1
        statuses = [status(gw, API_KEY) for _ in range(3)]
        assert 429 in statuses  # the new limit is in force

        # a broken file: refused whole, the last good config keeps serving
        gw.config_path.write_text("tenants: [\n")
        assert until(lambda: reloads(gw, "error") == 1) is not None
        assert status(gw, NEW_KEY) in (200, 429)
        # a file that parses but does not validate: also refused
        bad = dict(config, tenants=[{"id": "x", "api_keys": ["plain-text"]}])
        rewrite(gw, bad)
        assert until(lambda: reloads(gw, "error") == 2) is not None
        assert status(gw, NEW_KEY) in (200, 429)
        assert "config reload refused" in gw.stderr_path.read_text()


def test_sighup_reloads_at_once(tmp_path: Path) -> None:
    with gateway_process(base_config(), tmp_path) as gw:
        config = yaml.safe_load(gw.config_path.read_text())
        config["tenants"] = [t for t in tenants() if t["id"] != "t1"]
        # same size and mtime kept: only SIGHUP can notice it
        st = gw.config_path.stat()
        gw.config_path.write_text(yaml.safe_dump(config))
        os.utime(gw.config_path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert gw.proc is not None
        gw.proc.send_signal(signal.SIGHUP)
        assert until(lambda: status(gw, API_KEY) == 401, timeout=1.0) is not None


def test_configmap_symlink_swap(tmp_path: Path) -> None:
    """The layout kubelet writes for a ConfigMap volume: config.yaml -> ..data/config.yaml,
    ..data -> ..<timestamp>; an update writes a new timestamped dir and renames a new
    ..data symlink over the old one."""
    gw = GatewayProcess(base_config(), tmp_path)
    mount = tmp_path / "configmap"
    mount.mkdir()
    first = mount / "..2026_11_21_10_00_00.000000001"
    first.mkdir()
    (first / "config.yaml").write_text(gw.config_path.read_text())
    os.symlink(first.name, mount / "..data")
    os.symlink("..data/config.yaml", mount / "config.yaml")
    gw.config_path = mount / "config.yaml"
    gw.start()
    try:
        assert status(gw, NEW_KEY) == 401
        config = yaml.safe_load((first / "config.yaml").read_text())
        config["tenants"][0]["api_keys"].append("sha256:" + hash_key(NEW_KEY))
        second = mount / "..2026_11_21_10_05_00.000000002"
        second.mkdir()
        (second / "config.yaml").write_text(yaml.safe_dump(config))
        os.symlink(second.name, mount / "..data_tmp")
        os.replace(mount / "..data_tmp", mount / "..data")
        assert until(lambda: status(gw, NEW_KEY) == 200) is not None
    finally:
        gw.stop()
