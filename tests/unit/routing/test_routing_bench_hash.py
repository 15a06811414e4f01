"""The client-side hash row of ``bench/routing.py`` (pure: which replica a request goes to)."""

from __future__ import annotations

from bench.routing import prefix_home
from capacity.workload import RequestSpec


def _spec(prefix_key: str | None, system: str = "shared text\nuser data") -> RequestSpec:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    return RequestSpec(messages, 16, True, 0, True, prefix_key, 10)


def test_a_prefix_goes_to_one_replica_per_seed_whatever_follows_it() -> None:
    # The same shared copy with other per-user data after it: the same replica.
    home = prefix_home(_spec("p1#0", "shared text\nalice"), 4, salt="1")
    assert prefix_home(_spec("p1#0", "shared text\nbob"), 4, salt="1") == home
    assert 0 <= home < 4
    # Every seed places the prefixes anew: eight prefixes, three seeds, not one placement.
    placements = {tuple(prefix_home(_spec(f"p{k}#0"), 4, salt=str(seed)) for k in range(1, 9)) for seed in (1, 2, 3)}
    assert len(placements) == 3
    # No shared opening: the first message decides.
    assert prefix_home(_spec(None, "a"), 1000, salt="1") != prefix_home(_spec(None, "b"), 1000, salt="1")
