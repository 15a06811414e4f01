"""The simulator's freeze: streams hold between tokens and new requests at the door, then carry on."""

from __future__ import annotations

import asyncio
import itertools

from sim.engine import FixedRateConfig, FixedRateEngine, SimRequest
from sim.freeze import Freeze, FrozenStream


def test_a_frozen_stream_gets_nothing_until_the_thaw_then_every_token() -> None:
    async def main() -> tuple[list[float], int, str | None]:
        loop = asyncio.get_running_loop()
        engine = FixedRateEngine(FixedRateConfig(ttft_s=0.0, tokens_per_s=200.0))
        freeze = Freeze()
        stream = FrozenStream(engine.submit(SimRequest("a", "hi", max_tokens=6)), freeze)
        arrivals = []
        started = loop.time()
        async for _ in stream:
            arrivals.append(loop.time() - started)
            if len(arrivals) == 2:
                freeze.freeze(0.2)
        return arrivals, stream.completion_tokens, stream.finish_reason

    arrivals, tokens, finish = asyncio.run(main())
    assert tokens == 6 and finish == "length" and len(arrivals) == 6
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert max(gaps) >= 0.2  # the freeze, between the second token and the third
    assert sorted(gaps)[-2] < 0.1  # the others at the engine's pace


def test_new_requests_wait_at_the_door_counted_as_waiting() -> None:
    async def main() -> tuple[int, int, bool]:
        freeze = Freeze()
        freeze.freeze(60)
        door = asyncio.create_task(freeze.admit())
        await asyncio.sleep(0.01)
        held = freeze.held
        freeze.freeze(0)  # thaws at once
        await asyncio.wait_for(door, 1)
        return held, freeze.held, freeze.frozen

    assert asyncio.run(main()) == (1, 0, False)
