"""Decisions for a saturated pool: deadline, priority, overflow, clamp, shed reason."""

from __future__ import annotations

import pytest

from routing import saturation
from routing.fair_queue import RejectReason


def test_the_deadline_is_the_request_timeout_unless_the_client_asks_sooner() -> None:
    assert saturation.deadline(100.0, 30.0, None) == (130.0, False)
    assert saturation.deadline(100.0, 30.0, "1500") == (101.5, True)
    assert saturation.deadline(100.0, 30.0, "60000") == (130.0, True)  # never past the gateway's own


@pytest.mark.parametrize("sent", ["0", "-5", "soon", "1.5", ""])
def test_a_deadline_that_is_not_a_positive_integer_is_refused(sent: str) -> None:
    assert saturation.deadline(0.0, 30.0, sent) is None


def test_a_request_may_lower_its_priority_never_raise_it() -> None:
    assert saturation.priority("normal", None) == "normal"
    assert saturation.priority("normal", "low") == "low"
    assert saturation.priority("normal", "high") == "normal"
    assert saturation.priority("high", "normal") == "normal"
    assert saturation.priority("low", "high") == "low"
    assert saturation.priority("high", "urgent") == "high"


def test_overflow_takes_the_nearest_smaller_model_with_room() -> None:
    room = {"medium": False, "small": True, "tiny": True}
    assert saturation.overflow_model(["medium", "small", "tiny"], room.__getitem__) == "small"
    assert saturation.overflow_model(["medium"], room.__getitem__) is None
    assert saturation.overflow_model([], room.__getitem__) is None


def test_clamp_lowers_max_tokens_to_the_limit_only() -> None:
    assert saturation.clamp(1000, 256) == 256
    assert saturation.clamp(None, 256) == 256  # no max_tokens: the replica's default could be the whole context
    assert saturation.clamp(100, 256) is None
    assert saturation.clamp(256, 256) is None
    assert saturation.clamp(1000, None) is None


def test_why_a_queued_request_was_refused() -> None:
    assert saturation.shed_reason(RejectReason.QUEUE_FULL, 10.0, 20.0) == "queue_full"
    # It waited until its own deadline (which bounded the wait): 504.
    assert saturation.shed_reason(RejectReason.WAIT_EXCEEDED, 20.0, 20.0) == "deadline"
    # It waited its priority's longest wait, before its deadline: 503.
    assert saturation.shed_reason(RejectReason.WAIT_EXCEEDED, 10.0, 20.0) == "wait_exceeded"
