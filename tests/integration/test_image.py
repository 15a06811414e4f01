"""The image, without a container runtime: its install script, command and environment.

There is no container engine here, so the test builds what deploy/Dockerfile builds the way
it builds it: scripts/install-image.sh into a fresh virtual environment. It then runs the
image's ENTRYPOINT + CMD with the image's ENV (read from the Dockerfile) on each overlay's
rendered ConfigMap: ``check-config`` passes, and ``serve`` starts, discovers its replicas
through a stand-in API server (no cluster can run here; tests/integration/image_entry.py
says what that changes), answers a request, serves /metrics only on the admin port, and
exits 0 on SIGTERM.

The environment gets the ``kubernetes`` extra only: the overlays' configs do not use the
semantic cache, and the ``semantic`` extra brings torch and sentence-transformers (GBs).
That the check refuses such a config in this very environment is tested below. The
environment is cached under .cache/image-venv/, keyed by pyproject.toml and the script
(dependencies stay; the script reinstalls fleetgate itself from the sources every run).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from replicas.launcher import free_port
from tests.integration.harness import sim_upstream
from tests.integration.k8s_standin import endpoint, endpoint_slice, standin_api_server
from tests.integration.manifests import OVERLAYS, ROOT, gateway_config, image_command, render
from tests.integration.redis_server import RedisServer

SCRIPT = ROOT / "scripts" / "install-image.sh"
EXTRAS = "kubernetes"
NAMESPACE = "inference"
TENANT_KEY = "sk-image-test-tenant"
ADMIN_KEY = "sk-image-test-admin"
START_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def image_venv() -> Iterator[Path]:
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + SCRIPT.read_bytes() + EXTRAS.encode()).hexdigest()
    cache = ROOT / ".cache" / "image-venv"
    venv = cache / key[:16]
    if cache.exists():
        for stale in cache.iterdir():
            if stale != venv:
                shutil.rmtree(stale, ignore_errors=True)
    done = subprocess.run(
        ["bash", str(SCRIPT), "--venv", str(venv), "--extras", EXTRAS, "--python", sys.executable],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    yield venv


def image_env(venv: Path, **extra: str) -> dict[str, str]:
    """The Dockerfile's ENV, with the venv's bin first on PATH (the image's /opt/fleetgate/bin)."""
    env = dict(image_command().env)
    env["PATH"] = env["PATH"].replace("/opt/fleetgate/bin", str(venv / "bin"))
    env.pop("HOME")  # /tmp in the image; here the machine's
    return {**env, "HOME": os.environ.get("HOME", "/tmp"), **extra}


def image_argv(config: Path) -> list[str]:
    argv = image_command().argv
    argv[argv.index("/etc/fleetgate/config.yaml")] = str(config)  # the ConfigMap's mount
    return argv


def write_config(overlay: str, tmp_path: Path) -> Path:
    path = tmp_path / overlay / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(gateway_config(render(overlay)))
    return path


def check_config(venv: Path, config: Path) -> subprocess.CompletedProcess[str]:
    [command, *_] = image_command().argv
    return subprocess.run(
        [command, "check-config", str(config)],
        env=image_env(venv),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=config.parent,
    )


def test_the_image_environment_is_the_gateway_with_its_extras(image_venv: Path) -> None:
    python = image_venv / "bin" / "python"
    probe = "import importlib.util as u; print(*(bool(u.find_spec(m)) for m in ('kubernetes_asyncio', 'torch')))"
    found = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60, cwd="/")
    assert found.stdout.split() == ["True", "False"]
    where = subprocess.run(
        [python, "-c", "import gateway; print(gateway.__file__)"], capture_output=True, text=True, cwd="/", timeout=60
    )
    assert where.stdout.startswith(str(image_venv))  # installed, not the checkout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_config_passes_check_config(image_venv: Path, overlay: str, tmp_path: Path) -> None:
    done = check_config(image_venv, write_config(overlay, tmp_path))
    assert done.returncode == 0, done.stderr
    assert ": ok (" in done.stdout


