"""Human-readable tables, Markdown summaries, JSON and the per-layer error plot."""

from __future__ import annotations

import io
import math
from pathlib import Path

from harness.atomic import write_bytes_atomic, write_json_atomic, write_text_atomic
from harness.compare import ENVELOPE_FACTOR


def _table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def format_info(payload: dict) -> str:
    rows = [[l["index"], "full" if l["type"] == "full_attention" else "sliding", l["head_dim"], l["q_heads"],
             l["kv_heads"], "yes" if l["k_eq_v"] else "", l["window"] or "", f"{l['rope_type']}/{l['rotated_freqs']}",
             l["q_heads_per_rank"], l["kv_heads_per_rank"], l["groups"], l["kv_layout"]]
            for l in payload["layers"]]
    mem = payload["memory"]
    gb = 1e9
    return "\n".join([
        f"spec {payload['spec_hash']} from {payload['source']}",
        payload["inert"],
        f"{len(payload['layers'])} layers, hidden {payload['hidden_size']}, vocab {payload['vocab_size']}, "
        f"softcap {payload['final_logit_softcapping']}; sharding plan at tp={payload['tp']}:",
        _table(["layer", "type", "head_dim", "q", "kv", "k=v", "window", "rope/rotated", "q/rank",
                "kv/rank", "groups", "kv"], rows),
        f"bytes per rank ({payload['dtype']}): {mem['total'] / gb:.2f} GB = weights {mem['weights'] / gb:.2f} GB "
        f"+ KV cache {mem['kv_cache'] / gb:.3f} GB; host-side embeddings {mem['host_embeddings'] / gb:.2f} GB",
        *payload.get("notes", []),
    ])


def _fmt(x: float) -> str:
    return "inf" if x == math.inf else f"{x:.2e}"


def layer_rows(layers: list[dict]) -> list[list]:
    """Check rows: the cumulative error of the port's run, its ratio to the envelope, and (CPU) the
    ratio of the layer alone on the reference's input."""
    return [[l["index"], "full" if l["type"] == "full_attention" else "sliding", _fmt(l["rel_l2"]),
             f"{l['cosine']:.6f}", _fmt(l["max_abs"]), _fmt(l["envelope_rel_l2"]),
             f"{max(l['ratio'], l['position_ratio']):.2f}",
             f"{l['local_ratio']:.2f}" if l.get("local_ratio") is not None else "-",
             "pass" if l["pass"] else f"FAIL ({l['component']})"]
            for l in layers]


LAYER_HEADERS = ["layer", "type", "rel_l2", "cosine", "max_abs", "bf16 env", "ratio", "local ratio", "verdict"]


def _stage_summary(name: str, stage: dict) -> list[str]:
    """One stage: its judge, and each failure with the point and where (or the point count)."""
    verdict = "pass" if stage["passed"] else "FAIL"
    lines = [f"{name} stage ({stage['judge']}): {verdict}, {stage['points']} capture points"]
    for f in stage["failures"][:12]:
        ratio = f" {f['ratio']:.1f}x" if f.get("ratio") is not None else ""
        detail = f" ({f['detail']})" if f.get("detail") else ""
        lines.append(f"  FAIL {f['point']}{ratio} at {f.get('where')}{detail}")
    if len(stage["failures"]) > 12:
        lines.append(f"  ... and {len(stage['failures']) - 12} more (see --json)")
    return lines


def _port_error_lines(err: dict) -> list[str]:
    return [f"exception inside the port ({err['phase']}): {err['type']}: {err['message']}",
            f"  raised at {err['where']}"]


def _prompt_lines(payload: dict) -> list[str]:
    lines = []
    for k, pr in enumerate(payload["prompts"]):
        lines.append(f"prompt {k} ({pr['prompt_length']} tokens): SEQ_MATCH {pr['seq_match']}")
        lines.append(f"  reference: {pr['reference_tokens']}")
        lines.append(f"  device:    {pr['device_tokens']}")
        if pr.get("departure"):
            d = pr["departure"]
            lines.append(f"  departs at step {d['position']}: {d['kind']} ({d['evidence']})")
        for part in ("prefill_logits", "decode_logits_teacher_forced"):
            lg = pr[part]
            lines.append(f"  {part}: top1 {lg['top1_agreement']:.3f}, top{5} overlap {lg['topk_overlap']:.3f}, "
                         f"KL mean {lg['kl_mean']:.2e} max {lg['kl_max']:.2e}, near-tie flips {lg['near_ties']}, "
                         f"real divergences {lg['divergences']}")
            for m in lg["mismatches"]:
                lines.append(f"    position {m['position']}: reference {m['reference_token']} vs device "
                             f"{m['device_token']} -> {m['kind']}: {m.get('evidence', '')}")
    return lines


