"""`bisect`'s text: the per-layer table, the first bad layer's points explained, its Markdown lines."""

from __future__ import annotations

from harness.judge.compare import ENVELOPE_FACTOR
from harness.report.table import fmt, table


BISECT_HEADERS = ["layer", "type", "golden std", "port std", "cumulative", "cum env", "local", "local env",
                  "tolerance", "needs", "verdict"]


def _opt(x, fmt=fmt) -> str:
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
    return "inf" if x is None else fmt(x)


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
        lines += diagnosis_lines(payload)
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


PART_NAMES = {"k": "keys", "v": "values", "attn_residual": "attention residual", "mlp_residual": "MLP residual",
              "output": "scaled output", "router_logits": "router logits", "expert_weights": "expert weights",
              "per_layer_input": "per-layer input"}


def _reading(wrong: set[str]) -> str | None:
    """Where the points that fail put the error, read the way the layer computes."""
    if {"k", "v"} <= wrong:
        return "keys and values both wrong: the layer's input norm, or a projection both read (k=v layers)"
    if "k" in wrong:
        return "keys wrong, values right: the error enters through the keys (k_proj, k_norm or RoPE on the keys)"
    if "v" in wrong:
        return "values wrong, keys right: the error enters through the values (v_proj or v_norm)"
    if "attn_residual" in wrong:
        return ("keys and values right, attention residual wrong: the queries, the attention itself (mask, "
                "scale, softmax) or o_proj")
    if wrong & {"mlp_residual", "output"}:
        return "attention residual right: the error is in the MLP half (or the layer's output scale)"
    return None


def diagnosis_lines(payload: dict) -> list[str]:
    """The first bad layer's points, which fail and which pass, and the pattern across layer types
    (what bisect_errors.png shows), in words."""
    d = payload.get("diagnosis")
    if not d:
        return []
    kind = "full" if d["type"] == "full_attention" else "sliding"
    shown = [f"{PART_NAMES.get(p['part'], p['part'])} {'right' if p['passed'] else 'WRONG'} "
             f"({'inf' if p['ratio'] is None else format(p['ratio'], '.2f')}x, {p['where']})" for p in d["points"]]
    lines = [f"diagnosis: layer {d['layer']} ({kind}): " + "; ".join(shown)]
    reading = _reading({p["part"] for p in d["points"] if not p["passed"]})
    if reading:
        lines.append(f"  {reading}")
    pattern = _type_pattern(d.get("by_type") or {})
    if pattern:
        lines.append(f"  by layer type, each layer alone on the golden's input: {pattern}")
    return lines


def _type_pattern(by_type: dict) -> str | None:
    if not by_type:
        return None
    names = {t: "full" if t == "full_attention" else "sliding" for t in by_type}
    counts = ", ".join(f"{names[t]} {c['fail_alone']} of {c['layers']} fail" for t, c in by_type.items())
    every_fails = [names[t] for t, c in by_type.items() if c["fail_alone"] == c["layers"]]
    every_passes = [names[t] for t, c in by_type.items() if c["fail_alone"] == 0]
    if len(by_type) > 1 and every_fails and len(every_fails) + len(every_passes) == len(by_type) and every_passes:
        return (f"{counts}: every {' and '.join(every_fails)} layer fails alone, every "
                f"{' and '.join(every_passes)} layer passes")
    if every_fails and len(every_fails) == len(by_type):
        return f"{counts}: every layer fails alone"
    return counts


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
    lines = [head, table(BISECT_HEADERS, bisect_rows(payload["layers"]))]
    lines += bisect_summary_lines(payload)
    stage = payload.get("fp32_stage")
    if stage:
        lines.append(f"fp32 stage (the port in fp32 against the golden's fp32 reference to fp32 precision): "
                     f"{'pass' if stage['passed'] else 'FAIL'}")
        for f in stage["failures"][:6]:
            lines.append(f"  FAIL {f['point']} at {f.get('where')}")
    lines.append("BISECT PASS" if payload["passed"] else "BISECT FAIL")
    return "\n".join(lines)


def bisect_markdown_lines(payload: dict) -> list[str]:
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


