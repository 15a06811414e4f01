"""The routing benchmark's report: the bars judged, the tables, the plots, the method.

Everything is computed from the run's JSON document (``bench.routing.document``), so a run
can be rendered again without sending anything (``bench/routing.py --from-json``). The
hand-written analysis between the ``ANALYSIS`` markers of an existing report is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.routing_fleet import DEFAULT_POLICY, POLICIES
from bench.routing_metrics import ITL_SLO_S, TTFT_SLO_S, Peak, Spread, peak, ratio

ANALYSIS_START = "<!-- analysis: kept when the report is written again -->"
ANALYSIS_END = "<!-- end of analysis -->"
PLOT_DPI = 110
# The bars of issue 7.
BAR_CHAT_VS_RR = 1.5
BAR_CHAT_VS_LR = 1.2
BAR_CONTROL_SHARE = 0.95
BAR_SKEW_COMPLETION = 0.95
# "No replica idles while another queues": allowed share of the fleet samples, for gauges
# read at an instant (a request that waits for one engine step shows up as waiting).
BAR_SKEW_IDLE_QUEUED = 0.01
BAR_SHORT_TTFT_GAIN = 2.0
BAR_FAIR_TTFT_RISE = 1.2
SHORT_CLASS = "short"
RR, LR = "round_robin", "least_requests"


@dataclass(frozen=True)
class Bar:
    """One bar of the issue: what it asks, what was measured, and the verdict."""

    name: str
    asks: str
    measured: str
    passed: bool | None  # None: could not be judged (a policy did not run)


def _f(value: float | None, fmt: str = ".2f", unit: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


class Results:
    """Look-ups over a run's document."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.config = doc["config"]
        self.policies: list[str] = [p for p in POLICIES if p in self.config["policies"]]
        self.experiments: list[dict[str, Any]] = self.config["experiments"]

    def seeds(self, exp: str, policy: str, rate: float, metric: str) -> Spread:
        values = [
            p["metrics"].get(metric)
            for p in self.doc["points"]
            if (p["experiment"], p["policy"], p["rate"]) == (exp, policy, rate)
        ]
        return Spread.of(values)

    def pooled(self, exp: str, policy: str, rate: float) -> dict[str, Any] | None:
        for p in self.doc["pooled"]:
            if (p["experiment"], p["policy"], p["rate"]) == (exp, policy, rate):
                metrics: dict[str, Any] = p["metrics"]
                return metrics
        return None

    def rates(self, exp: str) -> list[float]:
        return sorted({p["rate"] for p in self.doc["points"] if p["experiment"] == exp})

    def peak(self, exp: str, policy: str) -> Peak:
        return peak({r: self.seeds(exp, policy, r, "goodput") for r in self.rates(exp)})

    def has(self, exp: str, *policies: str) -> bool:
        return bool(self.rates(exp)) and all(p in self.policies for p in policies)

    def fair(self, policy: str, phase: str) -> dict[str, Any] | None:
        for p in self.doc.get("fair_pooled", []):
            if (p["policy"], p["phase"]) == (policy, phase):
                metrics: dict[str, Any] = p["metrics"]
                return metrics
        return None