def format_check(result) -> str:
    payload = result.to_json() if hasattr(result, "to_json") else result
    lines = [f"port: backend={payload['backend']} tp={payload['tp']} dtype={payload['dtype']}; "
             f"tolerance: error <= {ENVELOPE_FACTOR}x the bf16 CPU envelope at each point "
             "(ratio: the port's run; local ratio: each layer alone on the reference's input)"]
    if payload["layers"]:
        lines.append(_table(LAYER_HEADERS, layer_rows(payload["layers"])))
    for key in ("embeddings", "final_norm", "logits", "decode_logits"):
        p = payload.get(key)
        if p:
            lines.append(f"{key}: rel_l2 {_fmt(p['rel_l2'])} (envelope {_fmt(p['envelope_rel_l2'])}, ratio "
                         f"{max(p['ratio'], p['position_ratio']):.2f}) {'pass' if p['passed'] else 'FAIL'}")
    if not payload.get("embeddings_exact", True):
        lines.append(f"embeddings: FAIL, not bit-exact with the {payload['dtype']} reference's lookup "
                     "(is sqrt(hidden) cast to the weight dtype before the multiply?)")
    lines += _prompt_lines(payload)
    calibration = payload.get("near_tie_calibration")
    if calibration:
        lines.append(f"near-tie band {calibration['band']:.3f} logits = {calibration['factor']:g} x the "
                     f"{calibration['quantile']:g} quantile ({calibration['shift_at_quantile']:.3f}) of how far bf16 "
                     f"moves the reference's top-1 margins against fp32 ({calibration['samples']} margins; largest "
                     f"{calibration['shift_max']:.3f}); a flip the fp32 stage also shows is never a near tie")
    for name in ("fp32", "bf16"):
        stage = payload.get("stages", {}).get(name)
        if stage:
            lines += _stage_summary(name, stage)
            if stage.get("port_error"):
                lines += _port_error_lines(stage["port_error"])
    lines += [f"note: {n}" for n in payload.get("notes", [])]
    first = payload["first_divergent_layer"]
    where = f"{first} ({payload.get('first_divergent_component')})" if first is not None else "none"
    lines.append(f"first divergent layer: {where}; near-tie flips "
                 f"{payload['near_tie_flips']}, real divergences {payload['real_divergences']}")
    lines.append(f"SEQ_MATCH {payload['seq_match']}")
    if payload.get("first_failure"):
        f = payload["first_failure"]
        lines.append(f"first failure: {f['stage']} stage, {f['point']} at {f.get('where')}")
    lines.append("PARITY PASS" if payload["passed"] else
                 f"PARITY FAIL (stage {', '.join(payload.get('failed_stages') or ['?'])})")
    return "\n".join(lines)


# ---- report directory --------------------------------------------------------------------------

# ---- bisect ------------------------------------------------------------------------------------

BISECT_HEADERS = ["layer", "type", "golden std", "port std", "cumulative", "cum env", "local", "local env",
                  "tolerance", "needs", "verdict"]


def _opt(x, fmt=_fmt) -> str:
    return "-" if x is None else fmt(x)


def _layer_verdict(l: dict) -> str:
    if l["pass"]:
        return "pass"
    what = "NaN/Inf" if not l.get("finite", True) else (l.get("component") or "")
    return f"FAIL ({what})" if what else "FAIL"


def bisect_rows(layers: list[dict]) -> list[list]:
    """One row per layer, Polygraphy-style: both sides' spread, the error cumulative and local, the
    tolerance (ENVELOPE_FACTOR x the envelope of the judged error) and the factor that would pass."""
    rows = []
    for l in layers:
        stats = l.get("stats") or {}
        golden, port = stats.get("golden"), stats.get("port_local")
        judged_env = l["local_envelope_rel_l2"] if l.get("local_envelope_rel_l2") is not None else l["envelope_rel_l2"]
        rows.append([
            l["index"], "full" if l["type"] == "full_attention" else "sliding",
            _opt(golden and golden["std"]), "NaN/Inf" if port and not port["finite"] else _opt(port and port["std"]),
            _err(l["cumulative_rel_l2"]), _opt(l["envelope_rel_l2"]),
            _err(l.get("local_rel_l2")) if l.get("local_points") else "-",
            _opt(l.get("local_envelope_rel_l2")),
            _opt(judged_env and ENVELOPE_FACTOR * judged_env),
            "inf" if l.get("required_factor") is None else f"{l['required_factor']:.2f}x",
            _layer_verdict(l),
        ])
    return rows


