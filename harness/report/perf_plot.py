"""The trend PNG of `perf compare` (the history's runs, or the two files'): per metric, each run's
median with its p10-p90 spread, the change points found, and the budget line; and the latency-vs-length PNG of a run benched
with `--lengths` (TTFT and TPOT medians against length, beside their floors). Needs matplotlib (the
`plot` extra)."""

from __future__ import annotations

import io
from pathlib import Path

from harness.base.atomic import write_bytes_atomic
from harness.perf.compare import Comparison

MAX_PANELS = 4
PNG_SOFTWARE = "gemma-parity"  # a tEXt chunk: how `perf compare` knows a PNG beside --markdown is its own
MAX_TICKS = 20  # commit labels per panel: one per run made 10,000-run histories take minutes to draw
HEADLINE = ("ttft_ms", "prefill_ms", "tpot_ms", "decode_ms_per_token")


def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def panel_metrics(comp: Comparison, budgets: dict[str, float]) -> list[str]:
    """Metrics worth a panel: those with a change point or a budget first, then the headline ones."""
    stepped = [cp.metric for cp in comp.change_points]
    wanted = stepped + [m for m in budgets if m in comp.trend] + [m for m in HEADLINE if m in comp.trend]
    return list(dict.fromkeys(wanted))[:MAX_PANELS]


def tick_positions(n: int, most: int = MAX_TICKS) -> list[int]:
    """At most `most` evenly spaced runs to label, the first and the newest always among them."""
    if n <= most:
        return list(range(n))
    step = -(-(n - 1) // (most - 1))
    return sorted(set(range(0, n - 1, step)) | {n - 1})


def run_labels(points: list[dict]) -> list[str]:
    """One x label per run: its commit's first 7 characters, and `#k` (the k-th run of that commit,
    oldest first) when the commit has more than one run, so that no two runs share a label."""
    counts: dict[str, int] = {}
    for p in points:
        counts[p["commit"][:7]] = counts.get(p["commit"][:7], 0) + 1
    seen: dict[str, int] = {}
    labels = []
    for p in points:
        short = p["commit"][:7]
        seen[short] = seen.get(short, 0) + 1
        labels.append(short if counts[short] == 1 else f"{short} #{seen[short]}")
    return labels


def _panel(ax, metric: str, points: list[dict], comp: Comparison, budget: float | None) -> None:
    x = list(range(len(points)))
    medians = [p["median"] for p in points]
    low = [p["median"] - p["p10"] for p in points]
    high = [p["p90"] - p["median"] for p in points]
    ax.errorbar(x, medians, yerr=[low, high], fmt="o-", color="tab:blue", ecolor="tab:gray", capsize=3,
                markersize=4, linewidth=1, label="median (p10-p90 of the run)")
    for cp in (c for c in comp.change_points if c.metric == metric):
        ax.axvline(cp.index - 0.5, color="tab:orange", linestyle="--",
                   label=f"change point: {cp.direction} x{cp.ratio:.2f} from {cp.commit[:8]} (p={cp.p_value:.2g})")
    if budget is not None:
        ax.axhline(budget, color="tab:red", linewidth=1.2, label=f"budget {budget:g} ms")
    ax.set_ylabel(f"{metric} (ms)")
    ticks = tick_positions(len(points))
    ax.set_xticks(ticks)
    labels = run_labels(points)
    ax.set_xticklabels([labels[i] for i in ticks], rotation=60, fontsize=7)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")


def draw_trend(comp: Comparison, path, budgets: dict[str, float] | None = None) -> Path | None:
    """Write the PNG atomically and return its path; None (with a note on the comparison) when
    matplotlib is absent or there is nothing to draw."""
    budgets = budgets or {}
    if not plot_available():
        comp.notes.append("trend plot skipped: matplotlib is not installed (pip install -e '.[plot]')")
        return None
    metrics = panel_metrics(comp, budgets)
    if not metrics:
        comp.notes.append("trend plot skipped: no metric has a history to draw")
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 2.8 * len(metrics)), dpi=72, layout="constrained")
    axes = fig.subplots(len(metrics), 1, squeeze=False)[:, 0]
    for ax, metric in zip(axes, metrics):
        _panel(ax, metric, comp.trend[metric], comp, budgets.get(metric))
    runs = len(comp.trend[metrics[0]])
    axes[0].set_title(f"perf history: {runs} runs (x: commit of each run, oldest first)" if comp.history else
                      f"baseline {Path(comp.baseline_label).name} vs current {Path(comp.current_label).name}",
                      fontsize=9)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": PNG_SOFTWARE})
    out = write_bytes_atomic(path, buffer.getvalue())
    comp.plot = str(out)
    return out


def draw_length(comp: Comparison, path) -> Path | None:
    """The current run's TTFT against prompt length and TPOT against context length, each beside its
    floor, written atomically; None (with a note) when matplotlib is absent or no lengths were benched."""
    block = comp.at_length
    if not block or not block.get("lengths"):
        return None
    if not plot_available():
        comp.notes.append("length plot skipped: matplotlib is not installed (pip install -e '.[plot]')")
        return None
    from matplotlib.figure import Figure

    rows = block["lengths"]
    x = [r["length"] for r in rows]
    fig = Figure(figsize=(9, 3.2), dpi=72, layout="constrained")
    for ax, key, what in zip(fig.subplots(1, 2), ("ttft", "tpot"), ("prompt length", "context length")):
        ax.plot(x, [r[f"{key}_p50_ms"] for r in rows], "o-", color="tab:blue", label=f"{key.upper()} median")
        ax.plot(x, [r["floor"][f"{key}_ms"] for r in rows], "s--", color="tab:red", label="floor")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"{what} (tokens)")
        ax.set_ylabel(f"{key.upper()} (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": PNG_SOFTWARE})
    out = write_bytes_atomic(path, buffer.getvalue())
    comp.length_plot = str(out)
    return out