def judge(res: Results) -> list[Bar]:
    """The five bars of issue 7, judged on the pooled or seed-median figures."""
    d = DEFAULT_POLICY
    bars: list[Bar] = []
    if res.has("chat", d, RR, LR):
        pd, pr, pl = res.peak("chat", d), res.peak("chat", RR), res.peak("chat", LR)
        vs_rr, vs_lr = ratio(pd.goodput, pr.goodput), ratio(pd.goodput, pl.goodput)
        bars.append(
            Bar(
                "(1) chat: goodput vs round-robin and least-requests at the knee",
                f">= {BAR_CHAT_VS_RR:g}x round_robin, >= {BAR_CHAT_VS_LR:g}x least_requests",
                f"{_f(pd.goodput, '.1f')} req/s (at {_f(pd.rate, 'g')}/s) vs round_robin {_f(pr.goodput, '.1f')} "
                f"(at {_f(pr.rate, 'g')}/s): {_f(vs_rr)}x; vs least_requests {_f(pl.goodput, '.1f')} "
                f"(at {_f(pl.rate, 'g')}/s): {_f(vs_lr)}x",
                vs_rr is not None and vs_lr is not None and vs_rr >= BAR_CHAT_VS_RR and vs_lr >= BAR_CHAT_VS_LR,
            )
        )
    else:
        bars.append(Bar("(1) chat", "needs prefix_affinity, round_robin, least_requests", "not run", None))
    if res.has("no_reuse", d):
        peaks = {p: res.peak("no_reuse", p) for p in res.policies}
        best_policy = max(peaks, key=lambda p: peaks[p].goodput or 0.0)
        share = ratio(peaks[d].goodput, peaks[best_policy].goodput)
        bars.append(
            Bar(
                "(2) no reuse: the default within 5% of the best",
                f">= {BAR_CONTROL_SHARE:.0%} of the best policy's peak goodput",
                f"{_f(peaks[d].goodput, '.1f')} req/s vs best {best_policy} {_f(peaks[best_policy].goodput, '.1f')}: "
                f"{_pct(share)}" + ("" if len(res.policies) > 1 else " (only one policy ran)"),
                share is not None and share >= BAR_CONTROL_SHARE if len(res.policies) > 1 else None,
            )
        )
    if res.has("hot_prefix", d):
        rows = [(r, res.pooled("hot_prefix", d, r) or {}) for r in res.rates("hot_prefix")]
        completion = [(r, m.get("completion")) for r, m in rows]
        idle = [(r, m.get("idle_while_queued")) for r, m in rows]
        worst_c = min(((v, r) for r, v in completion if v is not None), default=(None, None))
        worst_i = max(((v, r) for r, v in idle if v is not None), default=(None, None))
        ok = (
            worst_c[0] is not None
            and worst_c[0] >= BAR_SKEW_COMPLETION
            and worst_i[0] is not None
            and worst_i[0] <= BAR_SKEW_IDLE_QUEUED
        )
        bars.append(
            Bar(
                "(3) hot prefix: requests complete, no replica idles while another queues",
                f">= {BAR_SKEW_COMPLETION:.0%} completed and idle-while-queued <= {BAR_SKEW_IDLE_QUEUED:.0%} "
                "of samples, at every rate",
                f"lowest completion {_pct(worst_c[0])} (at {_f(worst_c[1], 'g')}/s); highest idle-while-queued "
                f"{_f(worst_i[0], '.1%')} (at {_f(worst_i[1], 'g')}/s)",
                ok,
            )
        )
    if res.has("short_long", d, RR):
        knee = res.peak("short_long", d).rate
        md = res.pooled("short_long", d, knee) if knee is not None else None
        mr = res.pooled("short_long", RR, knee) if knee is not None else None
        td = md.get(f"ttft_p99.{SHORT_CLASS}") if md else None
        tr = mr.get(f"ttft_p99.{SHORT_CLASS}") if mr else None
        gain = ratio(tr, td)
        bars.append(
            Bar(
                "(4) short/long: short requests' TTFT p99 vs round-robin",
                f">= {BAR_SHORT_TTFT_GAIN:g}x lower than round_robin at the default's knee",
                f"at {_f(knee, 'g')}/s: {_f(td, '.3f', ' s')} vs round_robin {_f(tr, '.3f', ' s')}: {_f(gain)}x",
                gain is not None and gain >= BAR_SHORT_TTFT_GAIN,
            )
        )
    alone, flood = res.fair(d, "alone"), res.fair(d, "flood")
    if alone and flood:
        rise = ratio(flood.get("ttft_p95"), alone.get("ttft_p95"))
        bars.append(
            Bar(
                "fair queue: tenant A's TTFT p95 with tenant B flooding at 10x its share",
                f"<= {BAR_FAIR_TTFT_RISE:g}x A's TTFT p95 alone",
                f"{_f(alone.get('ttft_p95'), '.3f', ' s')} alone, {_f(flood.get('ttft_p95'), '.3f', ' s')} "
                f"with the flood: {_f(rise)}x",
                rise is not None and rise <= BAR_FAIR_TTFT_RISE,
            )
        )
    return bars


def _verdict(passed: bool | None) -> str:
    return "not judged" if passed is None else ("**pass**" if passed else "**FAIL**")