def _err(x) -> str:
    """An error read back from JSON: null there means it was not finite (NaN or Inf in the port)."""
    return "inf" if x is None else _fmt(x)


def _point_line(p: dict, label: str | None = None) -> str:
    """compare.PointResult.explain() for a point read back from JSON."""
    label = label or p["name"]
    if not p.get("finite", True):
        return f"{label}: FAIL, NaN or Inf in the port's values"
    verdict = "PASS" if p["passed"] else "FAIL"
    need = max(p["ratio"], p["position_ratio"])
    where = (f"prompt {p['worst_prompt']} position {p['worst_prompt_position']}" if "worst_prompt" in p
             else f"position {p['worst_position']}")
    return (f"{label}: {verdict} rel_l2={p['rel_l2']:.3e} vs envelope {p['envelope_rel_l2']:.3e} "
            f"(ratio {p['ratio']:.2f}; worst {where} ratio {p['position_ratio']:.2f}), "
            f"cosine={p['cosine']:.6f}, max_abs={p['max_abs']:.3e}; tolerance {ENVELOPE_FACTOR}x, would pass at "
            f"{need:.2f}x")


CAUSES = {
    "weights": "the port computes this checkpoint's layer like transformers does; the checkpoint's weights "
               "differ from the golden's here",
    "port": "the port's layer differs from transformers' layer on the same weights and input",
    "accumulated": "no layer is wrong on its own; the error accumulates past the envelope",
    "nonfinite": "NaN or Inf appears here",
    "divergent": "truncate mode: the first prefix whose output breaks the policy (cumulative error)",
    "embeddings": "the host embedding lookup differs from the golden's (embedding weights, scale or "
                  "placeholder handling), before any layer",
    "final_norm": "every layer is within the policy; the final norm is not",
}


def bisect_summary_lines(payload: dict) -> list[str]:
    first, point = payload["first_divergent_layer"], payload.get("first_divergent_point")
    lines = [_point_line(p, label) for label, p in _edge_points(payload)]
    if first is None and point:
        lines.append(f"first divergent point: {point}, before or after the layers; cause: {payload['cause']} "
                     f"({CAUSES.get(payload['cause'], '')})")
    elif first is None:
        lines.append("first divergent layer: none (every layer within the policy)")
    else:
        layer = next(l for l in payload["layers"] if l["index"] == first)
        lines.append(f"first divergent layer: {first} ({layer['type']}), component: {payload['component']}, "
                     f"cause: {payload['cause']} ({CAUSES.get(payload['cause'], '')})")
        for title, key in (("alone on the golden's input", "local_points"), ("cumulative", "cumulative_points")):
            if layer.get(key):
                lines.append(f"  layer {first} {title}:")
                lines += [f"    {_point_line(p)}" for p in layer[key]]
    nf = payload.get("nonfinite")
    lines.append("NaN/Inf: none" if not nf else
                 f"NaN/Inf first at layer {nf['layer']}, point {nf['point']} ({nf.get('where', '')})"
                 + (", at " + ", ".join(f"prompt {k} position {j}" for k, j in nf["positions"])
                    if nf.get("positions") else ""))
    if payload.get("seq_match") is not None:
        lines.append(f"SEQ_MATCH {payload['seq_match']}; token mismatches: {payload['near_tie_flips']} near-tie "
                     f"flips, {payload['real_divergences']} real divergences")
    lines.append(f"builds: {payload['builds']}")
    lines += [f"note: {n}" for n in payload.get("notes", [])]
    return lines


def _edge_points(payload: dict) -> list[tuple[str, dict]]:
    """The points around the layers (capture mode): embeddings, and the final norm in the port's run
    and alone on the golden's last layer output."""
    out = [("embeddings", payload["embeddings"])] if payload.get("embeddings") else []
    final = payload.get("final_norm") or {}
    out += [(f"final_norm ({where})", final[key]) for key, where in
            (("cumulative", "port's run"), ("local", "alone on the golden's last layer output")) if key in final]
    return out


