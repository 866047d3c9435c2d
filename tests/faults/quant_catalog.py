"""Faults of a quantized port (docs/quantization.md#faults): each injected into the port's int8
path (harness.port.quantized, harness.port.sharding, the port's use of harness.inputs.quantize)
through a pytest MonkeyPatch, never into the reference (the quantized model's checkpoint is written
by harness/inputs/quantized_checkpoint.py with its own bindings). Each must fail the structural
check (`check --quantize int8`) at its point; tests/quant/test_quant_faults.py runs them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from harness.backends import cpu as port_cpu
from harness.inputs import quantize as scheme
from harness.port import quantized as port_quantized
from harness.port import sharding as port_sharding


@dataclass(frozen=True)
class QuantFault:
    name: str
    description: str
    inject: Callable  # inject(monkeypatch)
    first_point: str | None  # the first capture point the fp32 structural stage fails at (None: it passes)
    tp: int = 1  # the TP degree the fault needs (scales of another rank: 2)
    # Why the check must pass it (None: a fault it must fail): a reordering that is exact in real
    # arithmetic, which the judge must not flag.
    equivalent: str | None = None


def _dequantized(monkeypatch, weight_of):
    """Every quantized projection's matmul weight becomes weight_of(module, dtype)."""
    monkeypatch.setattr(port_quantized.QuantizedLinear, "dequantized", lambda self, dtype: weight_of(self, dtype))


def _state_dicts(monkeypatch, states):
    """The ranks' state dicts of the cpu backend (which binds rank_state_dicts by name) become `states`."""
    monkeypatch.setattr(port_sharding, "rank_state_dicts", states)
    monkeypatch.setattr(port_cpu, "rank_state_dicts", states)


def scales_of_other_rank(monkeypatch):
    """Row-split weights (q, k, v, gate, up) get the scales of rank tp-1-r: right codes, wrong rows' scales."""
    original = port_sharding.shard_layer

    def shard(weights, plan, rank):
        out, other = original(weights, plan, rank), original(weights, plan, plan.tp - 1 - rank)
        for name in out:
            rows = scheme.weight_name(name)
            if rows is not None and rows not in port_sharding.Q_COLS + port_sharding.MLP_COLS:
                out[name] = other[name]
        return out

    monkeypatch.setattr(port_sharding, "shard_layer", shard)


def transposed_scales(monkeypatch):
    """The scale vector laid along the input axis (as for a weight stored [in, out]): column j
    scaled by scale[j mod out] instead of row i by scale[i]."""

    def weight(self, dtype):
        flat = self.scale.flatten()
        along_inputs = flat.repeat(-(-self.in_features // flat.numel()))[:self.in_features]
        return (self.weight.float() * along_inputs[None, :]).to(dtype)

    _dequantized(monkeypatch, weight)


def channel_axis_swapped(monkeypatch):
    """Quantized per input channel (one scale per column) instead of per output channel."""
    real_init, real_states = port_quantized.QuantizedLinear.__init__, port_sharding.rank_state_dicts

    def init(self, in_features, out_features, *args):
        real_init(self, in_features, out_features, *args)
        self.scale = nn.Parameter(torch.ones(1, in_features), requires_grad=False)

    def states(checkpoint, tp, dtype=None, quantize=None):
        out = real_states(checkpoint, tp, dtype, quantize)
        for state in out:
            for name in [n for n in state if n.endswith(".scale")]:
                w = scheme.dequantize(state[scheme.weight_name(name)], state[name], torch.float32)
                codes, cols = scheme.quantize_weight(w.T)  # per column of w
                state[scheme.weight_name(name)], state[name] = codes.T.contiguous(), cols.T.contiguous()
        return out

    monkeypatch.setattr(port_quantized.QuantizedLinear, "__init__", init)
    _state_dicts(monkeypatch, states)


def zero_point(monkeypatch):
    """An asymmetric dequantizer on symmetric codes: a zero point of one code subtracted."""
    _dequantized(monkeypatch, lambda self, dtype: ((self.weight.float() - 1.0) * self.scale).to(dtype))


def dequantize_after_matmul(monkeypatch):
    """The matmul on the raw codes in the activation dtype, the scales applied to its output,
    each output channel's product rounded to the activation dtype before it is scaled."""

    def forward(self, x):
        raw = torch.nn.functional.linear(x, self.weight.to(x.dtype))
        return (raw * self.scale.flatten().to(x.dtype)).to(x.dtype)

    monkeypatch.setattr(port_quantized.QuantizedLinear, "forward", forward)


def lm_head_quantized(monkeypatch):
    """The tied lm_head stored int8 (dequantized into its bf16 parameter): NxD Inference keeps it."""
    real = port_sharding.rank_state_dicts

    def states(checkpoint, tp, dtype=None, quantize=None):
        out = real(checkpoint, tp, dtype, quantize)
        for state in out:
            w = state["lm_head.weight"]
            state["lm_head.weight"] = scheme.dequantize(*scheme.quantize_weight(w), w.dtype)
        return out

    _state_dicts(monkeypatch, states)


def truncating_rounding(monkeypatch):
    """int8 codes by truncation toward zero instead of rounding to nearest."""
    real = scheme.quantize_weight

    def truncating(weight, s=scheme.INT8):
        return real(weight, scheme.Scheme(bits=s.bits, granularity=s.granularity, rounding="truncate"))

    monkeypatch.setattr(scheme, "quantize_weight", truncating)


QUANT_FAULTS = (
    QuantFault("scales-of-other-rank", "row-split weights read the other rank's scales", scales_of_other_rank,
               "kv.0.k", tp=2),
    QuantFault("transposed-scales", "scales laid along the input axis", transposed_scales, "kv.0.k"),
    QuantFault("channel-axis-swapped", "one scale per input channel", channel_axis_swapped, "kv.0.k"),
    QuantFault("zero-point", "a zero point subtracted from symmetric codes", zero_point, "kv.0.k"),
    QuantFault("dequantize-after-matmul", "scales applied to the matmul's rounded output", dequantize_after_matmul,
               None, equivalent="with one scale per output channel, x @ (q * s).T == (x @ q.T) * s exactly in real "
               "arithmetic (the scale is constant along the contracted axis): only rounding differs, within the "
               "fp32 and bf16 envelopes; the order is a fault only for scales along the input axis "
               "(transposed-scales, channel-axis-swapped)"),
    QuantFault("lm-head-quantized", "the lm_head quantized (NxD Inference keeps it)", lm_head_quantized, "logits"),
    QuantFault("truncating-rounding", "int8 codes truncated, not rounded", truncating_rounding, "kv.0.k"),
)
BY_NAME = {f.name: f for f in QUANT_FAULTS}