def _experiment_table(res: Results, exp: dict[str, Any]) -> list[str]:
    key = exp["key"]
    short = exp.get("background") is not None
    head = (
        "| policy | rate | goodput req/s (seeds: median [min-max]) | throughput req/s (median) | attainment | TTFT p50 "
        "| TTFT p99 | ITL p95 | "
        + ("short TTFT p99 | " if short else "")
        + "prefix hits | imbalance | idle while queued | completed | preemptions |"
    )
    cols = head.count("|") - 1
    rows = [head, "| --- " + "| ---: " * (cols - 1) + "|"]
    for policy in res.policies:
        for rate in res.rates(key):
            g = res.seeds(key, policy, rate, "goodput")
            m = res.pooled(key, policy, rate) or {}
            cells = [
                policy if rate == res.rates(key)[0] else "",
                f"{rate:g}",
                f"{_f(g.median, '.1f')} [{_f(g.low, '.1f')}-{_f(g.high, '.1f')}]",
                _f(res.seeds(key, policy, rate, "throughput").median, ".1f"),
                _pct(m.get("attainment")),
                _f(m.get("ttft_p50"), ".3f", " s"),
                _f(m.get("ttft_p99"), ".3f", " s"),
                _f(_ms(m.get("itl_p95")), ".0f", " ms"),
            ]
            if short:
                cells.append(_f(m.get(f"ttft_p99.{SHORT_CLASS}"), ".3f", " s"))
            cells += [
                _pct(m.get("hit_rate")),
                _f(m.get("imbalance"), ".2f"),
                _f(m.get("idle_while_queued"), ".1%"),
                _pct(m.get("completion")),
                _f(m.get("preemptions"), ".0f"),
            ]
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def _peak_table(res: Results) -> list[str]:
    rows = ["| workload | " + " | ".join(res.policies) + " |", "| --- " + "| ---: " * len(res.policies) + "|"]
    for exp in res.experiments:
        if not res.rates(exp["key"]):
            continue
        cells = []
        for policy in res.policies:
            pk = res.peak(exp["key"], policy)
            cells.append(f"{_f(pk.goodput, '.1f')} at {_f(pk.rate, 'g')}/s")
        rows.append(f"| {exp['title']} | " + " | ".join(cells) + " |")
    return rows


