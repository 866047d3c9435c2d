"""The speculative stage of `check --assistant DIR --speculate K` (docs/speculative.md#the-judge).

Greedy verification hides every drafter bug in the tokens (only the speed-up dies), so three
things are judged:
- tokens: speculative greedy output against the reference, every departure classified as the
  served build's are (served.judge_served: a near tie of the calibrated band, nothing else);
- the drafter at its capture points against transformers' assistant fed the same target states
  (the port's own embedding, state, cache and position at each draft step): in fp32 by the fp32
  stage's judge, and in the run's dtype by the bf16 envelope; the masked head's chosen clusters
  exactly in fp32; each later step of a round must have been fed the step before's post-projection
  (`drafter.state_fed`); in bf16 the cluster choices are judged as a router's top-k is (harness/judge/routing.py:
  a choice other than the fp32 top-k is a near tie within the clusters' own band, calibrated from
  how far bf16 moves the centroid scores' top-k boundary, else a failure) and the logits of a step
  choosing other clusters, whose candidates differ, are left out of the envelope;
- acceptance: per prompt, the fp32 run's accepted draft tokens per verify call against
  transformers' target and assistant run under the port's rules with the same k (fp32), which
  must not fall more than acceptance_band below it; transformers' assisted generation's figure and
  the run dtype's acceptance are reported beside it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from harness.judge.compare import BF16, FP32, compare_point
from harness.judge.routing import RouterDecisions, judge_decisions
from harness.judge.stage_result import Gate, Stage, StageResult, ties
from harness.parity.served import _error, judge_served
from harness.parity.stages import observed_by
from harness.reference.assistant import DRAFTER

# The port's acceptance may fall below the like-for-like reference's (judge_acceptance) by at most
# max(ACCEPTANCE_FLOOR, fraction x the reference's) accepted tokens per verify: both run fp32 under
# the same rules (equal, draft for draft, on the tiny and mirror pairs), so only an fp32 near tie
# of a draft moves one round; a drafter that never helps, or an engine that caps acceptance, falls
# by most of it (the mirror pair: 2.67 -> <= 1).
ACCEPTANCE_FLOOR = 0.5
ACCEPTANCE_FRACTION = 0.35


def acceptance_band(reference: float) -> float:
    return max(ACCEPTANCE_FLOOR, ACCEPTANCE_FRACTION * reference)


@dataclass
class SpeculativeStage(StageResult):
    """The speculative stage (a harness.judge.stage_result.StageResult): tokens, drafter, clusters
    and acceptance gates."""

    stage = "speculative"
    k: int
    ran: bool = True
    prompts: list = field(default_factory=list)  # served.ServedPrompt per prompt
    acceptance: list = field(default_factory=list)  # per prompt: port, reference, band, verifies
    drafter_points: list = field(default_factory=list)  # PointResult per (stage, point)
    cluster_mismatches: int = 0  # fp32 draft steps whose chosen clusters differ from transformers'
    cluster_departures: list = field(default_factory=list)  # bf16 draft steps choosing other clusters (routing.RoutingChoice)
    cluster_band: float | None = None  # the masked head's own near-tie band (cluster_decisions), None without one
    error: dict | None = None
    notes: list[str] = field(default_factory=list)

    def gates(self) -> list[Gate]:
        if self.error:
            return [Gate("error", [dict(self.error, stage="speculative", point="exception inside the speculative run")])]
        tokens = [{"stage": "speculative", "point": "speculative token", "where": f"prompt {k} step {p.departure.position}",
                   "detail": p.departure.evidence} for k, p in enumerate(self.prompts) if not p.accounted]
        drafter = [{"stage": "speculative", "point": p.name, "ratio": p.ratio,
                    "detail": "the drafter departs from transformers' assistant fed the same target states"}
                   for p in self.drafter_points if not p.passed]
        clusters = [{"stage": "speculative", "point": "drafter.clusters", "where": f"{self.cluster_mismatches} fp32 steps",
                     "detail": "the masked head chose other clusters than transformers' assistant"}] if self.cluster_mismatches else []
        clusters += [{"stage": "speculative", "point": "drafter.clusters", "where": d["where"],
                      "detail": f"the masked head chose clusters {d['port_experts']} where the fp32 reference's top-k is "
                                f"{d['reference_experts']}: margin {d['margin']:.4g} above the cluster band {d['threshold']:.4g}"}
                     for d in self.cluster_departures if d["kind"] != "near_tie"]
        acceptance = [{"stage": "speculative", "point": "acceptance", "where": f"prompt {a['prompt']}",
                       "detail": f"{a['port']:.2f} accepted tokens per verify, the reference (transformers' target and "
                                 f"assistant under the port's rules) {a['reference']:.2f} (band {a['band']:.2f})"}
                      for a in self.acceptance if not a["passed"]]
        return [Gate("tokens", tokens), Gate("drafter", drafter), Gate("clusters", clusters),
                Gate("acceptance", acceptance)]

    def describe(self) -> str:
        lines = [f"speculative decoding (k={self.k}): {'PASS' if self.passed else 'FAIL'}"]
        if self.acceptance:
            port = sum(a["port"] for a in self.acceptance) / len(self.acceptance)
            ref = sum(a["reference"] for a in self.acceptance) / len(self.acceptance)
            assisted = sum(a["assisted_generation"] for a in self.acceptance) / len(self.acceptance)
            lines.append(f"  acceptance: {port:.2f} accepted tokens per verify (reference under the port's rules {ref:.2f}, "
                         f"transformers' assisted generation {assisted:.2f})")
        lines += [f"  {n}" for n in self.notes]
        lines += [f"  {f['point']} at {f.get('where', '-')}: {f.get('detail', f.get('message', ''))}" for f in self.failures()]
        return "\n".join(lines)

    def payload(self) -> dict:
        return {"k": self.k, "acceptance": self.acceptance, "prompts": [p.to_json() for p in self.prompts],
                "drafter_points": [asdict(p) for p in self.drafter_points],
                "cluster_mismatches": self.cluster_mismatches, "cluster_departures": self.cluster_departures,
                "cluster_band": self.cluster_band, "error": self.error}


# The state a later draft step of a round was fed, against the reference's post-projection of the
# step before it (fed the port's inputs): a port that does not feed its post-projection back fails.
STATE_FED = DRAFTER + "state_fed"


def same_clusters(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).long().sort().values, b.reshape(-1).long().sort().values)


def cluster_decisions(steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], top_k: int):
    """The masked head's bf16 cluster choices judged as router decisions (harness/judge/routing.py):
    steps are (the port's chosen clusters, the fp32 and the bf16 references' centroid scores) per
    draft step. A choice other than the fp32 top-k is a near tie within the clusters' own band,
    calibrated from how far bf16 moves the fp32 top-k boundary margin of the centroid scores."""
    scores = torch.cat([s[1].reshape(1, -1) for s in steps])
    weights = torch.zeros_like(scores)
    for row, (clusters, _, _) in enumerate(steps):
        weights[row, clusters.reshape(-1).long()] = 1.0
    env = torch.cat([s[2].reshape(1, -1) for s in steps])
    return judge_decisions([RouterDecisions(DRAFTER + "clusters", weights, scores, env)], top_k, _draft_step)


def _draft_step(name: str, row: int) -> str:
    return f"bf16 draft step {row}"


def drafter_points(runs: list, engine, spec, references: dict, judge) -> tuple[list, int, object]:
    """The drafter's capture points of every draft step of `runs` (speculative DecodeResults with
    captures) against transformers' assistant in fp32 and bf16 fed the same states, the fp32 steps
    whose chosen clusters differ, and the bf16 steps' cluster choices judged (cluster_decisions: a
    routing.RoutingResult, None without a masked head or in fp32). In bf16 the logits are judged
    only on steps where the device, the fp32 and the bf16 reference chose the same clusters: the
    other candidates' logits do not compare."""
    dev, ref32, ref16, clusters_off, choices, last = {}, {}, {}, 0, [], None
    steps = [(run, inp, caps) for run in runs for inp, caps in zip(run.draft_inputs, run.draft_captures)]
    for run, inp, caps in steps:
        if last is not None and last[0] == (id(run), inp["round"]):  # a later step of a round: fed the last one's state
            for d, found in ((dev, inp["state"]), (ref32, last[1]), (ref16, last[2])):
                d.setdefault(STATE_FED, []).append(found.reshape(1, -1))
        cache = run.round_caches[inp["round"]]
        kv = {typ: (cache[i][0][None], cache[i][1][None]) for typ, i in spec.kv_store.items()}
        embeds = engine.embed(torch.tensor([inp["token"]]))[..., :spec.hidden_size].float()
        r32 = references[torch.float32].captures(embeds, inp["state"], inp["position"], kv)
        r16 = references[torch.bfloat16].captures(embeds, inp["state"], inp["position"], kv)
        name = DRAFTER + "clusters"
        agree = name not in caps or (same_clusters(caps[name], r32[name]) and same_clusters(r16[name], r32[name]))
        if name in caps and judge is FP32:
            clusters_off += not same_clusters(caps[name], r32[name])
        elif name in caps:
            choices.append((caps[name], r32[DRAFTER + "centroid_scores"], r16[DRAFTER + "centroid_scores"]))
        for name, value in caps.items():
            if name.endswith("clusters") or (name.endswith("logits") and judge is not FP32 and not agree):
                continue
            dev.setdefault(name, []).append(value.reshape(1, -1))
            ref32.setdefault(name, []).append(r32[name].reshape(1, -1))
            ref16.setdefault(name, []).append(r16[name].reshape(1, -1))
        post = DRAFTER + "post_projection"
        last = ((id(run), inp["round"]), r32[post], r16[post])
    points = [compare_point(f"{judge.name}.{name}", torch.cat(dev[name]), torch.cat(ref32[name]),
                            torch.cat(ref16[name]), judge) for name in dev]
    clusters = cluster_decisions(choices, spec_top_k(references)) if choices else None
    return points, clusters_off, clusters


