"""What each answered item adds to its batch's usage, read as its API reports it."""

from __future__ import annotations

from typing import Any

import openai.types
import pytest

from batch.usage import ZERO, Usage, usage_of


@pytest.mark.parametrize(
    ("endpoint", "usage", "expected"),
    [
        ("/v1/chat/completions", {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}, Usage(12, 5)),
        (
            "/v1/chat/completions",
            {
                "prompt_tokens": 40,
                "completion_tokens": 9,
                "total_tokens": 49,
                "prompt_tokens_details": {"cached_tokens": 32},
                "completion_tokens_details": {"reasoning_tokens": 4},
            },
            Usage(40, 9, 32, 4),
        ),
        # vLLM sends the details as null when it does not count them.
        ("/v1/completions", {"prompt_tokens": 3, "completion_tokens": 8, "prompt_tokens_details": None}, Usage(3, 8)),
        ("/v1/embeddings", {"prompt_tokens": 6, "total_tokens": 6}, Usage(6, 0)),
        (
            "/v1/responses",
            {
                "input_tokens": 20,
                "output_tokens": 7,
                "total_tokens": 27,
                "input_tokens_details": {"cached_tokens": 16},
                "output_tokens_details": {"reasoning_tokens": 3},
            },
            Usage(20, 7, 16, 3),
        ),
        # Anthropic's input tokens leave out cache reads and writes; the batch's input has them.
        (
            "/v1/messages",
            {"input_tokens": 5, "output_tokens": 2, "cache_read_input_tokens": 8, "cache_creation_input_tokens": 1},
            Usage(5 + 8 + 1, 2, 8, 0),
        ),
        ("/v1/messages", {"input_tokens": 5, "output_tokens": 2}, Usage(5, 2)),
    ],
)
def test_each_api_reports_its_usage(endpoint: str, usage: dict[str, Any], expected: Usage) -> None:
    assert usage_of(endpoint, {"id": "x", "usage": usage}) == expected


@pytest.mark.parametrize(
    "answer",
    [
        {"id": "x"},
        {"usage": None},
        {"usage": "12 tokens"},
        {"usage": {"prompt_tokens": "12", "completion_tokens": -1}},
        {"usage": {"prompt_tokens": True, "completion_tokens": 2.5}},
        "a body that is not JSON",
        [1, 2],
    ],
)
def test_an_answer_without_counts_adds_nothing(answer: Any) -> None:
    assert usage_of("/v1/chat/completions", answer) == ZERO


def test_an_endpoint_no_batch_serves_adds_nothing() -> None:
    assert usage_of("/v1/images/generations", {"usage": {"prompt_tokens": 3}}) == ZERO


def test_usage_adds_up_and_is_openais_shape() -> None:
    total = Usage(10, 4) + Usage(20, 6, 16, 2)
    assert total == Usage(30, 10, 16, 2)
    parsed = openai.types.BatchUsage.model_validate(total.to_openai())
    assert (parsed.input_tokens, parsed.output_tokens, parsed.total_tokens) == (30, 10, 30 + 10)
    assert parsed.input_tokens_details.cached_tokens == 16
    assert parsed.output_tokens_details.reasoning_tokens == 2
    assert Usage.from_json(total.to_json()) == total
    assert Usage.from_json({"input": 4}) == Usage(4, 0)
