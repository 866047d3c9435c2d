"""A device graph's inputs and outputs as the graph itself defines them: the traced module of
harness/port/graphs.py built and called on PyTorch's meta device (shapes and dtypes, no memory, no
weights), with the example inputs the backends trace it with.

The device fit counts each graph's I/O by formula (core_fit.graph_io_bytes) because it is asked
for hundreds of builds at once (`info --batch`, `--plan`); this is what that formula is held to
(tests/unit/test_fit_io.py: within 10% on every model, build, batch and TP degree). A 12B graph
traces in about a second; the tiny models' in a fraction of one.
"""

from __future__ import annotations

import torch

from harness.port.draft_graphs import draft_example_inputs, drafting_class
from harness.port.graphs import batch_example_inputs, example_inputs, input_width, traced_class
from harness.port.model import Collectives, RankLinears


class MetaCollectives(Collectives):
    """What a rank's collectives do to shapes: an all-reduce keeps them, an all-gather of `tp`
    shards concatenates them."""

    def __init__(self, tp: int):
        self.tp = tp

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat([x] * self.tp, dim) if self.tp > 1 else x


def nbytes_of(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def traced_io_bytes(spec, tp: int, dtype: torch.dtype, length: int, *, max_len: int | None = None,
                    capture: bool = False, slots: int = 1, rows: int = 1, kind: str = "prefill",
                    assistant=None) -> dict:
    """{"inputs", "outputs"} bytes of one rank's graph of `length` positions: a parity build
    (`capture`) or a perf build; with `slots` > 1 a batched build's graph at batch bucket `rows`;
    `kind` "verify" traces the perf build's verify graph as the backends do (no last_index), "draft"
    the `assistant`'s (an AssistantSpec) draft graph compiled into the target's model (with `slots`
    > 1, the batched build's, taking the drafting slot)."""
    max_len = max_len or max(length, 16)
    if kind == "draft":
        return _traced_draft(spec, tp, dtype, max_len, capture=capture, assistant=assistant, slots=slots)
    last_row = not capture and kind != "verify"
    with torch.device("meta"), torch.no_grad():
        module = traced_class(spec, batched=slots > 1)(spec, tp, max_len, dtype, RankLinears(MetaCollectives(tp)),
                                                       with_captures=capture, last_row_only=not capture,
                                                       slots=slots)
        width = input_width(spec)
        inputs = (example_inputs(length, width, dtype, last_row=last_row) if slots == 1
                  else batch_example_inputs(length, width, dtype, rows, last_row=last_row))
        out = module(*inputs)
    outputs = out if isinstance(out, tuple) else (out,)
    return {"inputs": nbytes_of(inputs), "outputs": nbytes_of(outputs)}


def _traced_draft(spec, tp: int, dtype: torch.dtype, max_len: int, *, capture: bool, assistant, slots: int) -> dict:
    with torch.device("meta"), torch.no_grad():
        module = drafting_class(spec, batched=slots > 1)(spec, tp, max_len, dtype, RankLinears(MetaCollectives(tp)),
                                                         assistant=assistant, with_captures=capture,
                                                         last_row_only=not capture, slots=slots)
        inputs = draft_example_inputs(spec.hidden_size, dtype, batched=slots > 1)
        out = module(**inputs)
    return {"inputs": nbytes_of(inputs.values()), "outputs": nbytes_of(out)}


__all__ = ["MetaCollectives", "traced_io_bytes"]
