"""Replica sources: credentials, static headers, the upstream's model name, the probe kind."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.settings import HealthSettings, ModelSettings, ReplicaSettings, RestartSettings
from replicas.credentials import CredentialError, resolve_key, upstream_headers
from replicas.fleet import Fleet
from replicas.replica import ReplicaState


def build(*sources: ReplicaSettings, environ: dict[str, str] | None = None) -> Fleet:
    model = ModelSettings(name="m", replicas=list(sources))
    return Fleet([model], HealthSettings(), restart=RestartSettings(), log_dir=Path("/tmp"), environ=environ or {})


def test_key_from_the_environment_or_a_file(tmp_path: Path) -> None:
    assert resolve_key("env:UP_KEY", {"UP_KEY": " sk-up \n"}) == "sk-up"
    secret = tmp_path / "key"
    secret.write_text("sk-from-file\n")
    assert resolve_key(str(secret), {}) == "sk-from-file"
    with pytest.raises(CredentialError, match="UP_KEY is not set"):
        resolve_key("env:UP_KEY", {})
    with pytest.raises(CredentialError, match="cannot read"):
        resolve_key(str(tmp_path / "missing"), {})
    secret.write_text("  \n")
    with pytest.raises(CredentialError, match="empty"):
        resolve_key(str(secret), {})


def test_headers_carry_the_key_as_a_bearer_token() -> None:
    headers = upstream_headers("env:K", {"OpenAI-Organization": "org-1"}, {"K": "sk-x"})
    assert headers == {"OpenAI-Organization": "org-1", "Authorization": "Bearer sk-x"}
    assert upstream_headers(None, {}, {}) == {}
    with pytest.raises(CredentialError, match="one line"):
        upstream_headers("env:K", {}, {"K": "sk-x\r\nX-Evil: 1"})


def test_replicas_get_their_source_settings_and_never_show_the_key() -> None:
    fleet = build(
        ReplicaSettings(url="https://hosted.example", api_key="env:HOSTED", upstream_model="gpt-x", probe="models"),
        ReplicaSettings(url="http://plain:8000", probe="none"),
        environ={"HOSTED": "sk-secret-hosted"},
    )
    hosted, plain = fleet.by_model["m"]
    assert hosted.served_model == "gpt-x" and hosted.model == "m"
    assert hosted.upstream_headers == {"Authorization": "Bearer sk-secret-hosted"}
    assert hosted.probe == "models" and hosted.scrape_metrics is False
    assert hosted.state is ReplicaState.STARTING
    # Not probed: routable at once (the breaker alone takes it out).
    assert plain.probe == "none" and plain.state is ReplicaState.HEALTHY and not plain.scrape_metrics
    assert "sk-secret-hosted" not in repr(hosted)
    assert "sk-secret-hosted" not in str(hosted.snapshot(0.0))


def test_discovered_replicas_get_their_source_settings() -> None:
    fleet = build(
        ReplicaSettings(kubernetes={"service": "vllm"}, api_key="env:K", upstream_model="served"),  # type: ignore[arg-type]
        environ={"K": "sk-k8s"},
    )
    fleet.sync("m", {"pod-1": "http://10.0.0.1:8000"})
    (pod,) = fleet.by_model["m"]
    assert pod.served_model == "served" and pod.upstream_headers == {"Authorization": "Bearer sk-k8s"}
    assert pod.scrape_metrics and pod.probe == "health"


def test_an_unset_key_variable_fails_the_build_naming_the_source() -> None:
    with pytest.raises(CredentialError, match=r"models\.m\.replicas\.1\.api_key: the variable NOPE is not set"):
        build(ReplicaSettings(url="http://a:1"), ReplicaSettings(url="http://b:1", api_key="env:NOPE"))


def test_metrics_defaults_per_source() -> None:
    assert ReplicaSettings(engine="sim").scrapes_metrics
    assert ReplicaSettings(url="http://a:1").scrapes_metrics
    assert not ReplicaSettings(url="http://a:1", probe="models").scrapes_metrics
    assert not ReplicaSettings(url="http://a:1", metrics=False).scrapes_metrics
    assert ReplicaSettings(url="http://a:1", probe="none", metrics=True).scrapes_metrics


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"url": "http://a:1", "api_key": "sk-plaintext"}, "never the key itself"),
        ({"url": "http://a:1", "api_key": "env:"}, "never the key itself"),
        ({"url": "http://a:1", "headers": {"Content-Length": "1"}}, "set by the gateway"),
        ({"url": "http://a:1", "headers": {"Bad Name": "1"}}, "not a valid header name"),
        ({"url": "http://a:1", "headers": {"X-A": "1\r\nX-B: 2"}}, "one line"),
        ({"url": "http://a:1", "api_key": "env:K", "headers": {"authorization": "x"}}, "not both"),
        ({"engine": "sim", "probe": "none"}, "managed one is probed"),
    ],
)
def test_invalid_sources_are_refused(fields: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        ReplicaSettings(**fields)  # type: ignore[arg-type]


def test_priority_scheduling_replicas_and_the_vllm_flag() -> None:
    fleet = build(
        ReplicaSettings(engine="vllm", model_path="/models/m", scheduling_policy="priority"),
        ReplicaSettings(engine="vllm", model_path="/models/m", args=["--scheduling-policy", "priority"]),
        ReplicaSettings(url="http://plain:8000", scheduling_policy="priority"),
        ReplicaSettings(url="http://fcfs:8000"),
    )
    managed, own_args, external, fcfs = fleet.by_model["m"]
    assert [r.priority_scheduling for r in (managed, own_args, external, fcfs)] == [True, False, True, False]
    argv = [p.spec.argv for p in fleet.processes]
    assert argv[0][-2:] == ["--scheduling-policy", "priority"]
    # Given in the replica's own args, the flag is not repeated.
    assert argv[1].count("--scheduling-policy") == 1


def test_a_flag_that_contradicts_scheduling_policy_is_refused() -> None:
    with pytest.raises(ValidationError, match="scheduling_policy"):
        ReplicaSettings(engine="vllm", model_path="/m", scheduling_policy="priority", args=["--scheduling-policy=fcfs"])
