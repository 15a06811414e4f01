"""Which replicas publish KV events, and how a managed one is launched publishing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway import build as gateway_build
from gateway.settings import ConfigError, HealthSettings, ModelSettings, ReplicaSettings, RestartSettings, Settings
from replicas.config import EventsEndpoint
from replicas.fleet import Fleet


def fleet(*sources: ReplicaSettings, tokenized: tuple[str, ...] = ("m",)) -> Fleet:
    model = ModelSettings(name="m", replicas=list(sources))
    return Fleet([model], HealthSettings(), restart=RestartSettings(), log_dir=Path("/tmp"), tokenized=tokenized)


def _config(argv: list[str]) -> dict[str, object]:
    loaded: dict[str, object] = json.loads(argv[argv.index("--kv-events-config") + 1])
    return loaded


def test_a_managed_vllm_replica_of_a_tokenized_model_publishes_by_default() -> None:
    f = fleet(ReplicaSettings(engine="vllm", model_path="/m"))
    ((_rid, where),) = f.kv_endpoints.items()
    config = _config(f.processes[0].spec.argv)
    publish = where.endpoint.rsplit(":", 1)[1]
    # vLLM binds only a wildcard PUB address; the gateway connects to it on loopback.
    assert config["endpoint"] == f"tcp://*:{publish}" and where.endpoint == f"tcp://127.0.0.1:{publish}"
    assert config["replay_endpoint"] == where.replay and config["enable_kv_cache_events"] is True


def test_no_events_without_the_tokenizer_opted_out_or_set_by_hand() -> None:
    assert not fleet(ReplicaSettings(engine="vllm", model_path="/m"), tokenized=()).kv_endpoints
    assert not fleet(ReplicaSettings(engine="vllm", model_path="/m", kv_events=False)).kv_endpoints
    own = ReplicaSettings(engine="vllm", model_path="/m", args=["--kv-events-config", "{}"])
    assert not fleet(own).kv_endpoints  # the operator's own config: the gateway does not guess its ports


def test_a_url_replica_names_its_publisher() -> None:
    f = fleet(ReplicaSettings(url="http://h:8000", kv_events="tcp://h:5557", kv_events_replay="tcp://h:5558"))
    assert f.kv_endpoints == {"m-0": EventsEndpoint("tcp://h:5557", "tcp://h:5558")}


def test_a_simulated_replica_publishes_when_asked() -> None:
    f = fleet(ReplicaSettings(engine="sim", kv_events=True, sim={"profile": "h100-llama-3.1-8b"}))  # type: ignore[arg-type]
    argv = f.processes[0].spec.argv
    assert "--kv-events-port" in argv and "--kv-events-replay-port" in argv and "m-0" in f.kv_endpoints


@pytest.mark.parametrize(
    "source",
    [
        {"url": "http://h", "kv_events": "http://h:5557"},  # not a ZMQ endpoint
        {"engine": "vllm", "model_path": "/m", "kv_events": "tcp://h:1"},  # managed: true or false
        {"url": "http://h", "kv_events": True},  # which endpoint?
        {"url": "http://h", "kv_events_replay": "tcp://h:2"},  # replay without the publisher
        {"kubernetes": {"service": "s"}, "kv_events": True},  # not read yet: said, not ignored
    ],
)
def test_bad_kv_events_settings_fail_at_load(source: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ReplicaSettings(**source)  # type: ignore[arg-type]


def test_publishing_without_a_tokenizer_stops_the_start(tmp_path: Path) -> None:
    settings = Settings(
        models=[{"name": "m", "tokenizer": "none", "replicas": [{"url": "http://h", "kv_events": "tcp://h:1"}]}]  # type: ignore[list-item]
    )
    counter = gateway_build.prompt_counter(settings, {})
    with pytest.raises(ConfigError, match=r"models\.m\.replicas\.0\.kv_events: the gateway has no tokenizer"):
        gateway_build.fleet(
            settings, gateway_build.proxy(settings, _metrics(), lambda: 0.0), tmp_path, lambda: 0.0, counter
        )


def _metrics():  # type: ignore[no-untyped-def]
    from gateway.metrics import GatewayMetrics

    return GatewayMetrics()
