"""Host-step snapshots (docs/snapshot.md): a check failure that no layer point shows and that the
host computes, not the device, recorded as the host step behind it and replayed on the recorded
inputs through the port's own host code (harness/port/engine.py, harness/port/decode.py), judged
by the rule the check judged it with. This module finds the host step behind a failure, records
it and checks its tensors on read; harness/snapshot/host_replay.py replays and judges it.

Kinds (the snapshot's `target.host`), each with its tensors (host.*):
  embed          the call's token ids -> the input embeddings the engine passes the device
                 (Engine.embed): host.ids [n], the embedding rows they touch (host.row_ids [u],
                 host.rows [u, hidden], the checkpoint's own, checked on read), the port's recorded
                 rows (host.port) and the same-dtype reference's layer-0 input (host.ref, [n, hidden]);
                 judged bit for bit (CheckResult.embeddings_exact's rule).
  probabilities  the device's raw logits row -> the served distribution (Engine.probabilities):
                 host.logits [1, vocab], the port's recorded probabilities (host.port) and
                 transformers' capped logits of that row (host.ref); judged by
                 compare.compare_probabilities (the worst row: the ratio is the worst row's).
  tokens         the device's logits of a free greedy run -> the tokens the decode loop reports
                 (decode.generate over `RecordedDevice`, which answers each call with the recorded
                 logits): host.ids, host.logits [new tokens, vocab], the port's recorded tokens
                 (host.port), the reference's tokens and logits (host.ref_tokens, host.ref_logits,
                 host.ref_capped when the golden has them) and the stage's tie band (host.band);
                 judged by tokens.classify_departure.
  raises         an exception inside the port's host code: the engine's step that raised (a
                 prefill or a decode step), its arguments as the decode loop passed them, replayed
                 through the port's code (harness/snapshot/host_raises.py).
"""

from __future__ import annotations

import torch

from harness.base.points import locate
from harness.port.engine import chunk_plan

KINDS = ("embed", "probabilities", "tokens", "raises")


def host_failure(result):
    """(kind, stage, detail) of the first host-side failure of the check's stages, bf16 first:
    detail is the prompt (embed, tokens) or the failing ProbabilityResult. An exception inside the
    port comes first (the check's failures list it first). None: there is none."""
    for stage in (s for s in (result.bf16, result.fp32) if s is not None and s.port_error and s.references is not None):
        return "raises", stage, None
    for stage in (s for s in (result.bf16, result.fp32) if s is not None and s.observation is not None):
        if not stage.embeddings_exact:
            return "embed", stage, _first_inexact_prompt(stage)
        bad = [p for p in stage.probabilities if not p.passed]
        if bad:
            return "probabilities", stage, bad[0]
        departs = [k for k, pr in enumerate(stage.prompts)
                   if not pr.accounted and not any(m.kind == "divergence" for m in pr.decode.mismatches)]
        if departs:
            return "tokens", stage, departs[0]
    return None


def _same_dtype(stage) -> list:
    obs = stage.observation
    return obs.ref16 if stage.dtype == "bfloat16" else obs.ref32


def _embedding_rows(stage, k) -> tuple[torch.Tensor, torch.Tensor]:
    """(the port's, the same-dtype reference's) embeddings rows of prompt k, the reference's width."""
    ref = _same_dtype(stage)[k].captures["embeddings"]
    port = stage.observation.runs[k].forced.prefill.captures["embeddings"]
    return port[..., :ref.shape[-1]], ref


def _first_inexact_prompt(stage) -> int:
    return next(k for k in range(len(stage.observation.runs))
                if not torch.equal(*_embedding_rows(stage, k)))


def host_target_fields(result, settings) -> dict | None:
    """The fields of the Target (harness.snapshot.target.Target) of the first host-side failure, or None."""
    found = host_failure(result)
    if found is None:
        return None
    kind, stage, detail = found
    obs = stage.observation
    common = dict(stage=stage.stage, layer=-1, failing=True, host=kind)
    if kind == "raises":  # where it raised is found by recording (host_raises.record_raises)
        return dict(point="exception inside the port", ratio=1.0, prompt=0, position=0, start=0, length=1, bucket=1,
                    **common)
    if kind == "embed":
        port, ref = _embedding_rows(stage, detail)
        row = int((port != ref).any(-1).nonzero()[0])
        start, length, bucket = next(c for c in chunk_plan(len(obs.ref32[detail].prompt), settings.buckets,
                                                           settings.kv_len) if c[0] <= row < c[0] + c[1])
        differing = int((port[start:start + length] != ref[start:start + length]).any(-1).sum())
        return dict(point="embeddings", ratio=differing / length, prompt=detail, position=row, start=start,
                    length=length, bucket=bucket, **common)
    if kind == "probabilities":
        decode = detail.name == "decode_probabilities"
        counts = [r.forced.step_logits.shape[0] if decode else r.forced.prefill.logits.shape[0] for r in obs.runs]
        prompt, row = locate(detail.worst_position, counts)
        position = len(obs.ref32[prompt].prompt) + row if decode else row
        return dict(point=detail.name, ratio=float(detail.ratio), prompt=prompt, position=position,
                    start=position, length=1, bucket=1, step=row if decode else None, **common)
    want = len(obs.ref32[detail].generated)
    n = len(obs.ref32[detail].prompt)
    return dict(point="sequence", ratio=1.0, prompt=detail, position=n, start=n, length=want, bucket=1, **common)


