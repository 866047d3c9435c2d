"""Text and Markdown for bench results, comparisons, change points and roofline floors."""

from __future__ import annotations

from pathlib import Path

from harness.perf.compare import Comparison

LATENCY_ROWS = ("ttft_ms", "tpot_ms", "e2e_ms")


def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]

    def line(cells):
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows])


# ---- roofline ---------------------------------------------------------------------------------

def _rate_line(rates: dict, spread: dict | None = None) -> str:
    host = rates.get("host_link_bytes_per_s")
    line = (f"rates: {rates['name']}: memory {rates['memory_bytes_per_s'] / 1e9:.1f} GB/s, compute "
            f"{rates['flops_per_s'] / 1e12:.3g} TFLOP/s, host link "
            + (f"{host / 1e9:.0f} GB/s" if host else "none (the host is the device)")
            + f" [{rates['source']}]")
    if spread:
        mem, flops = spread["memory_bytes_per_s"], spread["flops_per_s"]
        line += (f"\nrates measured once, spread over their samples: memory {mem['min'] / 1e9:.1f}-"
                 f"{mem['max'] / 1e9:.1f} GB/s (n={mem['n']}), compute {flops['min'] / 1e12:.3g}-"
                 f"{flops['max'] / 1e12:.3g} TFLOP/s (n={flops['n']})")
    return line


def roofline_tables(roofline: dict) -> tuple[list[str], list[list[str]]]:
    """One row per graph. "graph ms": median time inside the backend's graph call (the device graph
    and its transfers); "host-side ms": the rest of the engine's call (validation, padding, host
    embedding, cache reset); "link ms": the host-link floor. Efficiency = floor / graph ms."""
    header = ["graph", "weights GiB", "KV MiB", "GFLOP", "host MiB", "memory ms", "compute ms", "link ms",
              "floor ms", "bound", "graph ms", "host-side ms", "efficiency"]
    rows = [[g["graph"], f"{g['weight_bytes'] / 2**30:.3f}", f"{g['kv_bytes'] / 2**20:.1f}",
             f"{g['flops'] / 1e9:.1f}", f"{g['host_bytes'] / 2**20:.2f}", f"{g['memory_ms']:.3f}",
             f"{g['compute_ms']:.3f}", _ms(g["host_ms"]), f"{g['floor_ms']:.3f}", g["bound"],
             _ms(g.get("measured_ms")), _ms(g.get("host_side_ms")),
             "-" if g.get("efficiency") is None else f"{100 * g['efficiency']:.1f}%"]
            for g in roofline["graphs"]]
    return header, rows


def render_roofline(roofline: dict) -> str:
    header, rows = roofline_tables(roofline)
    return "\n".join([f"floors (tp={roofline['tp']}, {roofline['dtype']}): the least time per call of each "
                      "graph; efficiency = floor / graph ms (the median inside the graph call; host-side ms "
                      "is the rest of the engine's call)", *_table(header, rows),
                      _rate_line(roofline["rates"], roofline.get("rates_spread")), *_published_lines(roofline)]) + "\n"


def _published_lines(roofline: dict) -> list[str]:
    floors = {g["graph"]: g["floor_ms"] for g in roofline["graphs"]}
    return [f"published: {graph} {ms:g} ms; floor / published = {100 * floors[graph] / ms:.1f}%"
            for graph, ms in (roofline.get("published_ms") or {}).items() if graph in floors]


def render_roofline_markdown(roofline: dict) -> str:
    header, rows = roofline_tables(roofline)
    return "\n".join([*_markdown_table(header, rows), "", _rate_line(roofline["rates"], roofline.get("rates_spread")),
                      *_published_lines(roofline)]) + "\n"


# ---- a bench result -----------------------------------------------------------------------------

def _pct(value) -> str:
    return f"{'-':>9}" if value is None else f"{value:9.2f}"


PERCENTILE_RULE = ("percentiles: p90 is shown from n >= 10 samples and p99 from n >= 100; '-' means too few "
                   "samples for that tail")