def spec_top_k(references: dict) -> int:
    return int(references[torch.float32].model.config.centroid_intermediate_top_k)


def judge_acceptance(runs: list, ref32: list, target, assistant, k: int) -> list[dict]:
    """Per prompt: the port's accepted drafts per verify against the like-for-like reference
    (reference.assistant.exact_acceptance: transformers' target and assistant under the port's
    rules), failing when it falls more than acceptance_band below; transformers' assisted
    generation's own figure reported beside it (`assisted_generation`), not judged: its drafter
    keeps a rejected key in view, which moves acceptance either way by up to ~0.5 on the tiny pairs."""
    from harness.reference.assistant import assisted_acceptance, exact_acceptance

    out = []
    for n, (run, r) in enumerate(zip(runs, ref32)):
        tokens, accepted = exact_acceptance(target, assistant, r.prompt, len(r.generated), k)
        reference = sum(accepted) / len(accepted) if accepted else 0.0
        assisted_tokens, assisted, verifies = assisted_acceptance(target, assistant, r.prompt, len(r.generated), k)
        band = acceptance_band(reference)
        out.append({"prompt": n, "port": run.acceptance, "reference": reference, "band": band,
                    "verifies": run.verifies, "reference_verifies": len(accepted), "accepted": run.accepted,
                    "reference_accepted": accepted, "reference_tokens_equal": tokens == r.generated,
                    "assisted_generation": assisted, "assisted_generation_verifies": verifies,
                    "assisted_generation_tokens_equal": assisted_tokens == r.generated,
                    "passed": run.acceptance >= reference - band})
    return out


