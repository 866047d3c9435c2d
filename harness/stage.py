"""One stage judged: what harness.observe saw of the port and the references, judged point by
point, token by token and distribution by distribution with compare.py's rules for that stage."""

from __future__ import annotations

import torch

from harness.compare import (BF16, StageJudge, calibrate_near_ties, classify_departure, compare_layers,
                             compare_logits, compare_point, compare_probabilities)
from harness.points import Point
from harness.results import CheckResult, PromptOutcome
from harness.verdicts import NearTieCalibration, ProbabilityResult


def near_tie_calibration(ref32: list, ref16: list) -> NearTieCalibration:
    """The near-tie band from the references alone: every prompt's prefill rows and decode steps."""
    pairs = [(a.captures["logits"], b.captures["logits"]) for a, b in zip(ref32, ref16)]
    pairs += [(a.step_logits, b.step_logits) for a, b in zip(ref32, ref16) if a.step_logits is not None]
    return calibrate_near_ties(pairs)


def structural_flips(fp32: CheckResult | None) -> dict:
    """(prompt, "prefill"|"decode") -> rows where the fp32 port's token differs from the reference."""
    flips: dict = {}
    for k, pr in enumerate(fp32.prompts if fp32 else []):
        flips[(k, "prefill")] = {m.position for m in pr.prefill.mismatches}
        flips[(k, "decode")] = {m.position for m in pr.decode.mismatches}
        if pr.departure is not None:
            flips[(k, "decode")].add(pr.departure.position)
    return flips


def judge_tokens(obs, k: int, cap, flips: tuple, judge: StageJudge = BF16) -> PromptOutcome:
    """Prompt k's tokens: prefill rows and teacher-forced steps flip by flip, and where the free run
    departs; the same classifier for every command. flips = (calibrated band, structural flips)."""
    band, structural = flips
    run, r32 = obs.runs[k], obs.ref32[k]
    band = judge.tie_band(band, r32.captures["logits"])
    prefill = compare_logits(run.forced.prefill.logits, r32.captures["logits"], None, cap, band=band,
                             structural=structural.get((k, "prefill"), set()),
                             ref_capped=r32.captures.get("capped_logits"), dev_probs=run.prefill_probs,
                             ulp_floor=judge.envelope_ties)
    decode = compare_logits(run.forced.step_logits, r32.step_logits, None, cap, ref_tokens=r32.generated, band=band,
                            structural=structural.get((k, "decode"), set()),
                            ref_capped=r32.captures.get("step_capped_logits"), dev_probs=run.step_probs,
                            ulp_floor=judge.envelope_ties)
    departure = classify_departure(r32, run, band, structural.get((k, "decode"), set()), judge)
    return PromptOutcome(prompt=r32.prompt, reference_tokens=r32.generated, device_tokens=run.free.tokens,
                         prefill=prefill, decode=decode, departure=departure)


def _probabilities(obs, cap) -> list[ProbabilityResult]:
    """The host transform as a function, in both stages: the host's served distribution for the
    port's own raw logits against transformers' capped distribution of the same logits (fp32)."""
    from harness.reference import transformers_capped

    out = [compare_probabilities("probabilities", torch.cat([r.prefill_probs for r in obs.runs]),
                                 transformers_capped(torch.cat([r.forced.prefill.logits for r in obs.runs]), cap))]
    steps = [r for r in obs.runs if r.forced.step_logits.shape[0]]
    if steps:
        out.append(compare_probabilities("decode_probabilities", torch.cat([r.step_probs for r in steps]),
                                         transformers_capped(torch.cat([r.forced.step_logits for r in steps]), cap)))
    return out


def fp32_envelope(obs, checkpoint, progress: bool = False) -> dict:
    """The fp32 stage's envelope values: transformers in float64 along the fp32 reference's path
    (harness/reference64.py), stacked as the observation's rows (the stage's `env`)."""
    from harness.observe import assemble_observation
    from harness.reference64 import float64_references

    ref64 = float64_references(checkpoint, obs.ref32, progress)
    return assemble_observation(obs.stage, obs.runs, checkpoint.spec, (obs.ref32, ref64), obs.reads_cache).env


def _notes(obs, backend: str) -> list[str]:
    notes = [] if obs.reads_cache else [
        f"{obs.stage} stage: the {backend} backend cannot read its KV cache; the cache is judged in the fp32 stage"]
    if not any(n.startswith("decode.layers.") for n in obs.dev) and any(r.generated for r in obs.ref32):
        notes.append(f"{obs.stage} stage: the reference has no per-layer decode captures (an older golden?); "
                     "decode is judged at its logits only")
    return notes


def judge_stage(obs, spec, calibration: NearTieCalibration, structural: dict, port: tuple) -> CheckResult:
    """A stage's observation judged by its StageJudge (obs.stage); port = (backend, tp, dtype name)."""
    from harness.compare import JUDGES

    judge, (backend, tp, dtype) = JUDGES[obs.stage], port
    dev, ref, env = obs.dev, obs.ref, obs.env
    same_dtype = obs.ref16 if dtype == "bfloat16" else obs.ref32
    exact = all(torch.equal(run.forced.prefill.captures["embeddings"], r.captures["embeddings"])
                for run, r in zip(obs.runs, same_dtype))
    point = {n: compare_point(n, dev[n], ref[n], env[n], judge) for n in
             ("embeddings", "final_norm", "logits", "decode_logits", "decode.embeddings", "decode.final_norm")
             if n in dev}
    cap = spec.final_logit_softcapping
    return CheckResult(
        backend=backend, tp=tp, dtype=dtype, stage=obs.stage, judge=judge.describe(), embeddings_exact=exact,
        embeddings=point["embeddings"], layers=compare_layers(spec, (dev, ref, env), judge),
        final_norm=point["final_norm"], logits=point["logits"], decode_logits=point.get("decode_logits"),
        prompts=[judge_tokens(obs, k, cap, (calibration.band, structural), judge) for k in range(len(obs.runs))],
        calibration=calibration, decode_layers=compare_layers(spec, (dev, ref, env), judge, decode=True),
        decode_points=[point[n] for n in ("decode.embeddings", "decode.final_norm") if n in point],
        kv=[compare_point(n, dev[n], ref[n], env[n], judge) for n in dev if Point.parse(n).kind == "kv"],
        probabilities=_probabilities(obs, cap), row_labels=obs.labels, notes=_notes(obs, backend),
        seconds={"port": round(obs.seconds, 2)}, observation=obs)
