"""Human-readable tables, Markdown summaries, JSON and the per-layer error plot."""

from __future__ import annotations

from pathlib import Path

from harness.base.atomic import write_json_atomic, write_text_atomic
from harness.judge.compare import ENVELOPE_FACTOR, FP32_FACTOR
from harness.report.bisect import (BISECT_HEADERS, CAUSES, bisect_markdown_lines, bisect_rows,  # noqa: F401
                                   bisect_summary_lines, format_bisect)
from harness.report.plot import bisect_title, plot_layer_errors
from harness.report.seconds import seconds_lines
from harness.report.table import fmt, table


def format_info(payload: dict) -> str:
    rows = [[l["index"], "full" if l["type"] == "full_attention" else "sliding", l["head_dim"], l["q_heads"],
             l["kv_heads"], "yes" if l["k_eq_v"] else "", l["window"] or "", f"{l['rope_type']}/{l['rotated_freqs']}",
             l["q_heads_per_rank"], l["kv_heads_per_rank"], l["groups"], l["kv_layout"]]
            for l in payload["layers"]]
    mem = payload["memory"]
    return "\n".join([
        f"spec {payload['spec_hash']} from {payload['source']}",
        *([payload["inert"]] if payload.get("inert") else []),
        f"{len(payload['layers'])} layers, hidden {payload['hidden_size']}, vocab {payload['vocab_size']}, "
        f"softcap {payload['final_logit_softcapping']}; sharding plan at tp={payload['tp']}:",
        table(["layer", "type", "head_dim", "q", "kv", "k=v", "window", "rope/rotated", "q/rank",
                "kv/rank", "groups", "kv"], rows),
        f"bytes per rank ({payload['dtype']}{', ' + mem['quantize'] + ' weights' if mem.get('quantize') else ''}): {size_text(mem['total'])} = weights {size_text(mem['weights'])} "
        f"+ KV cache {size_text(mem['kv_cache'])}; host-side embeddings {size_text(mem['host_embeddings'])}",
        *payload.get("notes", []),
    ])


def size_text(n_bytes: float) -> str:
    """A byte count in the binary unit that fits it, the one unit of every memory figure a person
    reads (the device plan's 16 GiB cores): 11.15 GiB, 44.00 MiB, 943.03 KiB, 786 B; never
    "0.00 GiB" for a small model. Rates stay in GB/s, as the hardware's are published."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes:.0f} B"


def layer_rows(layers: list[dict]) -> list[list]:
    """Check rows: the cumulative error of the port's run, its ratio to the envelope, (CPU) the
    ratio of the layer alone on the reference's input, and (when the fp32 stage ran) the layer's
    worst point in the fp32 stage against its own judge."""
    fp32 = _has_fp32(layers)
    first = next((l["index"] for l in layers if not l.get("fp32_pass", True)), None)
    return [[l["index"], "full" if l["type"] == "full_attention" else "sliding", fmt(l["rel_l2"]),
             f"{l['cosine']:.6f}", fmt(l["max_abs"]), fmt(l["envelope_rel_l2"]),
             f"{max(l['ratio'], l['position_ratio']):.2f}",
             f"{l['local_ratio']:.2f}" if l.get("local_ratio") is not None else "-",
             *([_ratio_text(l.get("fp32_ratio"), l.get("fp32_pass", True))] if fp32 else []),
             _check_verdict(l, first)] for l in layers]


def _has_fp32(layers: list[dict]) -> bool:
    return any("fp32_pass" in l for l in layers)


def _ratio_text(ratio, passed: bool) -> str:
    if ratio is None:
        return "-" if passed else "nan/inf"
    return f"{ratio:.2f}"


def _check_verdict(l: dict, first_fp32: int | None = None) -> str:
    """A layer that passes alone but fails in the port's run carries error from upstream: the
    failure is the upstream layer's, not this one's. The fp32 stage (no local verdicts: its error is
    cumulative) names its point at the first layer it fails; a later layer it fails says where that was."""
    if l.get("carries_upstream_error"):
        verdict = "pass alone (upstream error)"
    else:
        verdict = "pass" if l["pass"] else f"FAIL ({l['component']})"
    if l.get("fp32_pass", True):
        return verdict
    if l["index"] == first_fp32:
        fp32 = f"FAIL fp32 ({l.get('fp32_point')})"
        return fp32 if verdict == "pass" else f"{verdict}; {fp32}"
    return f"fp32 fails (first at layer {first_fp32})" if verdict == "pass" else verdict


LAYER_HEADERS = ["layer", "type", "rel_l2", "cosine", "max_abs", "bf16 env", "ratio", "local ratio", "verdict"]


def layer_headers(layers: list[dict]) -> list[str]:
    """LAYER_HEADERS, with the fp32 stage's column before the verdict when it ran."""
    return LAYER_HEADERS[:-1] + ["fp32 ratio"] + LAYER_HEADERS[-1:] if _has_fp32(layers) else LAYER_HEADERS