def render_bench_summary(result: dict) -> str:
    lines = [f"{result['backend']} tp={result['tp']} {result['dtype']} spec {result['spec_hash']} "
             f"commit {str(result['git_commit'])[:12]}"]
    for name, s in result["summary"].items():
        if isinstance(s, dict):
            lines.append(f"  {name:<22} p50 {s['p50']:9.2f}  p90 {_pct(s['p90'])}  p99 {_pct(s['p99'])}  "
                         f"mean {s['mean']:9.2f} ms  (n={s['n']})")
    lines.append(f"  tokens_per_second      {result['summary']['tokens_per_second']:.1f}")
    latency = result.get("latency_summary")
    if latency:
        lines.append(f"latency (TTFT: prefill of bucket {result['prefill_bucket']} incl. host embedding and the "
                     f"first token; TPOT: one decode step; E2E: prompt + {result['latency']['generated_tokens']} "
                     "tokens)")
        for name, s in latency.items():
            if name != "throughput":
                lines.append(f"  {name:<22} p50 {s['p50']:9.2f}  p90 {_pct(s['p90'])}  p99 {_pct(s['p99'])} ms  "
                             f"(n={s['n']})")
        t = latency["throughput"]
        lines.append(f"  throughput             decode {t['decode_tokens_per_s']:.1f} tok/s, end-to-end "
                     f"{t['e2e_tokens_per_s']:.1f} tok/s, prefill {t['prefill_tokens_per_s']:.0f} tok/s")
    lines.append(PERCENTILE_RULE)
    lines.append(_outputs_line(result.get("outputs")))
    if "environment" in result:
        from harness.perf.environment import describe

        lines.append(f"machine during the run: {describe(result['environment'])}")
    text = "\n".join(lines) + "\n"
    if result.get("roofline"):
        text += render_roofline(result["roofline"])
    if result.get("at_length"):
        text += "\n".join([_length_title(result["at_length"]) + ":", *_table(*length_table(result["at_length"]))]) + "\n"
    return text


def length_table(block: dict) -> tuple[list[str], list[list[str]]]:
    """Latency at each prompt length beside its floor (context.py: each call at its KV bucket)."""
    header = ["length", "TTFT p50 ms", "TTFT floor ms", "TPOT p50 ms", "TPOT floor ms", "decode KV bucket"]
    rows = [[str(r["length"]), _ms(r["ttft_p50_ms"]), _ms(r["floor"]["ttft_ms"]), _ms(r["tpot_p50_ms"]),
             f"{_ms(r['floor']['tpot_ms'])} ({r['floor']['tpot_bound']})", str(r["floor"]["decode_kv_bucket"])]
            for r in block["lengths"]]
    return header, rows


def _length_title(block: dict) -> str:
    return (f"latency at length ({block.get('sliding_cache', 'linear')} sliding cache; TTFT: the prompt "
            f"prefilled in chunks; TPOT: mean of {block['new_tokens']} decode steps from the prompt's end)")


def _outputs_line(outputs: dict | None) -> str:
    if not outputs:
        return "outputs: not recorded"
    tokens = sum(len(p["tokens"]) for p in outputs["prompts"])
    agree = "every run generated the same tokens" if outputs.get("runs_agree", True) else outputs.get("runs_differ")
    return (f"outputs: {tokens} tokens over {len(outputs['prompts'])} prompts pinned (margin fingerprint "
            f"{outputs.get('fingerprint')}); {agree}")


# ---- a comparison -------------------------------------------------------------------------------

def _p(m) -> str:
    if m.p_value is None:
        return "-"
    p = m.p_value if m.ratio is None or m.ratio >= 1 else m.p_faster
    return f"{p:.2g}"


def _ci(m) -> str:
    return "-" if m.ci_low is None else f"{m.ci_low:.3f}-{m.ci_high:.3f}"


def comparison_tables(comp: Comparison) -> tuple[list[str], list[list[str]]]:
    level = next((f"{100 * m.confidence:g}% CI" for m in comp.metrics if m.confidence), "CI")
    header = ["metric", "baseline p50 ms", "current p50 ms", "ratio", f"ratio {level}", "p-value", "verdict"]
    rows = [[m.metric, _ms(m.baseline_median), _ms(m.current_median),
             "-" if m.ratio is None else f"{m.ratio:.3f}", _ci(m), _p(m), m.verdict] for m in comp.metrics]
    rows += [[f"budget {b.metric}", f"<= {b.budget_ms:g}", _ms(b.current_median),
              f"{b.current_median / b.budget_ms:.3f}", "-", "-", "ok" if b.ok else "OVER BUDGET"]
             for b in comp.budgets]
    return header, rows


