"""A stalled engine on cue: the simulated replica freezes for N seconds, then carries on.

What a real vLLM replica does when its engine stops stepping (starved of CPU by a neighbour
on the same core, a long step, a hung collective): its API server still answers
``/health`` and ``/metrics``, but its open streams receive nothing, new requests get no
answer (they queue: the waiting gauge counts them), and when the engine runs again every
request is finished whole. ``POST /sim/freeze {"seconds": N}`` does that (``seconds: 0``
thaws at once); the gateway's stall handling is tested against it
(tests/integration/test_stall.py).

The freeze holds each stream between two tokens (``FrozenStream``) and each new request
before it reaches the engine (``Freeze.held``); the batched engine's step loop waits too
(``BatchedSimEngine.freeze``), so no token is computed meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiohttp import web

from sim.engine import SimStream

MAX_FREEZE_S = 3600.0


class Freeze:
    """Whether the replica is frozen, until when, and how many new requests wait for the thaw."""

    def __init__(self) -> None:
        self._thawed = asyncio.Event()
        self._thawed.set()
        self._timer: asyncio.TimerHandle | None = None
        self.until: float | None = None
        # New requests held at the door (the waiting gauge adds them).
        self.held = 0

    @property
    def frozen(self) -> bool:
        return not self._thawed.is_set()

    def freeze(self, seconds: float) -> None:
        """Freeze for ``seconds`` from now (a new freeze replaces the one under way); 0 thaws."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if seconds <= 0:
            self.thaw()
            return
        loop = asyncio.get_running_loop()
        self.until = loop.time() + seconds
        self._thawed.clear()
        self._timer = loop.call_later(seconds, self.thaw)

    def thaw(self) -> None:
        self.until = None
        self._timer = None
        self._thawed.set()

    async def wait(self) -> None:
        """Return at once unless frozen; then at the thaw."""
        if self.frozen:
            await self._thawed.wait()

    async def admit(self) -> None:
        """A new request's wait at the door, counted as waiting meanwhile."""
        if not self.frozen:
            return
        self.held += 1
        try:
            await self._thawed.wait()
        finally:
            self.held -= 1


class FrozenStream:
    """An engine's stream whose next token waits while the replica is frozen."""

    def __init__(self, tokens: SimStream, freeze: Freeze) -> None:
        self._tokens = tokens
        self._freeze = freeze

    # The engine's counts and finish reason, read (and written) through.
    @property
    def prompt_tokens(self) -> int:
        return self._tokens.prompt_tokens

    @prompt_tokens.setter
    def prompt_tokens(self, value: int) -> None:
        self._tokens.prompt_tokens = value

    @property
    def completion_tokens(self) -> int:
        return self._tokens.completion_tokens

    @completion_tokens.setter
    def completion_tokens(self, value: int) -> None:
        self._tokens.completion_tokens = value

    @property
    def finish_reason(self) -> str | None:
        return self._tokens.finish_reason

    @finish_reason.setter
    def finish_reason(self, value: str | None) -> None:
        self._tokens.finish_reason = value

    def cancel(self) -> None:
        self._tokens.cancel()

    async def __aiter__(self) -> AsyncIterator[str]:
        async for piece in self._tokens:
            await self._freeze.wait()
            yield piece


FREEZE_KEY = web.AppKey("freeze", Freeze)


async def freeze_route(request: web.Request) -> web.Response:
    """``POST /sim/freeze {"seconds": N}``: not a vLLM route; the simulator's fault on cue."""
    try:
        body = await request.json()
        seconds = float(body["seconds"])
    except (ValueError, KeyError, TypeError):
        return web.json_response({"error": 'expected {"seconds": N}'}, status=400)
    if not 0 <= seconds <= MAX_FREEZE_S:
        return web.json_response({"error": f"seconds must be within [0, {MAX_FREEZE_S:g}]"}, status=400)
    freeze = request.app[FREEZE_KEY]
    freeze.freeze(seconds)
    return web.json_response({"frozen": freeze.frozen, "seconds": seconds})