def _stage_summary(name: str, stage: dict) -> list[str]:
    """One stage: its judge, and each failure with the point and where (or the point count)."""
    verdict = "pass" if stage["passed"] else "FAIL"
    lines = [f"{name} stage ({stage['judge']}): {verdict}, {stage['points']} capture points"]
    for f in stage["failures"][:SHOWN_FAILURES]:
        ratio = f" {f['ratio']:.1f}x" if f.get("ratio") is not None else ""
        detail = f" ({f['detail']})" if f.get("detail") else ""
        lines.append(f"  FAIL {f['point']}{ratio} at {f.get('where')}{detail}")
    if len(stage["failures"]) > SHOWN_FAILURES:
        lines.append(f"  ... and {len(stage['failures']) - SHOWN_FAILURES} more (see --json)")
    return lines


def _port_error_lines(err: dict) -> list[str]:
    return [f"exception inside the port ({err['phase']}): {err['type']}: {err['message']}",
            f"  raised at {err['where']}"]


SHOWN_FAILURES = 8  # failures listed per stage in the text output
# Token flips listed in the text output; the rest are counted, and every one is in the JSON.
SHOWN_FLIPS = 5


def _prompt_lines(payload: dict) -> list[str]:
    lines, shown, hidden = [], 0, 0
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
                if shown == SHOWN_FLIPS:
                    hidden += 1
                    continue
                shown += 1
                lines.append(f"    position {m['position']}: reference {m['reference_token']} vs device "
                             f"{m['device_token']} -> {m['kind']}: {m.get('evidence', '')}")
    if hidden:
        lines.append(f"... {hidden} more token flips not listed (the first {SHOWN_FLIPS} are above; every flip "
                     "is in the JSON: --json FILE)")
    return lines


def seq_match_line(payload: dict) -> str:
    """SEQ_MATCH with what it means here: True, every prompt's greedy tokens equal the reference's;
    False above PARITY PASS, every departure was judged a tie (a near tie inside the band, or a
    saturation tie), which parity allows."""
    seq = payload["seq_match"]
    if seq is not False:
        return f"SEQ_MATCH {seq}" + (" (every prompt's greedy tokens equal the reference's)" if seq else "")
    departed = [str(k) for k, p in enumerate(payload.get("prompts") or []) if p.get("seq_match") is False]
    where = f"in prompt{'s' if len(departed) > 1 else ''} {', '.join(departed)}" if departed else "somewhere"
    why = ("every departure is a near or saturation tie (the band above), which parity allows" if payload["passed"]
           else "see the flips above: a departure that is no tie fails the check")
    return f"SEQ_MATCH False (the greedy tokens departed from the reference's {where}; {why})"


def format_check(result, verbose: bool = False, extra: tuple[str, ...] = ()) -> str:
    """The layer table, the edge points, the prompts, each stage's summary, then `extra` (the
    served build's and other extra stages' verdicts), then the verdict lines."""
    payload = result.to_json() if hasattr(result, "to_json") else result
    fp32 = (f"; fp32 ratio: the layer's worst point in the fp32 stage, error <= {FP32_FACTOR:g}x the fp32 "
            "reference's own error against float64" if _has_fp32(payload["layers"]) else "")
    lines = [f"port: backend={payload['backend']} tp={payload['tp']} dtype={payload['dtype']}; "
             f"tolerance: error <= {ENVELOPE_FACTOR}x the bf16 CPU envelope at each point "
             f"(ratio: the port's run; local ratio: each layer alone on the reference's input{fp32})"]
    if payload["layers"]:
        lines.append(table(layer_headers(payload["layers"]), layer_rows(payload["layers"])))
    for key in ("embeddings", "final_norm", "logits", "decode_logits"):
        p = payload.get(key)
        if p:
            lines.append(f"{key}: rel_l2 {fmt(p['rel_l2'])} (envelope {fmt(p['envelope_rel_l2'])}, ratio "
                         f"{max(p['ratio'], p['position_ratio']):.2f}) {'pass' if p['passed'] else 'FAIL'}")
    if not payload.get("embeddings_exact", True):
        lines.append(f"embeddings: FAIL, not bit-exact with the {payload['dtype']} reference's lookup "
                     "(is sqrt(hidden) cast to the weight dtype before the multiply?)")
    lines += _prompt_lines(payload)
    calibration = payload.get("near_tie_calibration")
    if calibration:
        basis = ("the largest" if calibration["quantile"] >= 1 else f"the {calibration['quantile']:g} quantile")
        lines.append(f"near-tie band {calibration['band']:.3f} logits = {calibration['factor']:g} x {basis} "
                     f"({calibration['shift_at_quantile']:.3f}) of how far bf16 moves the reference's top-1 margins "
                     f"against fp32 ({calibration['samples']} margins), for flips not decided on the port's own path; "
                     "a flip the fp32 stage also shows is never a near tie")
    if payload.get("routing"):
        lines.append(payload["routing"]["summary"])
    for name in ("fp32", "bf16"):
        stage = payload.get("stages", {}).get(name)
        if stage:
            lines += _stage_summary(name, stage)
            if stage.get("port_error"):
                lines += _port_error_lines(stage["port_error"])
    lines += list(extra)
    lines += [f"note: {n}" for n in payload.get("notes", [])]
    if verbose:
        lines += seconds_lines(payload.get("seconds") or {})
    first = payload["first_divergent_layer"]
    where = f"{first} ({payload.get('first_divergent_component')})" if first is not None else "none"
    lines.append(f"first divergent layer: {where}; near-tie flips "
                 f"{payload['near_tie_flips']}, real divergences {payload['real_divergences']}")
    lines.append(seq_match_line(payload))
    if payload.get("first_failure"):
        f = payload["first_failure"]
        lines.append(f"first failure: {f['stage']} stage, {f['point']} at {f.get('where')}")
    lines.append("PARITY PASS" if payload["passed"] else
                 f"PARITY FAIL (stage {', '.join(payload.get('failed_stages') or ['?'])})")
    return "\n".join(lines)


