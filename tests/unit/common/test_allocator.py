"""Which allocator ``fleetgate serve`` runs itself on (common/allocator.py)."""

from __future__ import annotations

from common.allocator import GATEWAY_ALLOCATOR, MARKER, reexec_environment


def test_without_a_choice_the_process_runs_again_on_malloc_with_everything_else_kept() -> None:
    env = reexec_environment({"PATH": "/bin", "FLEETGATE_SERVER__PORT": "9000"})
    assert env == {"PATH": "/bin", "FLEETGATE_SERVER__PORT": "9000", "PYTHONMALLOC": "malloc", MARKER: "1"}
    assert GATEWAY_ALLOCATOR == "malloc"


def test_an_allocator_chosen_in_the_environment_is_kept() -> None:
    assert reexec_environment({"PYTHONMALLOC": "pymalloc"}) is None
    assert reexec_environment({"PYTHONMALLOC": "malloc"}) is None


def test_the_re_executed_process_does_not_run_itself_again() -> None:
    once = reexec_environment({})
    assert once is not None
    assert reexec_environment(once) is None
    # Even once it has taken PYTHONMALLOC back out of its children's environment.
    assert reexec_environment({MARKER: "1"}) is None
