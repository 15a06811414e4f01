"""The multi-turn workload of ``bench/routing_vllm.py`` (pure: seeded text, no engine)."""

from __future__ import annotations

import math

from bench.routing_conversations import ConversationSpec, build_conversations, stable_hash, turn_messages
from bench.routing_vllm import RowResult, multiturn_verdicts, requests_finished, requests_served

WORDS = [f"w{i}" for i in range(50)]


def _cut(texts: list[str]) -> tuple[list[str], int]:
    return [t[:400] for t in texts], 100 * len(texts)


def test_the_conversations_are_seeded_and_their_prompts_zipf_popular() -> None:
    spec = ConversationSpec(prompts=4, prompt_tokens=50, conversations=400, zipf_s=1.0)
    chats = build_conversations(spec, 1, WORDS, _cut)
    assert chats == build_conversations(spec, 1, WORDS, _cut)
    assert chats.systems != build_conversations(spec, 2, WORDS, _cut).systems
    assert all(4 <= len(c.users) <= 6 for c in chats.conversations)
    assert chats.requests == sum(len(c.users) for c in chats.conversations)
    # Weights 1, 1/2, 1/3, 1/4 of 25/12: 48%, 24%, 16%, 12% of 400 conversations.
    counts = [sum(c.system == i for c in chats.conversations) for i in range(4)]
    assert counts[0] > counts[1] > counts[3], counts
    assert 150 <= counts[0] <= 230, counts


def test_each_turn_resends_the_history_with_the_replicas_answers() -> None:
    messages = turn_messages("sys", ["u0", "u1", "u2"], ["a0", "a1"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in messages] == ["sys", "u0", "a0", "u1", "a1", "u2"]
    assert turn_messages("sys", ["u0"], []) == [{"role": "system", "content": "sys"}, {"role": "user", "content": "u0"}]


def test_requests_are_counted_from_vllms_counter_summed_over_finish_reasons() -> None:
    text = (
        "# TYPE vllm:request_success_total counter\n"
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 30.0\n'
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 2.0\n'
        "vllm:prompt_tokens_total 5.0\n"
    )
    assert requests_finished(text) == 32.0
    assert math.isnan(requests_finished("vllm:prompt_tokens_total 5.0\n"))
    before = {"a": (0.0, 0.0, 10.0), "b": (0.0, 0.0, 4.0)}
    assert requests_served(before, {"a": (0.0, 0.0, 85.0), "b": (0.0, 0.0, 29.0)}, ["a", "b"]) == {
        "r0": 75.0,
        "r1": 25.0,
    }
    assert requests_served(before, {"a": (0.0, 0.0, math.nan), "b": (0.0, 0.0, 9.0)}, ["a", "b"]) is None


def test_the_multiturn_bars_ask_for_the_hashs_hit_rate_and_a_spread_of_at_most_60_40() -> None:
    def row(name: str, hit: float, split: tuple[float, float]) -> RowResult:
        return RowResult(
            name, 1, hit, [hit] * 4, [0.1], 0, {}, 1.0, requests_per_replica=dict(zip(("r0", "r1"), split, strict=True))
        )

    # The baseline's shape: the hash's hit rate, three quarters of the requests on one replica.
    verdicts = multiturn_verdicts([row("client_hash", 0.817, (1210, 1208)), row("prefix_affinity", 0.816, (1780, 638))])
    assert [(v[0], v[3]) for v in verdicts] == [
        ("set 1: prefix_affinity hit rate", True),
        ("set 1: prefix_affinity busiest replica", False),
        ("set 1: prefix_affinity errors", True),
    ]
    assert verdicts[1][2] == "73.6% (1780/638)"
    spread = multiturn_verdicts([row("client_hash", 0.817, (1, 1)), row("prefix_affinity", 0.79, (1400, 1018))])
    assert [v[3] for v in spread] == [False, True, True]
    assert stable_hash("s1-c7", 2) == stable_hash("s1-c7", 2)
