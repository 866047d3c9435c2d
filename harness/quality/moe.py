"""The corpus judge on MoE models: the same routing policy as `check` (harness/judge/routing.py).

bf16 legitimately flips a near-tied router choice, and one flipped expert puts a whole expert's
output into the residual stream: a port and a bf16 reference routing each on their own noise make
the corpus statistics compare one rare, heavy draw with another (issue 26: a healthy 26B-A4B-like
port failed `quality` over 192 ids). So, as `check` does, routing is teacher-forced: for every
window the fp32 and bf16 references are computed again (streamed, one layer at a time) with their
routers forced to the port's choices, the port's statistics and the bf16 reference's are taken
against that fp32 reference, and every port choice off the fp32 reference's own top-k (on that
path) must be a near tie (routing.judge_decisions: the band calibrated from bf16's boundary-margin
shifts over the corpus), else the corpus verdict fails with the routing divergence.
"""

from __future__ import annotations

import torch

from harness.judge.routing import RouterDecisions, judge_decisions
from harness.quality.stats import bf16_columns, position_metrics, reference_stats
from harness.reference.forcing import follow_routes


def port_window(engine, window: list[int], capture: bool = False) -> tuple[torch.Tensor, dict]:
    """The one window pass of `quality` (dense and MoE): raw logits [window - 1, vocab] at every
    position but the last, teacher-forced through the one decode loop (harness.port.decode: the
    first min(window - 1, largest bucket) tokens prefilled, the rest fed one at a time), and with
    `capture` the port's expert weights per MoE layer there ({point name: [window - 1, experts]})."""
    from harness.port.decode import forced, generate

    n = len(window) - 1
    first = min(n, max(engine.buckets))
    run = generate(engine, [window[:first]], n - first + 1, forced([window[first:n]]), capture=capture)[0]
    rows = torch.cat([run.prefill.logits, run.step_logits[1:]])  # step 0 is the prefill's last row
    caps = {k: torch.cat([v, run.step_captures[k]]) if k in run.step_captures else v
            for k, v in run.prefill.captures.items() if k.endswith(".expert_weights")}
    return rows[:n], {k: v[:n] for k, v in caps.items()}


def _forced_references(checkpoint, windows: list[list[int]], forcing: list[Forced]) -> dict:
    """{dtype: [captures per window]} of the fp32 and bf16 references along `forcing`, streamed."""
    from harness.reference.stream import stream_prefill_captures_many

    return {dtype: stream_prefill_captures_many(checkpoint, windows, dtype, forcing=forcing)
            for dtype in (torch.float32, torch.bfloat16)}


def moe_part_columns(checkpoint, engine, tokens: torch.Tensor, topk: int) -> tuple[dict, list]:
    """One golden part's windows [W, window] judged along the port's routing: the per-position
    columns quality_judge collects, and the routing decisions (name, port weights, fp32 router
    logits, bf16 router logits) for routing.judge_decisions."""
    top_k = checkpoint.spec.moe.top_k
    runs = [port_window(engine, w.tolist(), capture=True) for w in tokens]
    windows = [w[:-1].tolist() for w in tokens]
    refs = _forced_references(checkpoint, windows, [follow_routes(weights, top_k) for _, weights in runs])
    cols: dict[str, list] = {}
    decisions = []
    for k, (logits, weights) in enumerate(runs):
        r32, r16 = refs[torch.float32][k], refs[torch.bfloat16][k]
        targets = tokens[k][1:]
        ref = reference_stats(r32["capped_logits"], targets, topk)
        bf16 = position_metrics(ref, torch.log_softmax(r16["capped_logits"].double(), -1), targets)
        port = position_metrics(ref, engine.probabilities(logits).double().clamp_min(1e-300).log(), targets)
        port["port_top1_id"] = logits.argmax(-1)
        port.update(bf16_columns(bf16), target_logprob=ref["target_logprob"], ref_top1_id=ref["topk_ids"][:, 0])
        for name, t in port.items():
            cols.setdefault(name, []).append(t)
        for name, w in weights.items():
            logits_name = name.replace("expert_weights", "router_logits")
            decisions.append(RouterDecisions(name, w, r32[logits_name], r16[logits_name]))
    return cols, decisions


def judge_moe_routing(decisions: list, top_k: int):
    """The port's router choices over the corpus, against the fp32 reference along its routing."""
    return judge_decisions(decisions, top_k, lambda name, row: f"{name} corpus row {row}")
