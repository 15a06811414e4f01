"""Profile parsing (clear errors naming the key), the shipped profiles, and session behaviour."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest

from capacity.workload import (
    CHARS_PER_TOKEN,
    PROFILES_DIR,
    Session,
    Workload,
    WorkloadError,
    load_workload,
    make_text,
    parse_workload,
    request_sizes,
)


def _profile(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "t",
        "prefixes": {"system": {"tokens": 100}},
        "classes": [
            {
                "name": "a",
                "share": 0.5,
                "prompt_tokens": 50,
                "output_tokens": {"dist": "uniform", "min": 10, "max": 20},
            },
            {"name": "b", "share": 0.5, "prompt_tokens": 80, "output_tokens": 30, "prefix": {"name": "system"}},
        ],
    }
    base.update(overrides)
    return base


@pytest.mark.parametrize(
    "name", ["chat-assistant", "coding-assistant", "short-long-mix", "rtx3060-reproduction", "prefix-gap"]
)
def test_shipped_profiles_load(name: str) -> None:
    workload = load_workload(name)
    assert workload.name == name
    assert (PROFILES_DIR / f"{name}.yaml").exists()


def test_bare_numbers_are_fixed_distributions() -> None:
    w = parse_workload(_profile())
    assert w.classes[0].prompt_tokens.sample(random.Random(0)) == 50


def test_unknown_key_is_named_with_its_path() -> None:
    data = _profile()
    data["classes"][1]["promt_tokens"] = 5
    with pytest.raises(WorkloadError, match=r"classes\[1\]\.promt_tokens: Extra inputs are not permitted"):
        parse_workload(data, "x.yaml")


def test_missing_key_is_named_with_its_path() -> None:
    data = _profile()
    del data["classes"][0]["output_tokens"]
    with pytest.raises(WorkloadError, match=r"^x\.yaml: classes\[0\]\.output_tokens: Field required"):
        parse_workload(data, "x.yaml")


def test_bad_distribution_field_names_the_field_not_the_tag() -> None:
    data = _profile()
    data["classes"][0]["output_tokens"] = {"dist": "uniform", "min": 10}
    with pytest.raises(WorkloadError, match=r"classes\[0\]\.output_tokens\.max: Field required"):
        parse_workload(data)
    data["classes"][0]["output_tokens"] = {"dist": "uniform", "min": 30, "max": 10}
    with pytest.raises(WorkloadError, match=r"classes\[0\]\.output_tokens: Value error, max \(10.0\) is below min"):
        parse_workload(data)
    data["classes"][0]["output_tokens"] = {"dist": "poisson", "mean": 3}
    with pytest.raises(WorkloadError, match=r"classes\[0\]\.output_tokens: Input tag 'poisson'"):
        parse_workload(data)


def test_shares_must_add_up_and_prefixes_must_exist() -> None:
    data = _profile()
    data["classes"][0]["share"] = 0.7
    with pytest.raises(WorkloadError, match=r"shares add up to 1\.2"):
        parse_workload(data)
    data = _profile()
    data["classes"][1]["prefix"]["name"] = "repo"
    with pytest.raises(WorkloadError, match=r"classes\[1\]\.prefix\.name: unknown prefix 'repo' \(known: system\)"):
        parse_workload(data)


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match=r"no profile 'nope' .*shipped: .*chat-assistant"):
        load_workload("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(WorkloadError, match="not valid YAML"):
        load_workload(bad)
    bad.write_text("- a list")
    with pytest.raises(WorkloadError, match="a profile is a mapping"):
        load_workload(bad)


def test_make_text_has_the_requested_length_and_tag() -> None:
    text = make_text(100, random.Random(1), tag="u1")
    assert len(text) == 100 * CHARS_PER_TOKEN
    assert text.startswith("[u1] ")
    long = make_text(300_000, random.Random(2))  # longer than the corpus: wraps around
    assert len(long) == 1_200_000
    assert make_text(0, random.Random(3)) == ""


def _workload(**cls: Any) -> Workload:
    data = {
        "name": "s",
        "prefixes": {"system": {"tokens": 50, "variants": 1}},
        "classes": [{"name": "c", "share": 1.0, "prompt_tokens": 20, "output_tokens": 10, **cls}],
    }
    return parse_workload(data)


def test_session_grows_turn_by_turn_and_shares_the_prefix() -> None:
    w = _workload(turns=3, context_tokens=100, prefix={"name": "system"})
    one = Session(w, w.classes[0], random.Random(1), tag="u1", namespace="run")
    two = Session(w, w.classes[0], random.Random(2), tag="u2", namespace="run")
    first = one.next_request()
    assert first is not None and first.opens_with_prefix and first.prefix_key == "system#0"
    # system 50 tokens + first message: 100 tokens of context + newline + 20 tokens
    assert first.messages[0]["role"] == "system"
    assert len(first.messages[1]["content"]) == (100 + 20) * CHARS_PER_TOKEN + 1
    other = two.next_request()
    assert other is not None and other.messages[0] == first.messages[0]  # the same shared copy
    one.record_answer("answer one")
    second = one.next_request()
    assert second is not None and not second.opens_with_prefix
    assert [m["role"] for m in second.messages] == ["system", "user", "assistant", "user"]
    assert second.estimated_prompt_tokens > first.estimated_prompt_tokens
    one.record_answer("answer two")
    assert one.next_request() is not None
    one.record_answer("answer three")
    assert one.next_request() is None


def test_user_data_before_the_prefix_makes_every_session_cold() -> None:
    w = _workload(prefix={"name": "system", "user_data_tokens": 10, "user_data": "before"})
    spec = Session(w, w.classes[0], random.Random(1), tag="u1").next_request()
    assert spec is not None and spec.opens_with_prefix and spec.prefix_key is None
    assert spec.messages[0]["content"].startswith("[user u1]")


def test_unshared_share_gets_a_unique_opening() -> None:
    w = _workload(prefix={"name": "system", "share": 0.0})
    spec = Session(w, w.classes[0], random.Random(1), tag="u1").next_request()
    assert spec is not None and spec.prefix_key is None
    assert spec.messages[0]["content"].startswith("[u1-own]")


def test_context_limit_cuts_the_oldest_history_and_keeps_the_system_prompt() -> None:
    w = _workload(turns=20, prompt_tokens=400, output_tokens=100)
    w = w.model_copy(update={"context_limit_tokens": 2000})
    s = Session(w, w.classes[0], random.Random(1), tag="u1")
    roles: list[str] = []
    for _ in range(10):
        spec = s.next_request()
        assert spec is not None
        assert spec.estimated_prompt_tokens + spec.max_tokens <= 2000
        roles = [m["role"] for m in spec.messages]
        s.record_answer(make_text(100, random.Random(0)))
    # ten turns of ~500 tokens cannot all fit in 2,000: the oldest went, roles still alternate
    assert len(roles) < 19
    assert roles[-1] == "user" and all(a != b for a, b in itertools.pairwise(roles))


def test_coding_profile_request_sizes_follow_the_70_20_10_mix() -> None:
    sizes = request_sizes(load_workload("coding-assistant"), 300, random.Random(5))
    assert 5_000 <= min(sizes["short"]) and max(sizes["short"]) <= 50_000
    assert 15_000 <= min(sizes["medium"]) and max(sizes["medium"]) <= 120_000
    assert min(sizes["large"]) >= 75_000 and max(sizes["large"]) <= 130_000