def speculative_settings(settings, k: int, assistant: str) -> list:
    """The builds of the speculative stage: the run's dtype as the run says, then fp32 on the host as
    the fp32 stage's (observe.fp32_settings): on a device fp32 would be a build no plan counts (the
    12B's fp32 parity build is over a NeuronCore)."""
    from harness.parity.observe import fp32_settings

    return [(settings if dtype == settings.dtype else fp32_settings(settings)).but(dtype=dtype, speculate=k,
                                                                                  assistant=assistant)
            for dtype in dict.fromkeys((settings.dtype, "float32"))]


def check_speculative(checkpoint, ref32: list, ref16: list, calibration, *, settings, assistant, k: int) -> SpeculativeStage:
    """Run speculative greedy decode of every reference prompt in the run's dtype and in fp32 and
    judge it (tokens, drafter points, acceptance); `assistant`: the AssistantCheckpoint the command
    opened (harness.inputs.assistant_checkpoint), given to every build that drafts."""
    from harness.backends import build_drafter, build_engine
    from harness.port.decode import generate, speculative
    from harness.reference.assistant import AssistantReference, load_target

    stage = SpeculativeStage(k)
    try:
        references = {dt: AssistantReference(assistant.path, dt) for dt in (torch.float32, torch.bfloat16)}
        for run_settings in speculative_settings(settings, k, str(assistant.path)):
            dtype = run_settings.dtype
            engine = build_engine(checkpoint, run_settings, capture=True, assistant=assistant)  # verify (neuron: draft) graphs
            drafter = build_drafter(engine, assistant)
            runs = generate(engine, [r.prompt for r in ref32], [len(r.generated) for r in ref32], speculative(drafter, k),
                            capture=True)  # a sequence per KV slot of the build (--batch N: continuous batching)
            judge = FP32 if engine.settings.torch_dtype == torch.float32 else BF16
            points, off, clusters = drafter_points(runs, engine, checkpoint.spec, references, judge)
            stage.drafter_points += points
            stage.cluster_mismatches += off
            if clusters is not None:
                stage.cluster_departures += [asdict(f) for f in clusters.flips]
                stage.cluster_band = clusters.band
                stage.notes.append(f"masked head, {dtype}: {clusters.describe()}; the logits of a step choosing "
                                   "other clusters are not compared")
            if dtype == "float32":  # acceptance like for like: transformers' assisted generation runs in fp32
                fp32_runs = runs
            if dtype == settings.dtype:
                judged = runs
                stage.prompts, _, _ = judge_served(runs, ref32, ref16, None, ties(judge, calibration))
        if settings.batch > 1:
            stage.notes.append(f"speculative decoding ran as a batch of {settings.batch} sequences (a KV slot each, "
                               "continuous batching, each drafting from its own slot, one verify call a round); "
                               "each judged against its prompt alone")
        engine = drafter = None  # the fp32 build goes before acceptance loads the fp32 target (the host plan's phase)
        stage.acceptance = judge_acceptance(fp32_runs, ref32, load_target(checkpoint.path), references[torch.float32].model, k)
        for a, run in zip(stage.acceptance, judged):
            a["port_" + settings.dtype] = run.acceptance  # reported, not judged: bf16 drafts flip near ties
    except Exception as exc:  # anything the speculative run raises is its failure
        stage.error = _error("speculative decoding", exc)
    return stage


