"""What the machine is and what else it did while a benchmark ran, read from /proc: the
benches run on a 2-core machine shared with other work, and their results say so."""

from __future__ import annotations

from pathlib import Path


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def core_busy_idle(core: int) -> tuple[int, int]:
    """A core's (busy, spare) jiffies so far, from /proc/stat. Spare: idle, waiting for I/O, or
    running niced work (``nice -n 19``, as other work on this machine runs, yields to the
    benches' processes). Core 0 carries the gateways under test: both saturated, it has none
    to spare. Core 1 carries the upstreams and the load generators: if it has none to spare,
    they, not the gateways, may set the pace."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{core} "):
            ticks = [int(v) for v in line.split()[1:]]
            spare = ticks[1] + ticks[3] + ticks[4]
            return sum(ticks) - spare, spare
    raise RuntimeError(f"no cpu{core} in /proc/stat")


def spare_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the time between two ``core_busy_idle`` readings that the core had to spare."""
    busy, spare = after[0] - before[0], after[1] - before[1]
    return spare / max(1, busy + spare)