def status_line(comp: Comparison) -> str:
    if not comp.failed:
        return "perf: NOT COMPARABLE (no verdict)" if comp.not_comparable else "perf: ok"
    parts = [comp.output_change.split(":")[0]] if comp.output_change else []
    parts += [f"regression in {', '.join(comp.regressions)}"] if comp.regressions else []
    parts += [f"over budget: {', '.join(comp.broken_budgets)}"] if comp.broken_budgets else []
    return "perf: FAILED (" + "; ".join(parts) + ")"


def rule_line(comp: Comparison) -> str:
    return (f"rule: regression = median ratio > {comp.factor:g} and one-sided Mann-Whitney p < {comp.alpha:g} "
            f"(improvement: ratio < 1/{comp.factor:g} and the other side's p < {comp.alpha:g}); the p-value "
            "shown is the one-sided test in the ratio's direction; CI: bootstrap of the ratio of medians")


def change_point_title(comp: Comparison) -> str:
    return (f"change points (CUSUM with a permutation test, binary segmentation, over the run medians; "
            f"family-wise alpha {comp.alpha:g} over the {comp.change_point_metrics} metrics tested, Holm's "
            "step-down)")


def change_point_rows(comp: Comparison) -> tuple[list[str], list[list[str]]]:
    header = ["metric", "first run after the step", "commit", "before ms", "after ms", "ratio", "p-value"]
    rows = [[cp.metric, cp.run, cp.commit[:12], _ms(cp.before_median), _ms(cp.after_median),
             f"{cp.ratio:.3f} ({cp.direction})", f"{cp.p_value:.3g}"] for cp in comp.change_points]
    return header, rows


def render_text(comp: Comparison) -> str:
    header, rows = comparison_tables(comp)
    out = [status_line(comp), f"baseline: {comp.baseline_label}", f"current:  {comp.current_label}",
           rule_line(comp), *([comp.output_change] if comp.output_change else []),
           *([comp.not_comparable] if comp.not_comparable else []), "", *_table(header, rows)]
    if comp.change_points:
        out += ["", change_point_title(comp) + ":", *_table(*change_point_rows(comp))]
    if comp.roofline:
        out += ["", "current run's " + render_roofline(comp.roofline).rstrip("\n")]
    if comp.at_length:
        out += ["", "current run's " + _length_title(comp.at_length) + ":", *_table(*length_table(comp.at_length))]
    out += [f"note: {n}" for n in comp.notes]
    if comp.plot:
        out.append(f"trend plot: {comp.plot}")
    return "\n".join(out) + "\n"


def render_markdown(comp: Comparison, plot_link: str | None = None) -> str:
    header, rows = comparison_tables(comp)
    icon = "❌" if comp.failed else "⚠️" if comp.not_comparable else "✅"
    out = [f"### {icon} {status_line(comp)}", "",
           f"Baseline: `{comp.baseline_label}`  ", f"Current: `{comp.current_label}`  ",
           f"A metric regresses when its median ratio exceeds {comp.factor:g} **and** a one-sided "
           f"Mann-Whitney U test gives p < {comp.alpha:g}; the interval is a bootstrap interval of the "
           "ratio of medians.", *(["", f"**{comp.output_change}**"] if comp.output_change else []),
           *(["", f"**{comp.not_comparable}**"] if comp.not_comparable else []), "",
           *_markdown_table(header, rows)]
    if comp.change_points:
        out += ["", "#### C" + change_point_title(comp)[1:], "", *_markdown_table(*change_point_rows(comp))]
    if comp.roofline:
        out += ["", "#### Floors of the current run (efficiency = floor / measured median)", "",
                render_roofline_markdown(comp.roofline).rstrip("\n")]
    if comp.at_length:
        out += ["", "#### The current run's " + _length_title(comp.at_length), "",
                *_markdown_table(*length_table(comp.at_length))]
        if comp.length_plot:
            out += ["", f"![latency against length]({Path(comp.length_plot).name})"]
    if plot_link:
        out += ["", f"![trend of the run medians]({plot_link})"]
    if comp.notes:
        out += [""] + [f"- {n}" for n in comp.notes]
    return "\n".join(out) + "\n"
