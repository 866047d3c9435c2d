"""One stage judged: what harness.parity.observe saw of the port and the references, judged point by
point, token by token, router decision by router decision and distribution by distribution with
compare.py's rules for that stage."""

from __future__ import annotations

import torch

from harness.judge.compare import (BF16, JUDGES, PLE_PIN_NOISE, POOLED_PARTS, StageJudge, compare_point,
                                   compare_probabilities, pooled_floors)
from harness.judge.tokens import calibrate_near_ties, classify_departure, compare_logits
from harness.base.points import Point, layer_points
from harness.judge.results import ParityStage, PromptOutcome
from harness.judge.routing import judge_routing
from harness.judge.verdicts import LayerResult, NearTieCalibration, ProbabilityResult


def near_tie_calibration(ref32: list, ref16: list) -> NearTieCalibration:
    """A check's token band from its references alone (tokens.calibrate_near_ties): every
    prompt's prefill rows and decode steps."""
    pairs = [(a.captures["logits"], b.captures["logits"]) for a, b in zip(ref32, ref16)]
    pairs += [(a.step_logits, b.step_logits) for a, b in zip(ref32, ref16) if a.step_logits is not None]
    return calibrate_near_ties(pairs)


def compare_layers(spec, observed, judge: StageJudge = BF16, decode: bool = False) -> list[LayerResult]:
    """Every layer whose points were observed, judged point by point (compare.compare_point):
    `observed` holds per point name the device's (.dev), the fp32 reference's (.ref) and the stage's
    envelope reference's (.env) rows (a harness.parity.observation.StageObservation). POOLED_PARTS are judged
    by at least their part's pooled envelope (compare.pooled_floors)."""
    dev, ref, env = observed.dev, observed.ref, observed.env
    judged = [(layer, layer_points(layer.index, decode, spec)) for layer in spec.layers]
    judged = [(layer, names) for layer, names in judged if all(n in dev for n in names)]
    pooled = {part: pooled_floors([n for _, names in judged for n in names if n.endswith("." + part)], ref, env)
              for part in POOLED_PARTS}
    return [LayerResult(layer.index, layer.type,
                        [compare_point(n, dev[n], ref[n], env[n], judge,
                                       pooled=pooled.get(n.rsplit(".", 1)[1], (0.0, 0.0))) for n in names])
            for layer, names in judged]


def structural_flips(fp32: ParityStage | None) -> dict:
    """(prompt, "prefill"|"decode") -> rows where the fp32 port's token differs from the reference."""
    flips: dict = {}
    for k, pr in enumerate(fp32.prompts if fp32 else []):
        flips[(k, "prefill")] = {m.position for m in pr.prefill.mismatches}
        flips[(k, "decode")] = {m.position for m in pr.decode.mismatches}
        if pr.departure is not None:
            flips[(k, "decode")].add(pr.departure.position)
    return flips


def judge_tokens(obs, k: int, cap, context) -> PromptOutcome:
    """Prompt k's tokens: prefill rows and teacher-forced steps flip by flip, and where the free run
    departs; the same classifier for every command. context: the stage's (harness.parity.observe.StageContext:
    its calibrated band and the fp32 stage's structural flips)."""
    judge: StageJudge = JUDGES[obs.stage]
    structural = context.structural
    run, r32 = obs.runs[k], obs.ref32[k]
    band = judge.tie_band(context.calibration.band, r32.captures["logits"])
    own = getattr(obs, "own_path", None)  # the bf16 stage: transformers' head alone on the port's input
    alone = {where: own.for_prompt(k, where) if own is not None else None for where in ("prefill", "decode")}
    prefill = compare_logits(run.forced.prefill.logits, r32.captures["logits"], None, cap, band=band,
                             structural=structural.get((k, "prefill"), set()),
                             ref_capped=r32.captures.get("capped_logits"), dev_probs=run.prefill_probs,
                             ulp_floor=judge.envelope_ties, alone=alone["prefill"])
    decode = compare_logits(run.forced.step_logits, r32.step_logits, None, cap, ref_tokens=r32.generated, band=band,
                            structural=structural.get((k, "decode"), set()),
                            ref_capped=r32.captures.get("step_capped_logits"), dev_probs=run.step_probs,
                            ulp_floor=judge.envelope_ties, alone=alone["decode"])
    departure = classify_departure(r32, run.free, band, forced=run.forced,
                                   structural=structural.get((k, "decode"), set()), judge=judge, alone=alone["decode"])
    return PromptOutcome(prompt=r32.prompt, reference_tokens=r32.generated, device_tokens=run.free.tokens,
                         prefill=prefill, decode=decode, departure=departure)


