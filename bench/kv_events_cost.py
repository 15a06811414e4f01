"""What a replica's KV event stream costs the gateway's event loop.

A publisher process (``sim.kv_publisher.KvEventPublisher``, vLLM's framing) sends synthetic
batches at ``--blocks-per-s`` blocks (``BlockStored`` chains of ``--chain`` blocks of 16 tokens,
and as many ``BlockRemoved`` so the set stays near ``--held`` blocks); this process runs the
gateway's subscriber (``routing.kv_subscriber.KvSubscriber``) into a ``ReplicaBlocks`` on an
asyncio loop, and measures, against the same loop without a stream: the process's CPU seconds
per wall second, and the loop's lag (how late a 10 ms sleep wakes up, p50/p99/max).

    PYTHONPATH=$PWD .venv/bin/python -m bench.kv_events_cost --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import resource
import statistics
import time

BLOCK = 16


def publish(endpoint: str, blocks_per_s: int, chain: int, held: int, seconds: float) -> None:
    from replicas.kv_events import BlockRemoved, BlockStored
    from sim.kv_publisher import KvEventPublisher

    async def run() -> None:
        publisher = KvEventPublisher(endpoint)
        await asyncio.sleep(1.0)  # the subscriber joins
        batches_per_s = blocks_per_s / chain
        interval = 1.0 / batches_per_s
        next_hash, live = 1, []
        start = time.monotonic()
        n = 0
        while time.monotonic() - start < seconds:
            hashes = list(range(next_hash, next_hash + chain))
            next_hash += chain
            tokens = tuple(range(next_hash * BLOCK, next_hash * BLOCK + chain * BLOCK))
            events = [BlockStored(tuple(hashes), None, tokens, BLOCK, medium="GPU")]
            live.extend(hashes)
            if len(live) > held:
                gone, live = live[:chain], live[chain:]
                events.append(BlockRemoved(tuple(gone), "GPU"))
            publisher.publish(events)
            n += 1
            await asyncio.sleep(max(0.0, start + n * interval - time.monotonic()))
        await publisher.close()

    asyncio.run(run())


async def measure(endpoint: str | None, seconds: float) -> dict[str, float]:
    from replicas.config import EventsEndpoint
    from routing.kv_index import ReplicaBlocks
    from routing.kv_subscriber import KvSubscriber

    blocks = ReplicaBlocks()
    subscriber = None
    if endpoint is not None:
        subscriber = KvSubscriber("r0", EventsEndpoint(endpoint), blocks)
        subscriber.start()
        await asyncio.sleep(1.5)
    lags: list[float] = []
    cpu0, wall0 = time.process_time(), time.monotonic()
    while time.monotonic() - wall0 < seconds:
        asked = time.monotonic() + 0.01
        await asyncio.sleep(0.01)
        lags.append(max(0.0, time.monotonic() - asked))
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    received = subscriber.counts.received if subscriber else 0
    if subscriber is not None:
        await subscriber.close()
    lags.sort()
    return {
        "cpu_per_s": cpu / wall,
        "lag_p50_ms": 1000 * statistics.median(lags),
        "lag_p99_ms": 1000 * lags[int(0.99 * (len(lags) - 1))],
        "lag_max_ms": 1000 * lags[-1],
        "batches": received,
        "blocks_held": len(blocks),
        "gaps": blocks.stats.gaps,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks-per-s", type=int, default=10_000)
    parser.add_argument("--chain", type=int, default=8, help="blocks per BlockStored (a request's new blocks)")
    parser.add_argument("--held", type=int, default=100_000, help="blocks the replica holds (removals past it)")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--port", type=int, default=25557)
    args = parser.parse_args()
    base = asyncio.run(measure(None, args.seconds))
    endpoint = f"tcp://127.0.0.1:{args.port}"
    proc = multiprocessing.Process(
        target=publish, args=(endpoint, args.blocks_per_s, args.chain, args.held, args.seconds + 3)
    )
    proc.start()
    loaded = asyncio.run(measure(endpoint, args.seconds))
    proc.join()
    print(f"{'':24}{'no stream':>12}{'stream':>12}")
    for key in base:
        print(f"{key:24}{base[key]:12.3f}{loaded[key]:12.3f}")


if __name__ == "__main__":
    main()