def test_check_config_refuses_an_extra_the_image_lacks(image_venv: Path, tmp_path: Path) -> None:
    config = yaml.safe_load(gateway_config(render("production")))
    config["tenants"][0]["cache"] = {"semantic": {"enabled": True}}
    path = tmp_path / "semantic.yaml"
    path.write_text(yaml.safe_dump(config))
    done = check_config(image_venv, path)
    assert done.returncode == 2
    assert "tenants.0.cache.semantic.enabled needs the 'semantic' extra, which is not installed" in done.stderr
    assert "Traceback" not in done.stderr


@contextlib.asynccontextmanager
async def image_process(
    venv: Path, config: Path, k8s: str, env: dict[str, str]
) -> AsyncIterator[asyncio.subprocess.Process]:
    entry = ROOT / "tests" / "integration" / "image_entry.py"
    log = (config.parent / "gateway.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        str(venv / "bin" / "python"),
        str(entry),
        k8s,
        NAMESPACE,
        "--",
        *image_argv(config)[1:],
        env=image_env(venv, **env),
        cwd=config.parent,  # the image's WORKDIR is /tmp; nothing may be written elsewhere
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log.close()


async def until_ready(http: aiohttp.ClientSession, url: str, proc: asyncio.subprocess.Process, log: Path) -> None:
    async with asyncio.timeout(START_TIMEOUT_S):
        while True:
            assert proc.returncode is None, log.read_text()  # noqa: ASYNC240 (only when it failed)
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{url}/readyz", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200 and (await r.json())["healthy_replicas"] > 0:
                        return
            await asyncio.sleep(0.2)


@pytest.mark.parametrize("overlay", OVERLAYS)
async def test_image_command_serves_the_overlay_config(
    image_venv: Path, overlay: str, tmp_path: Path, redis_server: RedisServer
) -> None:
    config_path = write_config(overlay, tmp_path)
    config: dict[str, Any] = yaml.safe_load(config_path.read_text())
    [model] = config["models"]
    [source] = model["replicas"]
    port, admin_port = free_port(), free_port()
    env = {
        # What the Deployment sets: the Secret's keys, and in production the Redis URL.
        "ACME_API_KEY": TENANT_KEY,
        "FLEETGATE_ADMIN_KEY": ADMIN_KEY,
        "FLEETGATE_REDIS_URL": redis_server.url,
        # Ports free on this shared machine, in place of 8080 and 9090.
        "FLEETGATE_SERVER__PORT": str(port),
        "FLEETGATE_SERVER__ADMIN_PORT": str(admin_port),
        "FLEETGATE_SERVER__DRAIN_DELAY_S": "0.2",
    }
    service = source["kubernetes"]["service"]
    async with (
        sim_upstream(model["name"]) as upstream,
        standin_api_server() as (k8s, server),
        aiohttp.ClientSession() as http,
    ):
        upstream_port = int(upstream.rsplit(":", 1)[1])
        pod = [endpoint("127.0.0.1", "pod-a")]
        server.apply(endpoint_slice(f"{service}-a", service, upstream_port, pod, namespace=NAMESPACE))
        async with image_process(image_venv, config_path, k8s, env) as proc:
            url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
            await until_ready(http, url, proc, config_path.parent / "gateway.log")
            body = {"model": model["name"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            headers = {"Authorization": f"Bearer {TENANT_KEY}"}
            async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                assert r.headers["x-fleetgate-replica"] == f"{service}-pod-a"
            async with http.get(f"{url}/metrics") as r:
                assert r.status == 404  # not on the API port
            async with http.get(f"{admin}/metrics") as r:
                assert r.status == 200
                assert f'fleetgate_model_healthy_replicas{{model="{model["name"]}"}} 1.0' in await r.text()
            async with http.get(f"{admin}/admin/fleet", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
                assert [x["id"] for x in (await r.json())["replicas"]] == [f"{service}-pod-a"]
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(30):
                assert await proc.wait() == 0
        assert not (tmp_path / overlay / "logs").exists()