def _probabilities(obs, cap) -> list[ProbabilityResult]:
    """The host transform as a function, in both stages: the host's served distribution for the
    port's own raw logits against transformers' capped distribution of the same logits (fp32)."""
    from harness.reference.run import transformers_capped

    out = [compare_probabilities("probabilities", torch.cat([r.prefill_probs for r in obs.runs]),
                                 transformers_capped(torch.cat([r.forced.prefill.logits for r in obs.runs]), cap))]
    steps = [r for r in obs.runs if r.forced.step_logits.shape[0]]
    if steps:
        out.append(compare_probabilities("decode_probabilities", torch.cat([r.step_probs for r in steps]),
                                         transformers_capped(torch.cat([r.forced.step_logits for r in steps]), cap)))
    return out


def _notes(obs, spec, backend: str) -> list[str]:
    notes = [] if obs.reads_cache else [
        f"{obs.stage} stage: the {backend} backend cannot read its KV cache; the cache is judged in the fp32 stage"]
    if not any(n.startswith("decode.layers.") for n in obs.dev) and any(r.generated for r in obs.ref32):
        notes.append(f"{obs.stage} stage: the reference has no per-layer decode captures (an older golden?); "
                     "decode is judged at its logits only")
    if not obs.followed and (spec.moe is not None or spec.per_layer_input_size):
        notes.append(f"{obs.stage} stage: the golden comes from other weights: routing and per-layer inputs "
                     "are not teacher-forced (this checkpoint cannot reproduce its references)")
    if obs.pinned:
        pinned = obs.pinned
        notes.append(f"{obs.stage} stage: {len(pinned)} gated per-layer input rows have no direction at bf16 "
                     f"precision (expected bf16 error >= {PLE_PIN_NOISE:g} of the row); the references "
                     f"take the port's value there: {', '.join(pinned[:4])}{' ...' if len(pinned) > 4 else ''}")
    return notes


def judge_stage(obs, spec, context) -> ParityStage:
    """A stage's observation (harness.parity.observation.StageObservation) judged by its StageJudge
    (obs.stage), in its context (harness.parity.observe.StageContext: the labels, the near-tie
    calibration, the fp32 stage's structural flips); on MoE models the bf16 stage also judges
    every router decision (harness/judge/routing.py)."""
    judge = JUDGES[obs.stage]
    dev, ref, env = obs.dev, obs.ref, obs.env
    same_dtype = obs.ref16 if context.dtype == "bfloat16" else obs.ref32
    exact = all(torch.equal(run.forced.prefill.captures["embeddings"], r.captures["embeddings"])
                for run, r in zip(obs.runs, same_dtype))
    point = {n: compare_point(n, dev[n], ref[n], env[n], judge) for n in
             ("embeddings", "final_norm", "logits", "decode_logits", "decode.embeddings", "decode.final_norm")
             if n in dev}
    cap = spec.final_logit_softcapping
    return ParityStage(
        backend=context.backend, tp=context.tp, dtype=context.dtype, stage=obs.stage, judge=judge.describe(),
        embeddings_exact=exact, embeddings=point["embeddings"], layers=compare_layers(spec, obs, judge),
        final_norm=point["final_norm"], logits=point["logits"], decode_logits=point.get("decode_logits"),
        prompts=[judge_tokens(obs, k, cap, context) for k in range(len(obs.runs))],
        calibration=context.calibration, decode_layers=compare_layers(spec, obs, judge, decode=True),
        decode_points=[point[n] for n in ("decode.embeddings", "decode.final_norm") if n in point],
        kv=[compare_point(n, dev[n], ref[n], env[n], judge) for n in dev if Point.parse(n).kind == "kv"],
        probabilities=_probabilities(obs, cap), row_labels=obs.labels, notes=_notes(obs, spec, context.backend),
        routing=judge_routing(obs, spec) if obs.stage == "bf16" and spec.moe is not None else None,
        seconds={"port": round(obs.seconds, 2)}, observation=obs)