def _fair_table(res: Results) -> list[str]:
    rows = [
        "| policy | tenant A alone: TTFT p50 / p95 / p99 | with B's flood: TTFT p50 / p95 / p99 | p95 ratio "
        "| A completed (flood) | B sent | B refused or failed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for policy in res.policies:
        a, f = res.fair(policy, "alone"), res.fair(policy, "flood")
        if not a or not f:
            continue
        floods = [r["flood"] for r in res.doc.get("fair", []) if r["policy"] == policy and r["phase"] == "flood"]
        sent = sum(x.get("sent", 0) for x in floods)
        errors = sum(x.get("errors", 0) for x in floods)

        def trio(m: dict[str, Any]) -> str:
            return " / ".join(_f(m.get(k), ".3f") for k in ("ttft_p50", "ttft_p95", "ttft_p99")) + " s"

        rows.append(
            f"| {policy} | {trio(a)} | {trio(f)} | {_f(ratio(f.get('ttft_p95'), a.get('ttft_p95')))}x "
            f"| {_pct(f.get('completion'))} | {sent} | {errors} ({_pct(errors / sent if sent else None)}) |"
        )
    return rows


def _method(res: Results) -> list[str]:
    c, meta = res.config, res.doc["meta"]
    t = c["timing"]
    settle = meta.get("settle_s") or {}
    scale = t["time_scale"]
    lines = [
        "## Method",
        "",
        f"- **Fleet**: per policy, one `fleetgate serve` process (commit `{meta.get('git', '?')}`) with "
        f"{c['replicas']} managed `engine: sim` replicas, profile `{c['profile']}` (Llama-3.1-8B on an H100-SXM-80GB: "
        "430,592 KV tokens, max_num_seqs 256, 8,192-token chunked prefill, prefix caching; docs/simulator.md). "
        "The policy is the gateway's `routing.policy`; everything else is the gateway's default configuration "
        "(response cache off for the benchmark tenants, no rate limits), with each replica's capacity set as "
        "docs/routing.md advises: `max_requests: 256` (vLLM's max-num-seqs), `max_outstanding_tokens` = its KV "
        "pool, and the prefill bound at its default (`max_prefill_tokens: 4096`) for the fleetgate policies. "
        "The baselines, `least_requests` and `round_robin`, run with no prefill bound "
        "(`max_prefill_tokens: null`): they stand for a plain load balancer, which sends every request on at "
        "once; the fleetgate policies' figures include what the bound does. "
        + (
            ""
            if meta.get("routing_key")
            else "**This gateway had no `routing` key yet: only its built-in least-outstanding-tokens policy ran.** "
        ),
        f"- **Side by side**: the {len(res.policies)} fleets run at the same time and every point is played against "
        "all of them at once by one load generator (`capacity.loadgen`, open loop, Poisson session arrivals); "
        "each policy's sessions are drawn from the same seeded streams, so they get the same requests at the "
        "same moments. Whatever else the machine does hits every policy alike.",
        f"- **Time scale**: the simulated GPUs ran at {scale:g}x real time (a {1 / scale:.1f} s wall-clock "
        "stretch per simulated second), so the gateway's and the client's Python cost per request and token "
        f"shrinks {1 / scale:.1f}x against the simulated latencies. All durations here are real-time-equivalent: "
        f"measured wall times multiplied by {scale:g}. The gateway's real-time settings (health interval, "
        "timeouts, keep-alives) were divided by the same factor.",
        f"- **Points**: per (workload, rate, seed) {t['warmup_s']:g} s of warm-up, then a {t['duration_s']:g} s "
        "window; requests sent in the window are the samples and the load stays on until they finish (or reach "
        f"the client's {t['request_timeout_s']:g} s timeout, which counts as not completed). Seeds "
        f"{', '.join(str(s) for s in c['seeds'])} (arrivals, sessions, sizes). Rates rise through saturation; "
        "the fleets keep their caches from point to point (a service's steady state), and workloads (1) and (3) "
        "start with an unmeasured pre-warm at their middle rate.",
        f"- **Goodput**: a request is *good* if it completed, its TTFT was <= {TTFT_SLO_S:g} s and the 95th "
        f"percentile of its own inter-token gaps <= {ITL_SLO_S * 1000:.0f} ms. A point's goodput is its good "
        "requests per second of window. Per rate, the median over the seeds (range in brackets). A policy's "
        "goodput *at the knee* is its highest such median over the sweep: load past the knee only lowers it. "
        "Throughput counts completed requests; attainment is good / sent. TTFT and ITL percentiles are over "
        "the seeds' samples pooled.",
        "- **Between points** the harness waits until no replica of any fleet has a request running or waiting "
        f"(at most {settle.get('limit')} s): requests cancelled when an overloaded point ends can still sit in a "
        "replica's queue (the simulator notices a closed connection only when it writes the first token), and "
        f"would load the next point. Waits: median {settle.get('median')} s, longest {settle.get('max')} s, "
        f"{settle.get('over_1s')} of {settle.get('points')} over 1 s.",
        "- **Prefix-cache hit rate**: from the replicas' own counters, `vllm:prefix_cache_hits_total` / "
        "`vllm:prefix_cache_queries_total` (tokens), deltas across the window summed over replicas.",
        f"- **Imbalance**: each replica's running + waiting requests (`vllm:num_requests_*`), read every "
        f"{0.5 * scale:.2g} s (real-time-equivalent) during the window and averaged; the busiest replica's average "
        "over the fleet's mean (1.00 = even). **Idle while queued**: the share of those readings in which one "
        "replica had nothing running or waiting while another had requests waiting. Waiting as vLLM reports it: "
        "requests the replica's last scheduling decision passed over (no KV blocks, token budget or sequence "
        "slot left), as that step left them; a request that arrived during a step is not waiting until a "
        "decision passes it over (docs/simulator.md).",
    ]
    for e in c["experiments"]:
        rates = ", ".join(f"{r:g}" for r in e["rates"])
        unit = "sessions/s" if e["key"] in ("chat", "hot_prefix") else "requests/s"
        extra = ""
        if e.get("background"):
            extra = (
                f" Its `{e['background']}` class runs as background load (same rate share, started "
                f"{e['background_lead_s']:g} s before the warm-up so long generations are in flight; not sampled); "
                "the samples are the other classes' requests."
            )
        lines.append(f"- **{e['title']}**: `bench/profiles/{e['profile']}.yaml`, {rates} {unit}.{extra}")
    fair = c.get("fair")
    if fair:
        lines.append(
            f"- **Fair queue**: both tenants weight 1, so each is entitled to half of the fleet. Nominal capacity on "
            f"`{fair['profile']}` ~{fair['capacity']:g} requests/s; tenant A sends {fair['rate_a']:g}/s (within its "
            f"half), tenant B {fair['rate_b']:g}/s = 10x its half. Per seed, A alone, then A while B floods "
            "(B started with A's warm-up; a batch job, B never gives up on a request, while A keeps the "
            f"client timeout); A's window is {fair.get('duration_s') or c['timing']['duration_s']:g} s. "
            "The bar compares A's TTFT p95 (seeds pooled). Run on the "
            + ", ".join(f"`{p}`" for p in c.get("fair_policies", [DEFAULT_POLICY]))
            + " fleet only: the queue sits in front of any policy, and a flood on four fleets at once would load "
            "this machine more than the fleets. The gateway's queue settings are its defaults (waits scaled with "
            "the time scale), the replicas' capacity as above."
        )
        fair_run = meta.get("fair_run")
        if fair_run:
            lines.append(
                f"  **This section comes from a separate run** (`bench/routing.py --fair-only`, commit "
                f"`{fair_run.get('git', '?')}`, started {fair_run.get('started_at', '?')}, "
                f"{fair_run.get('wall_s', 0) / 60:.1f} min), after a change that acts only while two or more "
                "tenants are active in a pool; the workloads above each send as one tenant and come from the "
                "run described below."
            )
    cpu = meta.get("cpu_s", {})
    lines += [
        "",
        f"Run: `{meta.get('command', 'bench/routing.py')}`, started {meta.get('started_at', '?')}, "
        f"{meta.get('wall_s', 0) / 60:.1f} min wall; CPU: load generator {cpu.get('client', '?')} s, gateways and "
        f"replicas {cpu.get('fleets', '?')} s; load average {meta.get('loadavg_before')} before, "
        f"{meta.get('loadavg_after')} after (2 cores, shared).",
    ]
    return lines


def render(doc: dict[str, Any], images: Sequence[Path], analysis: str) -> str:
    res = Results(doc)
    bars = judge(res)
    t = res.config["timing"]
    out = [
        "# Routing: four policies on eight simulated H100s, through the gateway",
        "",
        f"`.venv/bin/python bench/routing.py` ({doc['meta'].get('wall_s', 0) / 60:.0f} min here; `--quick`: a "
        "few minutes). Policies: "
        + ", ".join(f"`{p}`" for p in res.policies)
        + f" (`{DEFAULT_POLICY}` is the default). Simulated GPUs at {t['time_scale']:g}x real time; all figures "
        "real-time-equivalent. Method at the end.",
        "",
        "## The bars",
        "",
        "| bar | asks | measured | verdict |",
        "| --- | --- | --- | --- |",
        *[f"| {b.name} | {b.asks} | {b.measured} | {_verdict(b.passed)} |" for b in bars],
        "",
        "Peak goodput per policy (requests/s meeting both SLOs; the seeds' median at the best rate):",
        "",
        *_peak_table(res),
        "",
        ANALYSIS_START,
        analysis.strip() or "(analysis to be written)",
        ANALYSIS_END,
    ]
    for exp in res.experiments:
        if not res.rates(exp["key"]):
            continue
        out += ["", f"## {exp['title']}", "", *_experiment_table(res, exp)]
    if doc.get("fair_pooled"):
        out += ["", "## Fair queue: tenant B floods at 10x its share", "", *_fair_table(res)]
    out += ["", "## Plots", "", *[f"![{p.stem}]({p.name})" for p in images], "", *_method(res)]
    return "\n".join(out) + "\n"


def kept_analysis(path: Path) -> str:
    """The hand-written analysis of an existing report (between the markers), or ''."""
    if not path.exists():
        return ""
    text = path.read_text()
    start, end = text.find(ANALYSIS_START), text.find(ANALYSIS_END)
    if start == -1 or end == -1 or end < start:
        return ""
    body = text[start + len(ANALYSIS_START) : end].strip()
    return "" if body == "(analysis to be written)" else body


def write_report(doc: dict[str, Any], out_dir: Path, name: str) -> list[Path]:
    md = out_dir / f"{name}.md"
    images = plot(doc, out_dir, name)
    md.write_text(render(doc, images, kept_analysis(md)))
    return [md, *images]


def _rate_axes(ax: Any, title: str, ylabel: str) -> None:
    """Title, labels, grid and legend of a panel plotted against the arrival rate."""
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("arrival rate (/s)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def plot(doc: dict[str, Any], out_dir: Path, name: str) -> list[Path]:
    """Goodput, TTFT and cache/balance against rate, per workload; the fair-queue comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = Results(doc)
    exps = [e for e in res.experiments if res.rates(e["key"])]
    if not exps:
        return []
    colours = dict(zip(POLICIES, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    paths: list[Path] = []

    def save(fig: Any, suffix: str) -> None:
        fig.tight_layout()
        path = out_dir / f"{name}-{suffix}.png"
        fig.savefig(path, dpi=PLOT_DPI)
        plt.close(fig)
        paths.append(path)

    fig, axes = plt.subplots(1, len(exps), figsize=(4.6 * len(exps), 4.0), squeeze=False)
    for ax, exp in zip(axes[0], exps, strict=True):
        rates = res.rates(exp["key"])
        for policy in res.policies:
            g = [res.seeds(exp["key"], policy, r, "goodput") for r in rates]
            med = [s.median for s in g]
            err = [[(s.median or 0) - (s.low or 0) for s in g], [(s.high or 0) - (s.median or 0) for s in g]]
            ax.errorbar(rates, med, yerr=err, marker="o", ms=3, capsize=3, color=colours[policy], label=policy)
            thr = [(res.pooled(exp["key"], policy, r) or {}).get("throughput") for r in rates]
            ax.plot(rates, thr, linestyle=":", color=colours[policy], alpha=0.6)
        _rate_axes(ax, exp["title"], "goodput, req/s (dotted: throughput)")
    save(fig, "goodput")

    fig, axes = plt.subplots(1, len(exps), figsize=(4.6 * len(exps), 4.0), squeeze=False)
    for ax, exp in zip(axes[0], exps, strict=True):
        rates = res.rates(exp["key"])
        p99 = f"ttft_p99.{SHORT_CLASS}" if exp.get("background") else "ttft_p99"
        p50 = f"ttft_p50.{SHORT_CLASS}" if exp.get("background") else "ttft_p50"
        for policy in res.policies:
            ms = [res.pooled(exp["key"], policy, r) or {} for r in rates]
            ax.plot(rates, [m.get(p99) for m in ms], marker="o", ms=3, color=colours[policy], label=f"{policy} p99")
            ax.plot(rates, [m.get(p50) for m in ms], linestyle="--", color=colours[policy], alpha=0.7)
        ax.axhline(TTFT_SLO_S, color="red", linestyle=":", linewidth=1)
        ax.set_yscale("log")
        _rate_axes(
            ax, exp["title"] + (" (short requests)" if exp.get("background") else ""), "TTFT s (solid p99, dashed p50)"
        )
    save(fig, "ttft")

    fig, axes = plt.subplots(2, len(exps), figsize=(4.6 * len(exps), 7.0), squeeze=False)
    for col, exp in enumerate(exps):
        rates = res.rates(exp["key"])
        for policy in res.policies:
            ms = [res.pooled(exp["key"], policy, r) or {} for r in rates]
            axes[0][col].plot(
                rates, [m.get("hit_rate") for m in ms], marker="o", ms=3, color=colours[policy], label=policy
            )
            axes[1][col].plot(
                rates, [m.get("imbalance") for m in ms], marker="o", ms=3, color=colours[policy], label=policy
            )
        axes[0][col].set_title(exp["title"], fontsize=9)
        axes[0][col].set_ylabel("prefix-cache hit rate")
        axes[0][col].set_ylim(0, 1)
        axes[1][col].set_ylabel("imbalance (busiest / mean)")
        axes[1][col].set_xlabel("arrival rate (/s)")
        for row in axes:
            row[col].grid(True, alpha=0.3)
            row[col].legend(fontsize=7)
    save(fig, "cache")

    fair_policies = [p for p in res.policies if res.fair(p, "alone") and res.fair(p, "flood")]
    if fair_policies:
        fig, ax = plt.subplots(figsize=(7.5, 4.0))
        width = 0.8 / len(fair_policies)
        for i, policy in enumerate(fair_policies):
            for j, phase in enumerate(("alone", "flood")):
                m = res.fair(policy, phase) or {}
                values = [m.get(k) or 0.0 for k in ("ttft_p50", "ttft_p95", "ttft_p99")]
                xs = [k + (i - len(fair_policies) / 2) * width + width / 2 for k in range(3)]
                ax.bar(
                    xs,
                    values,
                    width * (0.45 if j else 0.9),
                    color=colours[policy],
                    alpha=0.45 if j == 0 else 1.0,
                    label=f"{policy} ({phase})",
                )
        ax.set_xticks(range(3), ["TTFT p50", "TTFT p95", "TTFT p99"])
        ax.set_ylabel("tenant A, s (pale: alone; dark: with B's flood)")
        ax.set_title("fair queue: tenant A alone vs with tenant B at 10x its share", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
        save(fig, "fair")
    return paths