# ---- report directory --------------------------------------------------------------------------

# ---- bisect ------------------------------------------------------------------------------------

def _check_markdown_lines(payload: dict) -> list[str]:
    """The failed stage(s) and the first failure: where to start reading."""
    failed = payload.get("failed_stages") or []
    lines = [f"- failed stage: **{', '.join(failed) if failed else 'none'}**"]
    first = payload.get("first_failure")
    if first:
        detail = f" ({first['detail']})" if first.get("detail") else ""
        lines.append(f"- first failure: **{first['stage']} stage, `{first['point']}`** at {first.get('where')}{detail}")
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
    if kind == "check":
        lines += _check_markdown_lines(payload)
    if kind == "bisect":
        lines += [f"- {line}" for line in bisect_markdown_lines(payload)]
        headers, rows = BISECT_HEADERS, bisect_rows(payload["layers"])
    else:
        headers = layer_headers(payload["layers"])
        rows = layer_rows(payload["layers"]) if payload["layers"] and "rel_l2" in payload["layers"][0] else []
    lines += ["", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    if kind == "bisect":  # the first bad layer's points, explained (Polygraphy-style)
        lines += ["", "```", *bisect_summary_lines(payload), "```"]
    lines.append("")
    lines.append(f"![per-layer error]({kind}_errors.png)")
    return "\n".join(lines) + "\n"


def write_report(report_dir, kind: str, payload: dict, spec) -> Path:
    """Markdown summary, the JSON and a PNG plot into report_dir, replaced as a whole (harness/base/owned_dir.py)."""
    from harness.base.owned_dir import owned_directory

    report_dir = Path(report_dir)
    with owned_directory(report_dir, "--report", kind) as tmp:
        _write_report_files(tmp, kind, payload, spec)
    return report_dir


def _write_report_files(report_dir: Path, kind: str, payload: dict, spec) -> None:
    write_json_atomic(report_dir / f"{kind}.json", payload)
    layers = payload["layers"]
    path = report_dir / f"{kind}_errors.png"
    if kind == "check":
        ok = plot_layer_errors(path, layers, "gemma-parity check: per-layer error", full_layers=spec.full_layers,
                               cumulative=("rel_l2", "envelope_rel_l2", "cumulative (port's own run)"),
                               ratio_keys=("cumulative_ratio", "local_ratio"), num_layers=spec.num_layers)
    else:
        label = ("cumulative (port's own run)" if payload.get("mode") == "capture"
                 else "cumulative (read-out of a build of the first layer+1 layers)")
        ok = plot_layer_errors(path, layers, bisect_title(payload), full_layers=spec.full_layers,
                               cumulative=("cumulative_rel_l2", "envelope_rel_l2", label),
                               ratio_keys=("cumulative_ratio", "local_ratio"), num_layers=spec.num_layers)
    text = markdown_summary(kind, payload)
    if not ok:
        text += "\n(plot skipped: install the `plot` extra for matplotlib)\n"
    write_text_atomic(report_dir / f"{kind}.md", text)


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
