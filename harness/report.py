"""Human-readable tables, Markdown summaries, JSON and the per-layer error plot."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

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
    ])


def _fmt(x: float) -> str:
    return "inf" if x == math.inf else f"{x:.2e}"


def layer_rows(layers: list[dict]) -> list[list]:
    return [[l["index"], "full" if l["type"] == "full_attention" else "sliding", _fmt(l["rel_l2"]),
             f"{l['cosine']:.6f}", _fmt(l["max_abs"]), _fmt(l["envelope_rel_l2"]),
             f"{max(l['ratio'], l['position_ratio']):.2f}", "pass" if l["pass"] else f"FAIL ({l['component']})"]
            for l in layers]


LAYER_HEADERS = ["layer", "type", "rel_l2", "cosine", "max_abs", "bf16 env", "ratio", "verdict"]


def format_check(result) -> str:
    payload = result.to_json() if hasattr(result, "to_json") else result
    lines = [f"port: backend={payload['backend']} tp={payload['tp']} dtype={payload['dtype']}; "
             f"tolerance: error <= {ENVELOPE_FACTOR}x the bf16 CPU envelope at each point",
             _table(LAYER_HEADERS, layer_rows(payload["layers"]))]
    for key in ("embeddings", "final_norm"):
        p = payload[key]
        lines.append(f"{key}: rel_l2 {_fmt(p['rel_l2'])} (envelope {_fmt(p['envelope_rel_l2'])}) "
                     f"{'pass' if p['passed'] else 'FAIL'}")
    for k, pr in enumerate(payload["prompts"]):
        lines.append(f"prompt {k} ({pr['prompt_length']} tokens): SEQ_MATCH {pr['seq_match']}")
        lines.append(f"  reference: {pr['reference_tokens']}")
        lines.append(f"  device:    {pr['device_tokens']}")
        for part in ("prefill_logits", "decode_logits_teacher_forced"):
            lg = pr[part]
            lines.append(f"  {part}: top1 {lg['top1_agreement']:.3f}, top{5} overlap {lg['topk_overlap']:.3f}, "
                         f"KL mean {lg['kl_mean']:.2e} max {lg['kl_max']:.2e}, near-tie flips {lg['near_ties']}, "
                         f"real divergences {lg['divergences']}")
            for m in lg["mismatches"]:
                lines.append(f"    position {m['position']}: reference {m['reference_token']} vs device "
                             f"{m['device_token']}, margin {m['margin']:.4f} vs near-tie threshold "
                             f"{m['threshold']:.4f} -> {m['kind']}")
    first = payload["first_divergent_layer"]
    lines.append(f"first divergent layer: {first if first is not None else 'none'}; near-tie flips "
                 f"{payload['near_tie_flips']}, real divergences {payload['real_divergences']}")
    lines.append(f"SEQ_MATCH {payload['seq_match']}")
    if not payload["seq_match"] and payload["real_divergences"] == 0:
        lines.append("(every token mismatch is a near-tie flip: the reference's top-1/top-2 margin is within "
                     "bf16 noise there, and teacher-forced decode keeps agreeing after it)")
    lines.append("PARITY PASS" if payload["passed"] else "PARITY FAIL")
    return "\n".join(lines)


# ---- report directory --------------------------------------------------------------------------

def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def markdown_summary(kind: str, payload: dict) -> str:
    first = payload.get("first_divergent_layer")
    lines = [f"# gemma-parity {kind}", "",
             f"- verdict: **{'PASS' if payload.get('passed', first is None) else 'FAIL'}**",
             f"- first divergent layer: **{first if first is not None else 'none'}**"]
    if payload.get("component"):
        lines.append(f"- component: **{payload['component']}**")
    if "seq_match" in payload:
        lines.append(f"- SEQ_MATCH: **{payload['seq_match']}**")
    if "near_tie_flips" in payload:
        lines.append(f"- token mismatches: {payload['near_tie_flips']} near-tie flips, "
                     f"{payload['real_divergences']} real divergences")
    lines.append(f"- tolerance: error <= {ENVELOPE_FACTOR}x the bf16 CPU envelope at each capture point")
    lines += ["", "| " + " | ".join(LAYER_HEADERS) + " |", "|" + "---|" * len(LAYER_HEADERS)]
    rows = layer_rows(payload["layers"]) if payload["layers"] and "rel_l2" in payload["layers"][0] else []
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    lines.append("")
    lines.append(f"![per-layer error]({kind}_errors.png)")
    return "\n".join(lines) + "\n"


def plot_layer_errors(path: Path, layers: list[dict], full_layers: list[int], cumulative_key: str,
                      local_key: str | None, envelope_key: str | None, title: str) -> bool:
    """Per-layer error on a log scale, full-attention layers marked, the tolerance line drawn.
    Returns False when matplotlib (the `plot` extra) is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    idx = [l["index"] for l in layers]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for f in full_layers:
        ax.axvspan(f - 0.5, f + 0.5, color="tab:orange", alpha=0.12, lw=0)
    floor = 1e-12
    ax.plot(idx, [max(l[cumulative_key], floor) for l in layers], "o-", label="cumulative rel L2")
    if local_key:
        ax.plot(idx, [max(l[local_key], floor) for l in layers], "s--", label="local rel L2 (layer on golden input)")
    if envelope_key:
        ax.plot(idx, [ENVELOPE_FACTOR * max(l[envelope_key], floor) for l in layers], "k:",
                label=f"tolerance ({ENVELOPE_FACTOR}x bf16 envelope)")
    bad = [l for l in layers if not l.get("pass", True)]
    if bad:
        ax.axvline(bad[0]["index"], color="red", lw=1.5, label=f"first divergent layer {bad[0]['index']}")
    ax.set_yscale("log")
    ax.set_xlabel("decoder layer (shaded: full attention)")
    ax.set_ylabel("relative L2 error vs fp32 reference")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(report_dir, kind: str, payload: dict, spec) -> Path:
    """Markdown summary, the JSON and a PNG plot into report_dir (each file written atomically)."""
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    _write_text_atomic(report_dir / f"{kind}.json", json.dumps(payload, indent=2, default=str) + "\n")
    layers = payload["layers"]
    if kind == "check":
        ok = plot_layer_errors(report_dir / f"{kind}_errors.png", layers, spec.full_layers, "rel_l2", None,
                               "envelope_rel_l2", "gemma-parity check: per-layer error")
    else:
        ok = plot_layer_errors(report_dir / f"{kind}_errors.png", layers, spec.full_layers, "cumulative_rel_l2",
                               "local_rel_l2", "envelope_rel_l2", "gemma-parity bisect: per-layer error")
    text = markdown_summary(kind, payload)
    if not ok:
        text += "\n(plot skipped: install the `plot` extra for matplotlib)\n"
    _write_text_atomic(report_dir / f"{kind}.md", text)
    return report_dir