def format_bisect(payload: dict) -> str:
    judged = ("local = the layer alone on the golden's input to it (the verdict), cumulative = the port's own run"
              if payload["mode"] == "capture" else
              "cumulative = the read-out of a build of the first layer+1 layers (the verdict); only the "
              "prefixes the search built are listed")
    head = (f"bisect ({payload['mode']} mode): backend={payload['backend']} tp={payload['tp']} "
            f"dtype={payload['dtype']}; tolerance: error <= {ENVELOPE_FACTOR}x the bf16 envelope of the same "
            f"point; {judged}")
    lines = [head, _table(BISECT_HEADERS, bisect_rows(payload["layers"]))]
    lines += bisect_summary_lines(payload)
    stage = payload.get("fp32_stage")
    if stage:
        lines.append(f"fp32 stage (the port in fp32 against the golden's fp32 reference to fp32 precision): "
                     f"{'pass' if stage['passed'] else 'FAIL'}")
        for f in stage["failures"][:6]:
            lines.append(f"  FAIL {f['point']} at {f.get('where')}")
    lines.append("BISECT PASS" if payload["passed"] else "BISECT FAIL")
    return "\n".join(lines)


def _bisect_markdown_lines(payload: dict) -> list[str]:
    """mode, cause, NaN/Inf, builds and notes; the first bad layer's points in a code block."""
    lines = [f"mode: {payload['mode']} (backend {payload['backend']}, tp {payload['tp']}, {payload['dtype']}); "
             f"builds: {payload['builds']}"]
    if payload.get("first_divergent_point") and payload["first_divergent_layer"] is None:
        lines.append(f"first divergent point: **{payload['first_divergent_point']}** (outside the decoder layers)")
    if payload.get("cause"):
        lines.append(f"cause: **{payload['cause']}**: {CAUSES.get(payload['cause'], '')}")
    nf = payload.get("nonfinite")
    lines.append("NaN/Inf: none" if not nf else
                 f"NaN/Inf first at layer **{nf['layer']}**, point `{nf['point']}` ({nf.get('where', '')})")
    lines += [f"note: {n}" for n in payload.get("notes", [])]
    return lines


