"""Run a test command several times while other CPU-bound work keeps every core busy.

CI runs on a developer's own machine, which other jobs share: a test that passes alone but
fails beside CPU-bound work keeps good work from landing. This runs ``COMMAND`` ``--runs``
times with one busy process per core beside it (plain Python loops, as another job's would
be), and reports each run's result and time::

    .venv/bin/python scripts/stress.py --runs 5 -- .venv/bin/pytest -q tests/e2e

(`make test-stress` runs exactly that.) Exits non-zero when any run failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time


def _spin() -> None:
    """Burn one core until terminated."""
    n = 0
    while True:
        n = (n * 1103515245 + 12345) & 0x7FFFFFFF


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="busy processes (default: one per core)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    busy = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for process in busy:
        process.start()
    results: list[tuple[int, float]] = []
    try:
        for run in range(1, args.runs + 1):
            print(f"[stress] run {run}/{args.runs} beside {args.busy} busy processes: {' '.join(command)}", flush=True)
            started = time.monotonic()
            code = subprocess.call(command)
            results.append((code, time.monotonic() - started))
            print(f"[stress] run {run}: {'passed' if code == 0 else f'FAILED ({code})'} in {results[-1][1]:.0f} s")
    finally:
        for process in busy:
            process.terminate()
        for process in busy:
            process.join()
    failed = sum(1 for code, _ in results if code != 0)
    times = ", ".join(f"{seconds:.0f} s" for _, seconds in results)
    print(f"[stress] {len(results) - failed} of {len(results)} runs passed beside {args.busy} busy processes ({times})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
