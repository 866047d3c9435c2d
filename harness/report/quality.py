"""What `gemma-parity quality` prints and writes: the side-by-side table, the Markdown summary,
the JSON, a PNG of the KL distributions, and the worst positions as a prompts file (each the
window's prefix up to the position), ready for `gemma-parity reference --prompts` and `bisect`."""

from __future__ import annotations

import io
from pathlib import Path

from harness.base.atomic import write_bytes_atomic, write_json_atomic, write_text_atomic

MARK = "<!-- written by gemma-parity -->"
STATS = ("mean", "p50", "p90", "p99", "p99.9", "max")


def _rows(payload: dict) -> list[tuple[str, str, str]]:
    port, bf16 = payload["port"], payload["bf16_reference"]
    rows = []
    for metric in ("kl", "abs_dp"):
        for stat in STATS:
            rows.append((f"{'KL' if metric == 'kl' else '|dp|'} {stat}", f"{port[metric][stat]:.3e}",
                         f"{bf16[metric][stat]:.3e}"))
    rows += [("dp mean (signed)", f"{port['dp_mean']:+.3e}", f"{bf16['dp_mean']:+.3e}"),
             ("top-1 agreement", f"{port['top1_agreement']:.4f}", f"{bf16['top1_agreement']:.4f}"),
             ("perplexity ratio", f"{port['perplexity_ratio']:.5f}", f"{bf16['perplexity_ratio']:.5f}")]
    return rows


def _failed_checks(payload: dict) -> list[str]:
    return [f"{c['metric']} {c['statistic']}: port {c['port']:.3e} > limit {c['limit']:.3e} "
            f"({payload['verdict']['factor']:g} x bf16 {c['bf16']:.3e})"
            for c in payload["verdict"]["checks"] if c["judged"] and not c["passed"]]


def format_quality(payload: dict) -> str:
    g = payload["golden"]
    lines = [f"corpus: {g['positions']} positions in windows of {payload['settings']['window']} tokens; "
             f"golden {g['bytes'] / 2**20:.2f} MiB ({g['bytes_per_position']:.0f} B/position, top-{payload['settings']['topk']})",
             f"port: backend={payload['backend']} tp={payload['tp']} dtype={payload['dtype']}; both against the fp32 reference",
             f"{'statistic':<18} {'port':>12} {'bf16 ref':>12}"]
    lines += [f"{a:<18} {b:>12} {c:>12}" for a, b, c in _rows(payload)]
    lines.append(f"verdict rule: {payload['verdict']['rule']}")
    lines += [f"FAIL {line}" for line in _failed_checks(payload)]
    routing = payload.get("routing")
    if routing is not None:  # MoE: references along the port's routing (harness/quality/moe.py)
        lines.append(f"{'PASS' if routing['passed'] else 'FAIL'} {routing['summary']}")
        lines += [f"FAIL {f['point']} at {f['where']}: experts {f['port_experts']} where fp32's top-k is "
                  f"{f['reference_experts']}, margin {f['margin']:.4g} > band {f['threshold']:.4g}"
                  for f in routing["flips"] if f["kind"] == "divergence"][:5]
    worst = payload["worst_positions"][:3]
    lines += [f"worst: window {w['window']} position {w['position']} KL {w['kl']:.3e} (bf16 {w['bf16_kl']:.3e}), "
              f"next token {w['target']}, fp32 top-1 {w['reference_top1']}, port top-1 {w['port_top1']}" for w in worst]
    lines.append("QUALITY PASS" if payload["passed"] else "QUALITY FAIL")
    return "\n".join(lines)


def _cell(text: str) -> str:
    """A Markdown table cell: a `|` (as in |dp|) escaped, or it would split the row."""
    return text.replace("|", r"\|")


def markdown(payload: dict, plotted: bool) -> str:
    lines = [MARK, "# gemma-parity quality", "", f"- verdict: **{'PASS' if payload['passed'] else 'FAIL'}**",
             f"- rule: {payload['verdict']['rule']}",
             f"- positions: {payload['golden']['positions']}, golden {payload['golden']['bytes']} bytes", "",
             "| statistic | port vs fp32 | bf16 reference vs fp32 |", "|---|---|---|"]
    lines += [f"| {_cell(a)} | {b} | {c} |" for a, b, c in _rows(payload)]
    lines += ["", *[f"- FAIL {line}" for line in _failed_checks(payload)], "", "## Worst positions", "",
              "| window | position | KL | bf16 KL | next token | fp32 top-1 | port top-1 | context (last ids) |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {w['window']} | {w['position']} | {w['kl']:.3e} | {w['bf16_kl']:.3e} | {w['target']} | "
              f"{w['reference_top1']} | {w['port_top1']} | {w['context'][-8:]} |" for w in payload["worst_positions"]]
    lines += ["", "`worst_prompts.json` holds each worst position's prompt (its window up to the position): "
              "`gemma-parity reference --prompts worst_prompts.json --out G` then `gemma-parity bisect --golden G`."]
    lines.append("" if not plotted else "\n![KL distributions](quality_kl.png)")
    if not plotted:
        lines.append("(plot skipped: install the `plot` extra for matplotlib)")
    return "\n".join(lines) + "\n"


def plot_kl(path: Path, kl_values: dict) -> bool:
    """Histogram of per-position KL (log bins), port and bf16 reference. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    import numpy as np

    fig, ax = plt.subplots(figsize=(9, 4))
    values = {name: np.clip(t.numpy(), 1e-12, None) for name, t in kl_values.items()}
    hi = max(float(v.max()) for v in values.values())
    bins = np.logspace(-12, np.log10(max(hi, 1e-11)) + 0.1, 80)
    for name, v in values.items():
        ax.hist(v, bins=bins, histtype="step", linewidth=1.5, label=f"{name} vs fp32 (mean {v.mean():.2e})")
    ax.set_xscale("log")
    ax.set_xlabel("KL divergence per position (top-k support + tail)")
    ax.set_ylabel("positions")
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue())
    return True


def write_quality_report(report_dir, payload: dict, kl_values: dict) -> Path:
    """The four files, replacing `report_dir` as a whole (harness/base/owned_dir.py)."""
    from harness.base.owned_dir import owned_directory

    report_dir = Path(report_dir)
    with owned_directory(report_dir, "--report", "quality") as tmp:
        write_json_atomic(tmp / "quality.json", payload)
        write_json_atomic(tmp / "worst_prompts.json", [w["prompt"] for w in payload["worst_positions"]], indent=None)
        plotted = plot_kl(tmp / "quality_kl.png", kl_values)
        write_text_atomic(tmp / "quality.md", markdown(payload, plotted))
    return report_dir
