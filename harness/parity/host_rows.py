"""The family's per-layer table rows (E2B, E4B) as the host looks them up, judged bit for bit.

The host appends each token's row of the per-layer table, scaled by sqrt(per_layer_input) in the
table's dtype, to the device's input (harness/port/engine.py Engine.embed). The word embeddings'
host lookup is held bit-exact with the reference of the port's dtype (CheckResult.embeddings_exact);
these rows are too, against transformers' own scaled embedding (harness/reference/run.py
hf_decoder_parts) on the checkpoint's table in the port's dtype. A scale applied in fp32 before the
cast (the embedding scale's twin: more precise than the model, so inside every envelope) changes
some rows by one rounding and fails here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.judge.stage_result import Gate, Stage, StageResult


@dataclass(eq=False)
class PerLayerRowsStage(StageResult):
    """The host's per-layer rows against transformers' in the port's dtype, every prompt's tokens."""

    dtype: str
    rows: int
    differing: int  # rows not bit-exact
    max_abs: float
    notes: list[str] = field(default_factory=list)
    stage: str = "per_layer_rows"
    ran: bool = True

    def gates(self) -> list[Gate]:
        if self.differing == 0:
            return [Gate("bit_exact")]
        return [Gate("bit_exact", [{"stage": self.stage, "point": "per-layer table rows", "where": "the host lookup",
                 "detail": f"{self.differing} of {self.rows} rows not bit-exact with transformers' {self.dtype} scaled "
                           f"embedding (largest difference {self.max_abs:.3e}): the scale applied before its cast?"}])]

    def describe(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"per-layer table rows (host lookup, {self.dtype}): {verdict}, {self.rows - self.differing} of "
                f"{self.rows} rows bit-exact with transformers' scaled embedding"
                + (f" (largest difference {self.max_abs:.3e})" if not self.passed else ""))

    def payload(self) -> dict:
        return {"dtype": self.dtype, "rows": self.rows, "differing": self.differing, "max_abs": self.max_abs}


def reference_rows(checkpoint, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' scaled per-layer embedding of `ids` in `dtype` (its own class, the checkpoint's
    table), after the reference's own placeholder-to-pad step (a placeholder id reads the pad row)."""
    from harness.reference.run import hf_decoder_parts
    from harness.reference.stream import text_ids

    spec = checkpoint.spec
    table = checkpoint.per_layer_table(dtype)
    embedding = hf_decoder_parts(spec).embedding(table.shape[0], table.shape[1], spec.pad_token_id,
                                                 embed_scale=spec.per_layer_input_size ** 0.5)
    embedding.weight = torch.nn.Parameter(table, requires_grad=False)
    with torch.no_grad():
        return embedding(text_ids(spec, ids))


def per_layer_rows_stage() -> Stage:
    """The per-layer rows as a stage of the parity run: it reads the parity build (its host lookup)
    and the fp32 references' tokens; none where the bf16 stage raised or the model has no per-layer inputs."""
    def run(checkpoint, engine, references, bf16):
        return None if bf16.port_error else judge_per_layer_rows(checkpoint, engine, references.fp32)
    return Stage("per_layer_rows", run, reads=("checkpoint", "engine", "references"), after=("bf16",))


def judge_per_layer_rows(checkpoint, engine, references) -> PerLayerRowsStage | None:
    """None on a model without per-layer inputs; else the stage for every prompt's tokens (the
    references' prompts and generated tokens)."""
    spec = checkpoint.spec
    if not spec.per_layer_input_size or getattr(engine, "per_layer_table", None) is None:
        return None
    # Every id as given (placeholders too: the host and the reference each map them to pad).
    ids = torch.tensor(sorted({t for r in references for t in list(r.prompt) + list(r.generated)}), dtype=torch.long)
    host = engine.embed(ids)[0, :, spec.hidden_size:]
    expected = reference_rows(checkpoint, ids, engine.per_layer_table.dtype).to(host.dtype)
    differs = (host != expected).any(-1)
    max_abs = float((host.double() - expected.double()).abs().max()) if ids.numel() else 0.0
    dtype = str(engine.per_layer_table.dtype).removeprefix("torch.")
    return PerLayerRowsStage(dtype=dtype, rows=int(ids.numel()), differing=int(differs.sum()), max_abs=max_abs)