def record_host(checkpoint, settings, target, stage) -> tuple[object, dict[str, torch.Tensor]]:
    """(the target, as recorded, and every host.* tensor of its kind: module docstring)."""
    if target.host == "raises":
        from dataclasses import replace

        from harness.snapshot.host_raises import record_raises

        fields, tensors = record_raises(checkpoint, settings, stage)
        row_ids = tensors["host.row_ids"] = embedding_row_ids(checkpoint.spec, tensors["host.ids"])
        tensors["host.rows"] = checkpoint.embed_weight(settings.torch_dtype)[row_ids].contiguous()
        return replace(target, **fields), tensors
    return target, _record(checkpoint, settings, target, stage)


def _record(checkpoint, settings, target, stage) -> dict[str, torch.Tensor]:
    from harness.judge.compare import JUDGES
    from harness.reference.run import transformers_capped

    obs, k, kind = stage.observation, target.prompt, target.host
    r32, run = obs.ref32[k], obs.runs[k]
    rows = slice(target.start, target.start + target.length)
    if kind == "embed":
        port, ref = _embedding_rows(stage, k)
        ids = torch.tensor(list(r32.prompt)[rows], dtype=torch.long)
        row_ids = embedding_row_ids(checkpoint.spec, ids)
        tensors = {"host.ids": ids, "host.row_ids": row_ids,
                   "host.rows": checkpoint.embed_weight(settings.torch_dtype)[row_ids],
                   "host.port": port[rows], "host.ref": ref[rows]}
    elif kind == "probabilities":
        step = target.step
        logits = (run.forced.step_logits[step] if step is not None else run.forced.prefill.logits[target.start])[None]
        probs = (run.step_probs[step] if step is not None else run.prefill_probs[target.start])[None]
        tensors = {"host.logits": logits.float(), "host.port": probs.float(),
                   "host.ref": transformers_capped(logits, checkpoint.spec.final_logit_softcapping)}
    else:
        band = JUDGES[stage.stage].tie_band(stage.calibration.band, r32.captures["logits"])
        tensors = {"host.ids": torch.tensor(list(r32.prompt), dtype=torch.long),
                   "host.logits": run.free.step_logits.float(),
                   "host.port": torch.tensor(list(run.free.tokens), dtype=torch.long),
                   "host.ref_tokens": torch.tensor(list(r32.generated), dtype=torch.long),
                   "host.ref_logits": r32.step_logits.float(), "host.band": torch.tensor([band], dtype=torch.float64)}
        if r32.captures.get("step_capped_logits") is not None:
            tensors["host.ref_capped"] = r32.captures["step_capped_logits"].float()
    return {name: t.detach().clone().contiguous() for name, t in tensors.items()}


def embedding_row_ids(spec, ids: torch.Tensor) -> torch.Tensor:
    """The embedding rows a call's ids touch: their own and the pad row (placeholders read it)."""
    wanted = torch.cat([ids, torch.tensor([spec.pad_token_id])])
    return torch.unique(wanted[(wanted >= 0) & (wanted < spec.vocab_size)])


NEEDED = {"embed": ("host.ids", "host.row_ids", "host.rows", "host.port", "host.ref"),
          "raises": ("host.ids", "host.positions", "host.row_ids", "host.rows", "host.ref"),
          "probabilities": ("host.logits", "host.port", "host.ref"),
          "tokens": ("host.ids", "host.logits", "host.port", "host.ref_tokens", "host.ref_logits", "host.band")}


def missing_tensors(kind: str, tensors: dict) -> list[str]:
    """The host.* tensors a snapshot of `kind` needs and lacks (an unknown kind lacks its kind)."""
    if kind not in NEEDED:
        return [f"a known kind (not {kind!r})"]
    return [name for name in NEEDED[kind] if name not in tensors]


def check_host_rows(snap, checkpoint) -> str | None:
    """What is wrong with an embed snapshot's rows against `checkpoint` (None: they are its rows)."""
    t = snap.tensors
    if snap.target["host"] not in ("embed", "raises"):
        return None
    row_ids = t["host.row_ids"]
    if bool(((row_ids < 0) | (row_ids >= checkpoint.spec.vocab_size)).any()):
        return "its embedding row ids fall outside the checkpoint's vocabulary"
    table = checkpoint.embed_weight(snap.run_settings().torch_dtype)
    if not torch.equal(table[row_ids], t["host.rows"]):
        return "its embedding rows are not the checkpoint's rows for those ids"
    return None