def speculative_stage(settings, assistant, k: int) -> Stage:
    """The speculative stage for the parity run (parity.stages.run_stages, like served.served_stage)."""
    def stage(checkpoint, fp32=None, bf16=None) -> SpeculativeStage:
        observed = observed_by(bf16, fp32)
        if observed is None:
            return SpeculativeStage(k, ran=False, notes=[
                "speculative decoding not judged: no stage of the check observed the port (it raised first)"])
        return check_speculative(checkpoint, observed.ref32, observed.ref16, bf16.calibration,
                                 settings=settings, assistant=assistant, k=k)
    return Stage("speculative", stage, after=("fp32", "bf16"))


def first_drafter_point(stage: SpeculativeStage) -> dict | None:
    """bisect's answer for the drafter: its first failing capture point in the drafter's own order
    (pre_projection, layers 0.., final_norm, post_projection, logits, state_fed), fp32 stage first;
    None when every point passes."""
    def order(name: str) -> tuple:
        part = name.split(DRAFTER, 1)[1]
        if part.startswith("layers."):
            return (1, int(part.split(".")[1]))
        return ({"pre_projection": 0, "final_norm": 2, "post_projection": 3, "logits": 4}.get(part, 5), 0)
    failing = sorted((p for p in stage.drafter_points if not p.passed),
                     key=lambda p: (not p.name.startswith("fp32."), order(p.name)))
    if not failing:
        return None
    p = failing[0]
    return {"point": p.name, "ratio": p.ratio, "worst_position": p.worst_position,
            "detail": f"the drafter's first point off transformers' assistant fed the same target states ({p.ratio:.3g}x "
                      "its envelope); the points after it inherit its error"}
