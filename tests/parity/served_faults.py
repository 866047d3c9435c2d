"""Faults that exist only in the served (perf) build, for the served-build tests on every backend.

- On a compiled backend (xla, neuron) the perf graph's own code path is `TracedDecoder`'s
  last-row branch: the faults patch that branch alone, so the parity build (captures) is untouched.
- On the cpu backend the perf build is the same code as the parity build: the fault is put into
  what `harness.perf.bench.perf_engine` (the function bench and check's served stage both call)
  returns, the closest a CPU run comes to "a bug only in the timed build".
"""

from __future__ import annotations

import torch

from harness.perf import bench
from harness.port.graphs import TracedDecoder

_original_forward = TracedDecoder.forward


def last_row_gather_off_by_one(monkeypatch) -> None:
    """The perf graph gathers the row before the last real one."""
    def forward(self, inputs_embeds, positions, last_index=None):
        if self.with_captures or not self.last_row_only:
            return _original_forward(self, inputs_embeds, positions, last_index)
        hidden = self.final_hidden(inputs_embeds, positions.to(torch.long))
        row = (last_index.to(torch.long) - 1).clamp_min(0).reshape(1)
        return self.lm_head(hidden.index_select(1, row))

    monkeypatch.setattr(TracedDecoder, "forward", forward)


def lm_head_slice_shifted(monkeypatch) -> None:
    """The perf graph's vocab slices come back one column out of place."""
    def forward(self, inputs_embeds, positions, last_index=None):
        out = _original_forward(self, inputs_embeds, positions, last_index)
        if self.with_captures or not self.last_row_only:
            return out
        return torch.roll(out, 1, dims=-1)

    monkeypatch.setattr(TracedDecoder, "forward", forward)


def cpu_perf_engine_off_by_one(monkeypatch) -> None:
    """The cpu backend's perf build returns, for every prefill, the row before the last real one
    as the last row (what a wrong last-row gather does)."""
    original = bench.perf_engine

    def faulty(*args, **kwargs):
        engine = original(*args, **kwargs)
        forward = engine.backend.forward

        def shifted(inputs_embeds, positions, capture=False, **kw):
            logits, captures = forward(inputs_embeds, positions, capture=capture, **kw)
            if capture or inputs_embeds.shape[1] == 1:
                return logits, captures
            return torch.cat([logits[:, :1], logits[:, :-1]], dim=1), captures

        engine.backend.forward = shifted
        return engine

    monkeypatch.setattr(bench, "perf_engine", faulty)