def markdown_summary(kind: str, payload: dict) -> str:
    first = payload.get("first_divergent_layer")
    lines = [f"# gemma-parity {kind}", "",
             f"- verdict: **{'PASS' if payload.get('passed', first is None) else 'FAIL'}**",
             f"- first divergent layer: **{first if first is not None else 'none'}**"]
    if payload.get("component"):
        lines.append(f"- component: **{payload['component']}**")
    if "seq_match" in payload:
        seq = payload["seq_match"]
        lines.append(f"- SEQ_MATCH: **{seq if seq is not None else 'not available (no decode in this mode)'}**")
    if payload.get("near_tie_flips") is not None:
        lines.append(f"- token mismatches: {payload['near_tie_flips']} near-tie flips, "
                     f"{payload['real_divergences']} real divergences")
    lines.append(f"- tolerance: error <= {ENVELOPE_FACTOR}x the bf16 CPU envelope at each capture point")
    if kind == "bisect":
        lines += [f"- {line}" for line in _bisect_markdown_lines(payload)]
        headers, rows = BISECT_HEADERS, bisect_rows(payload["layers"])
    else:
        headers = LAYER_HEADERS
        rows = layer_rows(payload["layers"]) if payload["layers"] and "rel_l2" in payload["layers"][0] else []
    lines += ["", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    if kind == "bisect":  # the first bad layer's points, explained (Polygraphy-style)
        lines += ["", "```", *bisect_summary_lines(payload), "```"]
    lines.append("")
    lines.append(f"![per-layer error]({kind}_errors.png)")
    return "\n".join(lines) + "\n"


def _series(layers: list[dict], key: str | None, scale: float = 1.0):
    """(x, y) under `key`; a JSON null (NaN/Inf, or not measured) becomes a gap in the line."""
    if not key or all(l.get(key) is None for l in layers):
        return [], []
    return ([l["index"] for l in layers],
            [math.nan if l.get(key) is None else max(scale * l[key], 1e-12) for l in layers])


def _shade_full_layers(ax, full_layers: list[int]) -> None:
    for f in full_layers:
        ax.axvspan(f - 0.5, f + 0.5, color="0.85", lw=0, zorder=0)


def plot_layer_errors(path: Path, layers: list[dict], full_layers: list[int], cumulative_key: str,
                      local_key: str | None, envelope_key: str | None, title: str,
                      local_envelope_key: str | None = None, ratio_keys: tuple[str, ...] = (),
                      num_layers: int | None = None, cumulative_label: str = "cumulative (port's own run)") -> bool:
    """Per-layer error on a log scale: cumulative and local error, each with its tolerance line
    (ENVELOPE_FACTOR x its bf16 envelope), full-attention layers shaded, failing layers drawn in
    red, the first one marked; NaN/Inf drawn as a red x on the top edge. With `ratio_keys`, a second
    panel shows error / envelope against the flat tolerance: where the error jumps is where a curve
    leaves the band. Returns False when matplotlib (the `plot` extra) is not installed."""
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
    styles = [(cumulative_key, envelope_key, "tab:blue", "o-", cumulative_label),
              (local_key, local_envelope_key, "tab:orange", "s-", "local (layer alone on the golden's input)")]
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
    ax.axhspan(0, ENVELOPE_FACTOR, color="tab:green", alpha=0.06, lw=0)
    first = _first_failure(layers)
    if first is not None:
        ax.axvline(first["index"], color="red", lw=1.2, alpha=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("error / bf16 envelope")


def _bisect_title(payload: dict) -> str:
    first, point = payload.get("first_divergent_layer"), payload.get("first_divergent_point")
    if first is not None:
        verdict = f"first divergent layer {first}: {payload.get('component')} ({payload.get('cause')})"
    else:
        verdict = f"layers within the policy, {point} is not ({payload.get('cause')})" if point else "no divergent layer"
    return f"gemma-parity bisect ({payload.get('mode')} mode): {verdict}"


def write_report(report_dir, kind: str, payload: dict, spec) -> Path:
    """Markdown summary, the JSON and a PNG plot into report_dir (each file written atomically)."""
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(report_dir / f"{kind}.json", payload)
    layers = payload["layers"]
    if kind == "check":
        ok = plot_layer_errors(report_dir / f"{kind}_errors.png", layers, spec.full_layers, "rel_l2", None,
                               "envelope_rel_l2", "gemma-parity check: per-layer error")
    else:
        ok = plot_layer_errors(report_dir / f"{kind}_errors.png", layers, spec.full_layers, "cumulative_rel_l2",
                               "local_rel_l2", "envelope_rel_l2", _bisect_title(payload),
                               local_envelope_key="local_envelope_rel_l2",
                               ratio_keys=("cumulative_ratio", "local_ratio"), num_layers=spec.num_layers,
                               cumulative_label="cumulative (port's own run)" if payload.get("mode") == "capture"
                               else "cumulative (read-out of a build of the first layer+1 layers)")
    text = markdown_summary(kind, payload)
    if not ok:
        text += "\n(plot skipped: install the `plot` extra for matplotlib)\n"
    write_text_atomic(report_dir / f"{kind}.md", text)
    return report_dir


# ---- graph statistics ----------------------------------------------------------------------------

def format_graph_stats(result: dict) -> str:
    """The per-graph table (one rank; GFLOP and GiB/MiB in binary units for bytes)."""
    head = (f"graphs of {result['source']} at tp={result['tp']} (rank 0), {result['dtype']}, KV length "
            f"{result['kv_len']}, layers {result['layers']}")
    rows = ["| graph | tokens | matmul GFLOP | weights read (GiB) | KV state (MiB) | returned to host (KiB) "
            "| all-reduce | all-gather | HLO ops | contracts |", "|---|---|---|---|---|---|---|---|---|---|"]
    for tag, g in result["graphs"].items():
        t = g["total"]
        rows.append(f"| {tag} | {g['length']} | {t['dot_flops'] / 1e9:.1f} | {t['weight_bytes'] / 2**30:.2f} "
                    f"| {t['state_bytes'] / 2**20:.1f} | {t['returned_bytes'] / 2**10:.0f} "
                    f"| {t['collectives'].get('all-reduce', 0)} | {t['collectives'].get('all-gather', 0)} "
                    f"| {t['ops_total']} | {'pass' if not g['contract_violations'] else 'FAIL'} |")
    return "\n".join([head, ""] + rows)
