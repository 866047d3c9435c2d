"""The fp32 reference's own error, measured: transformers in float64 along the fp32 reference's path,
the envelope of the fp32 structural stage (docs/design.md#tolerance-policy).

Each prompt and the fp32 reference's generated tokens (but the last, which nothing reads) run as ONE
teacher-forced sequence, so the decode points are rows of it: step s >= 1 is row n + s - 1, the
step logits are rows n - 1 onwards. On MoE models the routers are forced to the fp32 reference's
choices (a near tie float64 decides otherwise would put a whole expert's output into the envelope).
Small models run whole (harness/reference/run.py); a model whose float64 copy would pass
FLOAT64_RESIDENT_BYTES is streamed one decoder layer at a time (harness/reference/stream.py), so a
whole float64 model is never resident for a large checkpoint.

transformers keeps some steps in fp32 whatever the model dtype (RMSNorm, the attention softmax, the
rope angles, the router's softmax): those round once as the fp32 reference does; everything between
them (the matmuls and residual adds, where error accumulates over depth) is float64. Captures are
stored as fp32: the envelope is floored at one fp32 rounding (compare.FP32_FLOOR).

Like harness/reference/run.py this imports nothing of the port (tests/unit/test_reference_boundary.py).
"""

from __future__ import annotations

import math

import torch

from harness.reference.forcing import Forced, routes_of
from harness.reference.run import ReferenceResult, load_reference_model, reference_run

# A float64 model up to this size (8 bytes a parameter) is loaded whole: 2 GiB, a 268M-parameter
# checkpoint; anything larger is streamed layer by layer.
FLOAT64_RESIDENT_BYTES = 2 << 30


def float64_bytes(checkpoint) -> int:
    return 8 * sum(math.prod(shape) for shape in checkpoint.expected_shapes().values())


def sequence_of(ref32: ReferenceResult) -> list[int]:
    """The prompt and the fp32 tokens fed back during its decode (all but the last generated)."""
    return list(ref32.prompt) + list(ref32.generated[:-1])


def split_sequence(captures: dict, ref32: ReferenceResult) -> ReferenceResult:
    """One sequence's captures as a ReferenceResult laid out as ref32's: prefill rows, decode
    steps' rows (`decode.<point>`), step logits, KV rows in position order."""
    n, steps = len(ref32.prompt), len(ref32.generated)
    out = {}
    for name, rows in captures.items():
        if name.startswith("kv."):
            out[name] = rows
            continue
        out[name] = rows[:n]
        if steps > 1 and name not in ("capped_logits",):
            out[f"decode.{name}"] = rows[n:n + steps - 1]
    logits = captures["logits"]
    if steps:
        out["step_capped_logits"] = captures["capped_logits"][n - 1:n - 1 + steps]
    return ReferenceResult(prompt=list(ref32.prompt), dtype="float64", captures=out, generated=list(ref32.generated),
                           step_logits=logits[n - 1:n - 1 + steps])


def float64_references(checkpoint, ref32: list[ReferenceResult], progress: bool = False) -> list[ReferenceResult]:
    """transformers in float64 along each fp32 reference's path (tokens, MoE routing), laid out as
    the fp32 reference (split_sequence): whole, or streamed for a large checkpoint."""
    top_k = checkpoint.spec.moe.top_k if checkpoint.spec.moe is not None else None
    forcing = [Forced(routes=routes_of(r, top_k)) if top_k else None for r in ref32]
    if float64_bytes(checkpoint) > FLOAT64_RESIDENT_BYTES:
        from harness.reference.stream import stream_sequences

        captures = stream_sequences(checkpoint, [sequence_of(r) for r in ref32], forcing, progress)
        return [split_sequence(c, r) for c, r in zip(captures, ref32)]
    model = load_reference_model(checkpoint.path, torch.float64)
    try:
        return [split_sequence(reference_run(model, sequence_of(r), 0, forcing=f).captures, r)
                for r, f in zip(ref32, forcing)]
    finally:
        del model
