"""The outputs of a capacity sweep: the live view, JSON with every sample, a Markdown report, PNG plots.

``SweepRecord`` holds what was run and measured; the plans (``capacity.planner``) are computed
from it here, so the JSON, the report and the plots always agree. Plots use matplotlib's
Agg backend (no display needed).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from capacity.loadgen import PointPlan, Progress, Target
from capacity.planner import Plan, Slo, judge, parse_slo, plan
from capacity.stats import Metrics, RequestSample, percentile
from capacity.workload import Workload, parse_workload

if TYPE_CHECKING:  # rich and matplotlib are the bench extra's: imported when used, not when `fleetgate` starts
    from rich.console import Console, Group

MODE_UNITS = {"closed": "users", "open": "sessions/s"}
MODE_TITLES = {"closed": "closed loop (concurrent users)", "open": "open loop (Poisson session arrivals)"}
PLOT_DPI = 110
REFERENCE_COLUMNS = ("total_tps", "per_user_tps", "ttft_p95", "ttft_cold_p50", "ttft_warm_p50")  # when published


@dataclass
class PointRecord:
    """One measured point."""

    target: str
    mode: str
    level: float
    metrics: Metrics
    errors: dict[str, int]
    samples: list[RequestSample] = field(repr=False)
    runs: list[Metrics] = field(default_factory=list)  # each repeat's metrics; ``metrics`` is their median


@dataclass
class SweepRecord:
    """A whole run: its settings (``meta``), the workload, the SLOs and every point."""

    meta: dict[str, Any]
    workload: Workload
    slos: list[Slo]
    targets: dict[str, str]  # name -> URL
    points: list[PointRecord] = field(default_factory=list)

    def series(self, target: str, mode: str) -> list[PointRecord]:
        return sorted((p for p in self.points if p.target == target and p.mode == mode), key=lambda p: p.level)

    def modes(self) -> list[str]:
        return [m for m in MODE_UNITS if any(p.mode == m for p in self.points)]

    def plan(self, target: str, mode: str) -> Plan:
        return plan({p.level: p.metrics for p in self.series(target, mode)}, self.slos)


def to_json(sweep: SweepRecord) -> bytes:
    plans = {
        f"{t}/{m}": {
            "capacity": pl.capacity,
            "first_failure": pl.first_failure,
            "broken_first": [{"slo": s.text, "value": v} for s, v in pl.broken_first],
            "slo_breaks": [{"slo": b.slo.text, "level": b.level, "crossing": b.crossing} for b in pl.breaks],
            "passes_above_failure": list(pl.passes_above_failure),
        }
        for t in sweep.targets
        for m in sweep.modes()
        for pl in [sweep.plan(t, m)]
    }
    doc = {
        "meta": sweep.meta,
        "workload": sweep.workload.model_dump(mode="json"),
        "slos": [s.text for s in sweep.slos],
        "targets": sweep.targets,
        "plans": plans,
        "points": [
            {
                "target": p.target,
                "mode": p.mode,
                "level": p.level,
                "metrics": p.metrics,
                "errors": p.errors,
                "runs": p.runs,
                "samples": [s.to_json() for s in p.samples],
            }
            for p in sweep.points
        ],
    }
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)


def from_json(data: bytes) -> SweepRecord:
    """A run back from its JSON (``to_json``), to judge it against other SLOs or re-render it."""
    doc = orjson.loads(data)
    workload = parse_workload(doc["workload"], "the run's workload")
    sweep = SweepRecord(doc["meta"], workload, [parse_slo(s) for s in doc["slos"]], doc["targets"])
    for p in doc["points"]:
        samples = [RequestSample(**s) for s in p["samples"]]  # inter-token gaps are not stored
        point = PointRecord(p["target"], p["mode"], p["level"], p["metrics"], p["errors"], samples, p.get("runs", []))
        sweep.points.append(point)
    return sweep


def _fmt(value: float | None, unit: str = "", digits: int = 2) -> str:
    if value is None:
        return "-"
    if unit == "%":
        return f"{value:.0%}"
    if unit == "s":
        return f"{value:.3f} s" if value < 0.1 else f"{value:.2f} s"
    if unit == "ms":
        return f"{value * 1000:.1f} ms"
    return f"{value:,.{digits}f}{unit}"


_level = "{:g}".format  # a load level as written on the command line: 8, 0.5


def _answer(sweep: SweepRecord, target: str, mode: str) -> list[str]:
    pl, unit = sweep.plan(target, mode), MODE_UNITS[mode]
    if not sweep.slos:
        return [f"- **{target}, {MODE_TITLES[mode]}**: no SLO given, nothing to judge."]
    if pl.capacity is None:
        lowest = _level(pl.first_failure or 0)
        head = f"- **{target}, {MODE_TITLES[mode]}**: no level met the SLOs, not even {lowest} {unit}"
    else:
        head = f"- **{target}, {MODE_TITLES[mode]}: {_level(pl.capacity)} {unit}** meet every SLO"
    if pl.first_failure is None:
        return [head + "; nothing broke up to the top of the sweep: sweep higher to find the limit."]
    broken = ", ".join(f"`{s.metric}` = {_fmt(v, digits=3)} (limit {s.op} {s.threshold:g})" for s, v in pl.broken_first)
    lines = [head + f"; at {_level(pl.first_failure)} {unit} it breaks first on {broken}."]
    if pl.passes_above_failure:
        lines.append(f"  (Points above it pass again: {', '.join(map(_level, pl.passes_above_failure))}; noise?)")
    return lines


def _slo_table(sweep: SweepRecord, target: str, mode: str) -> list[str]:
    rows = ["| SLO | first broken at | crossing (interpolated) |", "| --- | ---: | ---: |"]
    for b in sweep.plan(target, mode).breaks:
        at = _level(b.level) if b.level is not None else "held throughout"
        rows.append(f"| `{b.slo.text}` | {at} | {_fmt(b.crossing, digits=1)} |")
    return rows


def _point_table(sweep: SweepRecord, target: str, mode: str) -> list[str]:
    verdicts = {v.level: v for v in sweep.plan(target, mode).verdicts}
    rows = [
        f"| {MODE_UNITS[mode]} | requests | total tok/s | per-user tok/s | slowest 5% tok/s | TTFT p50 | TTFT p95 "
        "| TTFT p99 | ITL p50 | ITL p95 | longest gap | errors | KV peak | waiting peak | preemptions "
        "| prefix hits | TTFT cold / warm p50 | SLOs |",
        "| ---: " * 17 + "| --- |",
    ]
    for p in sweep.series(target, mode):
        m, v = p.metrics, verdicts[p.level]
        verdict = "pass" if v.passed else "fail: " + ", ".join(s.metric for s, _ in v.broken)
        rows.append(
            f"| {_level(p.level)} | {_fmt(m['requests'], digits=0)} | {_fmt(m['total_tps'], digits=1)} "
            f"| {_fmt(m['per_user_tps'], digits=1)} | {_fmt(m['per_user_tps_p5'], digits=1)} "
            f"| {_fmt(m['ttft_p50'], 's')} | {_fmt(m['ttft_p95'], 's')} | {_fmt(m['ttft_p99'], 's')} "
            f"| {_fmt(m['itl_p50'], 'ms')} | {_fmt(m['itl_p95'], 'ms')} | {_fmt(m['max_gap'], 's')} "
            f"| {_fmt(m['errors'], digits=0)} | {_fmt(m.get('kv_peak'), '%')} "
            f"| {_fmt(m.get('waiting_peak'), digits=0)} "
            f"| {_fmt(m.get('preemptions'), digits=0)} | {_fmt(m.get('prefix_hit_rate'), '%')} "
            f"| {_fmt(m['ttft_cold_p50'], 's')} / {_fmt(m['ttft_warm_p50'], 's')} | {verdict} |"
        )
    return rows


def _reference_table(sweep: SweepRecord, target: str) -> list[str]:
    ref = sweep.workload.reference
    series = {p.level: p.metrics for p in sweep.series(target, "closed")}
    if ref is None or not series:
        return []
    columns = [c for c in REFERENCE_COLUMNS if any(c in pts for pts in ref.points.values())]
    head = " | ".join(f"{c} published | {c} measured | diff" for c in columns)
    rows = [f"| users | {head} |", "| ---: " * (1 + 3 * len(columns)) + "|"]
    for level, published in sorted(ref.points.items()):
        if level not in series:
            continue
        cells = []
        for c in columns:
            pub, got = published.get(c), series[level].get(c)
            diff = f"{(got - pub) / pub:+.0%}" if pub and got is not None else "-"
            unit = "s" if c.startswith(("ttft", "itl")) else ""
            cells.append(f"{_fmt(pub, unit, 1)} | {_fmt(got, unit, 1)} | {diff}")
        rows.append(f"| {_level(level)} | " + " | ".join(cells) + " |")
    return [f"### {target}: published vs measured", "", f"Published: {ref.source}.", "", *rows, ""]


def _cost_table(sweep: SweepRecord, baseline: str, mode: str) -> list[str]:
    base = {p.level: p.metrics for p in sweep.series(baseline, mode)}
    rows: list[str] = []
    for target in sweep.targets:
        if target == baseline:
            continue
        rows += [
            f"### {target} vs {baseline}, {MODE_TITLES[mode]}",
            "",
            f"| {MODE_UNITS[mode]} | TTFT p50 {baseline} | TTFT p50 {target} | added | TTFT p95 {baseline} "
            f"| TTFT p95 {target} | added | total tok/s {baseline} | total tok/s {target} | ratio |",
            "| ---: " * 10 + "|",
        ]
        for p in sweep.series(target, mode):
            b, m = base.get(p.level), p.metrics
            if b is None:
                continue
            rows.append(
                f"| {_level(p.level)} | {_fmt(b['ttft_p50'], 'ms')} | {_fmt(m['ttft_p50'], 'ms')} "
                f"| {_fmt(_sub(m['ttft_p50'], b['ttft_p50']), 'ms')} | {_fmt(b['ttft_p95'], 'ms')} "
                f"| {_fmt(m['ttft_p95'], 'ms')} | {_fmt(_sub(m['ttft_p95'], b['ttft_p95']), 'ms')} "
                f"| {_fmt(b['total_tps'], digits=1)} | {_fmt(m['total_tps'], digits=1)} "
                f"| {_fmt(_div(m['total_tps'], b['total_tps']), digits=3)} |"
            )
        rows.append("")
    return rows


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def render_markdown(sweep: SweepRecord, images: Sequence[Path]) -> str:
    meta, w = sweep.meta, sweep.workload
    out = [f"# Capacity: {w.name}", "", w.description, ""]
    out += [f"- {key}: {value}" for key, value in meta.get("summary", {}).items()]
    out += ["", "## The answer", ""]
    for mode in sweep.modes():
        for target in sweep.targets:
            out += _answer(sweep, target, mode)
    for mode in sweep.modes():
        for target in sweep.targets:
            out += ["", f"## {target}, {MODE_TITLES[mode]}", ""]
            if sweep.slos:
                out += [*_slo_table(sweep, target, mode), ""]
            out += _point_table(sweep, target, mode)
            errors = error_totals(sweep.series(target, mode))
            if errors:
                out += ["", "Errors by kind (all points): " + ", ".join(f"{k} {n}" for k, n in errors.items()) + "."]
    if w.reference is not None and meta.get("show_reference"):
        out += ["", "## Published reference", ""]
        for target in sweep.targets:
            out += _reference_table(sweep, target)
    baseline = meta.get("baseline")
    if baseline in sweep.targets and len(sweep.targets) > 1:
        out += ["", "## The gateway's cost", ""]
        repeats = f", {meta['repeat']} times, the medians shown" if meta.get("repeat", 1) > 1 else ""
        out += [f"Each point ran on every target in turn (alternating order{repeats}); {baseline} is the baseline.", ""]
        for mode in sweep.modes():
            out += _cost_table(sweep, baseline, mode)
    out += ["", "## Plots", ""] + [f"![{img.stem}]({img.name})" for img in images]
    notes = meta.get("notes", [])
    if notes:
        out += ["", "## Notes", "", *[f"- {n}" for n in notes]]
    return "\n".join(out) + "\n"


def error_totals(points: Iterable[PointRecord]) -> dict[str, int]:
    """Errors by kind, added up over points (or over the repeats of one)."""
    totals: dict[str, int] = {}
    for p in points:
        for kind, n in p.errors.items():
            totals[kind] = totals.get(kind, 0) + n
    return totals


def _draw(ax: Any, sweep: SweepRecord, mode: str, metrics: Sequence[tuple[str, str]], colours: list[str]) -> None:
    """Lines of ``metrics`` ((name, style), ...) for every target, the SLO lines and the capacity."""
    from matplotlib.ticker import NullLocator

    for i, target in enumerate(sweep.targets):
        series, colour = sweep.series(target, mode), colours[i % len(colours)]
        for name, style in metrics:
            ys = [p.metrics.get(name) for p in series]  # gaps where a point measured nothing
            label = f"{name} ({target})" if len(sweep.targets) > 1 else name
            ax.plot([p.level for p in series], ys, style, color=colour, marker="o", markersize=3, label=label)
        capacity = sweep.plan(target, mode).capacity
        if capacity is not None and sweep.slos:
            ax.axvline(capacity, color=colour, linestyle=":", alpha=0.6, label=f"capacity ({target})")
    for slo in sweep.slos:
        if slo.metric in {name for name, _ in metrics}:
            ax.axhline(slo.threshold, color="red", linestyle="--", linewidth=1, label=f"SLO {slo.text}")
    levels = sorted({p.level for p in sweep.points if p.mode == mode})
    if levels and min(levels) > 0 and max(levels) / min(levels) >= 8:
        ax.set_xscale("log", base=2)  # sweeps double the load: equal steps on the page
        ax.set_xticks(levels, [_level(x) for x in levels])
        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(MODE_UNITS[mode])
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def plot(sweep: SweepRecord, out_dir: Path, stem: str) -> list[Path]:
    """Latency, per-user and total rate, and fleet state against load; one PNG each per mode."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display; must precede pyplot's import
    import matplotlib.pyplot as plt

    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    paths: list[Path] = []
    has_fleet = any(p.metrics.get("kv_peak") is not None for p in sweep.points)
    for mode in sweep.modes():
        figures = {
            "latency": [
                ("TTFT (s)", [("ttft_p50", "-"), ("ttft_p95", "--"), ("ttft_p99", ":")]),
                ("inter-token latency (s)", [("itl_p50", "-"), ("itl_p95", "--")]),
            ],
            "throughput": [
                ("per-user tokens/s", [("per_user_tps", "-"), ("per_user_tps_p5", "--")]),
                ("total tokens/s", [("total_tps", "-")]),
            ],
        }
        if has_fleet:
            figures["fleet"] = [
                ("KV-cache use (0-1)", [("kv_peak", "-"), ("kv_mean", "--")]),
                ("preemptions, waiting requests", [("preemptions", "-"), ("waiting_peak", "--")]),
            ]
        for name, panels in figures.items():
            fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2))
            for ax, (ylabel, metrics) in zip(axes, panels, strict=True):
                _draw(ax, sweep, mode, metrics, colours)
                ax.set_ylabel(ylabel)
            fig.suptitle(f"{sweep.workload.name}: {name} vs load, {MODE_TITLES[mode]}")
            fig.tight_layout()
            path = out_dir / f"{stem}{'' if mode == 'closed' else '-open'}-{name}.png"
            fig.savefig(path, dpi=PLOT_DPI)
            plt.close(fig)
            paths.append(path)
    return paths


