"""The standalone repro of a failure with no layer behind it (`bisect --emit-repro DIR`): a host
step (harness.snapshot.host: the embedding lookup, the served probabilities, the reported tokens)
or the call's head (the final norm and lm_head: a failing logits point). repro.py is
fixtures/repro/host_repro.py (torch and safetensors only); repro.safetensors holds what the port
recorded for the step, the step's inputs, the stage reference's outputs and, in its metadata, the
judge's numbers passed as data. The script runs a plain reading of the step on the recorded
inputs (it must agree with the reference, or the repro cannot judge: exit 2) and judges the port's
recorded output by the same rule: exit 1 while it fails. The port's side is its recorded output,
not a traced module: a host step is Python on the host that no compiler sees, and the head's
recorded logits are the device call's own output (its replay runs the call again)."""

from __future__ import annotations

import torch

from harness.judge import compare
from harness.judge.tokens import tie_threshold


def host_repro_inputs(result, checkpoint, settings, target) -> tuple[dict, dict]:
    """The repro's tensors and metadata for the target's step (harness.snapshot.host, or the head),
    which harness.snapshot.repro saves with fixtures/repro/host_repro.py as its script."""
    from harness.snapshot.host import record_host

    stage = result.judged(target.stage)
    spec = checkpoint.spec
    if target.host is None:
        tensors, meta = _head(checkpoint, settings, target, stage)
    else:
        target, recorded = record_host(checkpoint, settings, target, stage)
        tensors = {name.removeprefix("host."): t for name, t in recorded.items()}
        meta = {"dtype": str(settings.torch_dtype).removeprefix("torch.")}
        if target.host in ("embed", "raises"):
            meta.update(hidden=spec.hidden_size, pad=spec.pad_token_id, placeholders=list(spec.placeholder_token_ids or []))
        elif target.host == "probabilities":
            meta.update(cap=spec.final_logit_softcapping, relative=compare.HOST_RELATIVE_TOLERANCE,
                        tv=compare.HOST_TV_TOLERANCE, floor=compare.HOST_PROBABILITY_FLOOR)
        else:
            judge = compare.JUDGES[target.stage]
            band = float(tensors.pop("band"))
            tensors["thresholds"] = torch.tensor([tie_threshold(band, row, judge.envelope_ties)
                                                  for row in tensors["ref_logits"]], dtype=torch.float64)
    if target.host == "raises":
        meta.update(raised=f"the port's {target.step_name} raised {target.raised}")
    kind = target.host or "head"
    meta.update(kind=kind, description=f"the {kind} step of {checkpoint.path} (spec {spec.spec_hash()}), prompt "
                f"{target.prompt}, {target.stage} stage: {target.point} failed in the check")
    return tensors, meta


def _head(checkpoint, settings, target, stage) -> tuple[dict, dict]:
    """The head's repro: the stage reference's input to the final norm at the call's rows, the
    norm's and lm_head's weights, the port's logits (the device's output) and the references'."""
    from harness.snapshot.record import input_point, stage_rows, stage_slice

    spec, obs, prefix = checkpoint.spec, stage.observation, target.prefix
    last = input_point(spec.num_layers, prefix)  # the last layer's output: the final norm's input
    ref, env = stage_rows(obs, target.point, target)
    tensors = {"input": stage_rows(obs, last, target)[0], "norm": checkpoint.final_norm_weight(torch.float32),
               "lm_head": checkpoint.lm_head_weight(torch.float32),
               "port": obs.dev[target.point][stage_slice(obs, target)].float(), "ref": ref, "env": env}
    judge = compare.JUDGES[target.stage]
    meta = {"dtype": "float32", "eps": spec.rms_norm_eps, "factor": judge.factor, "floor": judge.floor,
            "row_floor": compare.ROW_NORM_FLOOR}
    return tensors, meta
