"""The per-layer error plot (PNG) of `check --report` and `bisect --report`."""

from __future__ import annotations

import io
import math
from pathlib import Path

from harness.base.atomic import write_bytes_atomic
from harness.judge.compare import ENVELOPE_FACTOR


def _series(layers: list[dict], key: str | None, scale: float = 1.0):
    """(x, y) under `key`; a JSON null (NaN/Inf, or not measured) becomes a gap in the line."""
    if not key or all(l.get(key) is None for l in layers):
        return [], []
    return ([l["index"] for l in layers],
            [math.nan if l.get(key) is None else max(scale * l[key], 1e-12) for l in layers])


def _shade_full_layers(ax, full_layers: list[int]) -> None:
    for f in full_layers:
        ax.axvspan(f - 0.5, f + 0.5, color="0.85", lw=0, zorder=0)


def plot_layer_errors(path: Path, layers: list[dict], title: str, *, full_layers: list[int],
                      cumulative: tuple = ("cumulative_rel_l2", "envelope_rel_l2", "cumulative (port's own run)"),
                      local: tuple = ("local_rel_l2", "local_envelope_rel_l2"),
                      ratio_keys: tuple[str, ...] = (), num_layers: int | None = None) -> bool:
    """Per-layer error on a log scale: cumulative and local error, each with its tolerance line
    (ENVELOPE_FACTOR x its bf16 envelope), full-attention layers shaded, failing layers drawn in
    red, the first one marked; NaN/Inf drawn as a red x on the top edge. With `ratio_keys`, a second
    panel shows error / envelope against the flat tolerance: where the error jumps is where a curve
    leaves the band. cumulative = (error key, envelope key, label), local = (error key, envelope
    key). Returns False when matplotlib (the `plot` extra) is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = 2 if ratio_keys else 1
    fig, axes = plt.subplots(panels, 1, figsize=(12.5, 4.0 * panels), sharex=True, squeeze=False)
    ax = axes[0][0]
    _shade_full_layers(ax, full_layers)
    cumulative_key, envelope_key, cumulative_label = cumulative
    local_key, local_envelope_key = local
    styles = [(cumulative_key, envelope_key, "tab:blue", "o-", cumulative_label),
              (local_key, local_envelope_key, "tab:orange", "s-", "local (layer alone on the reference's input)")]
    for key, env_key, color, marker, label in styles:
        xs, ys = _series(layers, key)
        if not xs:
            continue
        ax.plot(xs, ys, marker, color=color, label=f"{label} rel L2", ms=5, zorder=3)
        ex, ey = _series(layers, env_key, ENVELOPE_FACTOR)
        if ex:
            ax.plot(ex, ey, ":", color=color, lw=1.5,
                    label=f"tolerance {ENVELOPE_FACTOR:g}x bf16 envelope ({label.split()[0]})")
    span = (0, num_layers - 1) if num_layers else (min((l["index"] for l in layers), default=0),
                                                   max((l["index"] for l in layers), default=0))
    _mark_failures(ax, layers, cumulative_key, local_key, span)
    ax.set_yscale("log")
    ax.set_ylabel("relative L2 error vs fp32 golden")
    ax.set_title(title)
    if panels == 2:
        _plot_ratios(axes[1][0], layers, full_layers, ratio_keys)
        _mark_nonfinite(axes[1][0], layers)
    axes[-1][0].set_xlabel("decoder layer (shaded: full attention)")
    axes[-1][0].set_xticks(range(span[0], span[1] + 1, max(1, (span[1] - span[0]) // 24 + 1)))
    axes[-1][0].set_xlim(span[0] - 0.6, span[1] + 0.6)
    for row in axes:
        row[0].grid(True, which="both", alpha=0.3)
        if row[0].get_legend_handles_labels()[0]:  # an empty legend is a matplotlib warning
            row[0].legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never on a point
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    write_bytes_atomic(path, buffer.getvalue())
    return True


def _first_failure(layers: list[dict]) -> dict | None:
    return next((l for l in layers if not l.get("pass", True)), None)


def _mark_failures(ax, layers: list[dict], cumulative_key: str, local_key: str | None, span) -> None:
    judged = local_key if any(l.get(local_key) is not None for l in layers) else cumulative_key
    bad = [l for l in layers if not l.get("pass", True) and l.get(judged) is not None]
    if bad:
        ax.scatter([l["index"] for l in bad], [max(l[judged], 1e-12) for l in bad], s=110, facecolors="none",
                   edgecolors="red", lw=2, zorder=4, label="breaks the policy")
    _mark_nonfinite(ax, layers)
    first = _first_failure(layers)
    if first is not None:
        what = first.get("component") or ""
        ax.axvline(first["index"], color="red", lw=1.2, alpha=0.8)
        right_half = first["index"] > (span[0] + span[1]) / 2  # keep the label inside the axes
        ax.annotate(f"first divergent layer {first['index']}" + (f": {what}" if what else ""),
                    xy=(first["index"], 0.97), xycoords=("data", "axes fraction"), xytext=(-8 if right_half else 8, 0),
                    textcoords="offset points", color="red", fontsize=9, va="top", zorder=6,
                    ha="right" if right_half else "left",
                    bbox={"boxstyle": "round", "fc": "white", "ec": "red", "alpha": 0.9})


def _mark_nonfinite(ax, layers: list[dict]) -> None:
    """NaN/Inf has no place on a log axis: a red x on the top edge at that layer."""
    nonfinite = [l["index"] for l in layers if not l.get("finite", True)]
    if nonfinite:
        ax.scatter(nonfinite, [1.0] * len(nonfinite), marker="x", color="red", s=80, zorder=5,
                   transform=ax.get_xaxis_transform(), clip_on=False, label="NaN/Inf")


def _plot_ratios(ax, layers: list[dict], full_layers: list[int], ratio_keys: tuple[str, ...]) -> None:
    """error / envelope (the factor that would have passed) against the flat tolerance."""
    _shade_full_layers(ax, full_layers)
    colors = {"cumulative_ratio": "tab:blue", "local_ratio": "tab:orange"}
    for key in ratio_keys:
        xs, ys = _series(layers, key)
        if xs:
            label = key.replace("_ratio", "")
            ax.plot(xs, ys, "o-" if label == "cumulative" else "s-", color=colors.get(key), ms=5,
                    label=f"{label} error / envelope")
    bad = [l for l in layers if not l.get("pass", True) and l.get("required_factor") is not None]
    if bad:
        ax.scatter([l["index"] for l in bad], [l["required_factor"] for l in bad], s=110, facecolors="none",
                   edgecolors="red", lw=2, zorder=4, label="breaks the policy (worst point)")
    ax.axhline(ENVELOPE_FACTOR, color="red", ls="--", lw=1.2, label=f"tolerance {ENVELOPE_FACTOR:g}x")
    ax.set_yscale("log")
    # The band under the tolerance starts at the data, not at 0: on a log axis a span from 0 drags
    # the axis down to ~1e-15.
    shown = [y for key in ratio_keys for y in _series(layers, key)[1] if y == y and y > 0]
    bottom = min(shown + [ENVELOPE_FACTOR]) / 2
    ax.axhspan(bottom, ENVELOPE_FACTOR, color="tab:green", alpha=0.06, lw=0)
    ax.set_ylim(bottom=bottom)
    first = _first_failure(layers)
    if first is not None:
        ax.axvline(first["index"], color="red", lw=1.2, alpha=0.8)
    ax.set_ylabel("error / bf16 envelope")


def bisect_title(payload: dict) -> str:
    first, point = payload.get("first_divergent_layer"), payload.get("first_divergent_point")
    if first is not None:
        verdict = f"first divergent layer {first}: {payload.get('component')} ({payload.get('cause')})"
    else:
        verdict = f"layers within the policy, {point} is not ({payload.get('cause')})" if point else "no divergent layer"
    return f"gemma-parity bisect ({payload.get('mode')} mode): {verdict}"