def write_all(sweep: SweepRecord, out_dir: Path, stem: str) -> list[Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and the PNGs into ``out_dir``; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    images = plot(sweep, out_dir, stem)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_bytes(to_json(sweep))
    md_path.write_text(render_markdown(sweep, images))
    return [md_path, json_path, *images]


# The live view's table: its columns, and the metric and format of each numeric cell.
_COLUMNS = "target|load|requests|total tok/s|per-user tok/s|TTFT p95|ITL p95|errors|KV peak|preempt|SLOs".split("|")
_ROW_FORMATS: tuple[tuple[str, str], ...] = (("requests", ".0f"), ("total_tps", ".1f"), ("per_user_tps", ".1f"))
_ROW_FORMATS += (("ttft_p95", ".3f"), ("itl_p95", ".4f"), ("errors", ".0f"), ("kv_peak", ".0%"), ("preemptions", ".0f"))


class LiveView:
    """The live view: finished points as a table, the running point as a status line."""

    def __init__(self, sweep: SweepRecord, console: Console, clock: Any, scale: float) -> None:
        self.sweep, self.console, self.clock, self.scale = sweep, console, clock, scale
        self.current: tuple[Target, PointPlan, Progress] | None = None

    def __rich__(self) -> Group:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"fleetgate bench: {self.sweep.workload.name}", title_justify="left")
        for col in _COLUMNS:
            table.add_column(col, justify="left" if col in ("target", "SLOs") else "right")
        for p in self.sweep.points:
            table.add_row(*point_row(p, self.sweep.slos))
        if self.current is None:
            return Group(table)
        target, plan, pr = self.current
        now = self.clock()
        into = max(0.0, (now - pr.window_start) * self.scale)
        ttft = f"{percentile(list(pr.recent_ttft), 95):.2f} s" if pr.recent_ttft else "-"
        status = (
            f"{target.name} at {plan.level:g} {MODE_UNITS[plan.mode]}: {pr.phase}"
            f"{f' {min(into, plan.duration_s):.0f}/{plan.duration_s:.0f} s' if pr.phase == 'measuring' else ''}"
            f" | in flight {pr.in_flight} | sent {pr.started} | sampled {pr.sampled} | errors {pr.errors}"
            f" | recent TTFT p95 {ttft}"
        )
        return Group(table, Text(status, style="bold cyan"))


def point_row(p: PointRecord, slos: Sequence[Slo]) -> list[str]:
    m, verdict = p.metrics, judge(p.level, p.metrics, slos)

    def f(key: str, fmt: str) -> str:
        value = m.get(key)
        return "-" if value is None else format(value, fmt)

    slo_text = "pass" if verdict.passed else "fail: " + ",".join(s.metric for s, _ in verdict.broken)
    cells = [f(key, fmt) for key, fmt in _ROW_FORMATS]
    return [p.target, f"{p.level:g} {MODE_UNITS[p.mode]}", *cells, slo_text if slos else "-"]
