"""Loading and validating configuration."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings import ConfigError, chunk_gaps, load_settings, settings_digest

ROOT = Path(__file__).resolve().parents[3]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_example_config_loads() -> None:
    settings = load_settings(ROOT / "config.example.yaml")
    assert [m.name for m in settings.models] == ["fleetgate-sim"]
    assert settings.models[0].replicas[0].count == 2
    assert [t.id for t in settings.tenants] == ["dev"]


def test_defaults_describe_a_laptop() -> None:
    settings = load_settings(None)
    assert settings.redis_url is None
    assert settings.models[0].replicas[0].engine == "sim"
    assert settings.uses_dev_tenant
    assert [t.id for t in settings.tenants] == ["dev"]


def test_a_file_without_tenants_gets_no_dev_tenant(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, "server: {port: 9000}\n"))
    assert settings.tenants == []
    assert not settings.uses_dev_tenant


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "server: {port: 9000}\n")
    monkeypatch.setenv("FLEETGATE_SERVER__PORT", "9100")
    monkeypatch.setenv("FLEETGATE_REDIS_URL", "redis://r:6379/0")
    settings = load_settings(path)
    assert settings.server.port == 9100
    assert settings.redis_url == "redis://r:6379/0"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("server: {port: nope}\n", "server.port"),
        ("server: {prot: 1}\n", "server.prot"),
        ("models: [{name: a, replicas: [{url: 'ftp://x'}]}]\n", "models.0.replicas.0"),
        ("models: [{name: a, replicas: [{url: 'http://x', engine: sim}]}]\n", "models.0.replicas.0"),
        ("models: [{name: a, replicas: [{engine: vllm}]}]\n", "models.0.replicas.0"),
        ("models: [{name: auto, replicas: [{engine: sim}]}]\n", "auto"),
        ("tenants: [{id: a, api_keys: [plain-text-key]}]\n", "tenants.0.api_keys"),
        ("tenants: [{id: a, api_keys: ['sha256:abc']}]\n", "tenants.0.api_keys"),
        ("default_model: missing\n", "default_model"),
        ("redis_url: 'redis+cluster://a:7000/1'\n", "redis_url"),
        ("redis_url: 'mysql://a'\n", "redis_url"),
        ("redis: {password_env: A, password_file: /b}\n", "redis"),
        ("models: [{name: a, replicas: [{engine: sim}], chunk_gap_timeout_s: 400}]\n", "models.0.chunk_gap_timeout_s"),
        ("upstream: {chunk_gap_timeout_s: 60, stall_timeout_s: 30}\n", "upstream.chunk_gap_timeout_s"),
        ("bands: [a, a]\n", "bands"),
        ("bands: []\n", "bands"),
        ("bands: [{name: b, max_queued: 0}]\n", "bands.0.max_queued"),
        ("tenants: [{id: t, api_keys: ['env:K'], band: bulk}]\n", "tenants.t.band"),
    ],
)
def test_invalid_config_names_the_key(tmp_path: Path, text: str, where: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, text))
    assert where in str(info.value)


@pytest.mark.parametrize(
    ("semantic", "removed"),
    [
        ("{precision: bfloat16}", ["'precision' was removed: the embedding model always computes in float32"]),
        ("{runtime: torch}", ["'runtime' was removed: the embedding model always runs on ONNX Runtime"]),
        # Even the values that match what now runs: a setting that does nothing is refused, not ignored.
        ("{precision: float32, runtime: onnx}", ["'precision' was removed", "'runtime' was removed"]),
    ],
)
def test_the_removed_embedder_settings_are_refused_with_the_fix(
    tmp_path: Path, semantic: str, removed: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, f"cache: {{semantic: {semantic}}}\n"))
    message = str(info.value)
    assert "cache.semantic: " in message
    assert all(part in message for part in removed)
    assert "from cache.semantic" in message and "delete" in message


def test_yaml_syntax_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_settings(write(tmp_path, "models: [\n"))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_settings(tmp_path / "absent.yaml")


def test_redis_schemes_and_their_shared_settings(tmp_path: Path) -> None:
    text = (
        "redis_url: 'redis+sentinel://s1:26379,s2:26379/fg'\n"
        "redis: {password_env: REDIS_PW, tls_ca_file: /etc/ca.pem}\n"
    )
    settings = load_settings(write(tmp_path, text))
    assert settings.redis.resolve({"REDIS_PW": "pw"}).password == "pw"
    assert settings_digest(settings)["redis"] == "sentinel"


def test_a_models_chunk_gap_falls_back_to_the_upstreams(tmp_path: Path) -> None:
    text = """
upstream: {chunk_gap_timeout_s: 20}
models:
  - {name: slow, replicas: [{engine: sim}], chunk_gap_timeout_s: 90}
  - {name: plain, replicas: [{engine: sim}]}
"""
    settings = load_settings(write(tmp_path, text))
    assert chunk_gaps(settings) == {"slow": 90.0, "plain": 20.0}
    assert settings.upstream.stall_timeout_s == 300.0  # the default bound on any silence


def test_bands_by_name_or_with_their_bounds(tmp_path: Path) -> None:
    settings = load_settings(
        write(
            tmp_path,
            "bands: [gold, {name: bulk, max_wait_s: 60, max_queued: 100}]\n"
            "tenants: [{id: t, api_keys: ['env:K'], band: bulk}, {id: u, api_keys: ['env:K2']}]\n",
        )
    )
    assert [(b.name, b.max_wait_s, b.max_queued) for b in settings.bands] == [("gold", None, None), ("bulk", 60.0, 100)]
    assert [t.band for t in settings.tenants] == ["bulk", None]


def test_default_bands() -> None:
    assert [b.name for b in load_settings(None).bands] == ["interactive", "standard", "batch"]
