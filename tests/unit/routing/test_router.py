"""The router: pools and fallback chains built from settings, and the policy's view of a
request (prefix keys, session and conversation keys) that it hands each ``Route``."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry

from common.breaker import BreakerConfig, CircuitBreaker
from dialects.base import PromptView
from dialects.openai import CHAT
from replicas.replica import Replica, ReplicaState
from routing.config import CapacitySettings, RoutingSettings
from routing.embedding_head import EmbeddingHead
from routing.metrics import RoutingMetrics
from routing.policies import conversation_key, session_hash
from routing.router import PoolSpec, Router

SYSTEM = "You are the support assistant of a large company; answer politely and precisely. " * 20


def replica(model: str, i: int, state: ReplicaState = ReplicaState.HEALTHY) -> Replica:
    breaker = CircuitBreaker(BreakerConfig(2, 10.0))
    return Replica(f"{model}-{i}", f"http://{model}{i}", model, "t", model, False, breaker, state=state)


def build(
    specs: list[PoolSpec], replicas: dict[str, list[Replica]], head: EmbeddingHead | None = None, **routing: object
) -> tuple[Router, CollectorRegistry]:
    settings = RoutingSettings(**routing)  # type: ignore[arg-type]
    registry = CollectorRegistry()
    router = Router.build(
        settings,
        specs,
        replicas,
        rng=random.Random(1),
        clock=lambda: 0.0,
        metrics=RoutingMetrics(registry, settings.policy),
        head=head,
    )
    return router, registry


def chat(text: str, system: str = "") -> PromptView:
    messages = [{"role": "system", "content": system}] if system else []
    return CHAT.prompt({"messages": [*messages, {"role": "user", "content": text}]})


def test_round_robin_from_config_cycles() -> None:
    rs = {"m": [replica("m", 0), replica("m", 1), replica("m", 2)]}
    router, _ = build([PoolSpec("m", "t")], rs, policy="round_robin")
    route = router.route("m", chat("hi"), 10, 10)
    assert [route(set()).id for _ in range(4)] == ["m-0", "m-1", "m-2", "m-0"]  # type: ignore[union-attr]
    assert route.reason == "round_robin"


def test_prefix_keys_only_where_something_uses_them() -> None:
    rs = {"m": [replica("m", 0)]}
    body = chat("hello", system=SYSTEM)
    affinity, _ = build([PoolSpec("m", "t")], rs)
    assert len(affinity.route_request(body, 100, 10).prefix_keys) > 4
    # Another policy still hashes for the prefill estimate of the capacity bound...
    tokens, _ = build([PoolSpec("m", "t")], rs, policy="least_outstanding_tokens")
    assert len(tokens.route_request(body, 100, 10).prefix_keys) > 4
    # ...and nothing hashes when that bound is off too.
    unbounded = CapacitySettings(max_prefill_tokens=None)
    plain, _ = build([PoolSpec("m", "t")], rs, policy="least_outstanding_tokens", capacity=unbounded)
    assert plain.route_request(body, 100, 10).prefix_keys == ()


def second_turn() -> PromptView:
    """The second turn of the conversation ``chat("a question", system=SYSTEM)`` opens."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "a question"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "another"},
    ]
    return CHAT.prompt({"messages": messages})


def test_a_session_key_reaches_the_policy_as_its_hash() -> None:
    router, _ = build([PoolSpec("m", "t")], {"m": [replica("m", 0)]})
    prompt = chat("a question", system=SYSTEM)
    with_session = router.route_request(prompt, 500, 10, "conversation-7")
    assert with_session.session == session_hash("conversation-7") and with_session.conversation == 0
    without = router.route_request(prompt, 500, 10)
    assert without.session == 0 and without.conversation == conversation_key(prompt.segments) != 0
    # A later turn of the same conversation keeps its key.
    assert router.route_request(second_turn(), 500, 10).conversation == without.conversation


def test_the_policy_learns_where_the_system_prompt_ends_and_whether_a_turn_opens_its_conversation() -> None:
    router, _ = build([PoolSpec("m", "t")], {"m": [replica("m", 0)]})
    first = router.route_request(chat("a long question " * 40, system=SYSTEM), 500, 10)
    system_only = router.route_request(chat("", system=SYSTEM), 500, 10)
    assert first.opens
    # Blocks wholly within the system prompt: every block the system prompt alone fills.
    assert 0 < first.preamble_blocks == len(system_only.prefix_keys) < len(first.prefix_keys)
    turn = router.route_request(second_turn(), 500, 10, "conversation-7")
    assert not turn.opens and turn.preamble_blocks == first.preamble_blocks
    assert router.route_request(chat("no system prompt here " * 40), 500, 10).preamble_blocks == 0
