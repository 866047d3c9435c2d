"""Weight quantization: the one home of the scheme (docs/quantization.md).

`--quantize int8` is NxD Inference's int8 weight storage: each quantized weight is stored as int8
with one fp32 scale per output channel (row), symmetric (no zero point): scale = max|row| / 127,
q = round(w / scale) clamped to [-127, 127]. On the device the weight is dequantized to the
activation dtype before the matmul, (q in fp32 * scale) cast once to the activation dtype, as
NxD's dequantize does; the matmul itself is the bf16 (or fp32) one of the unquantized port.

What is quantized is what NxD's converter swaps for quantized layers: the decoder's linear
projections (attention q/k/v/o, the dense MLP's gate/up/down). Everything else stays in the
checkpoint's precision: the norms and layer scalars, the word embeddings (on the host), the tied
lm_head (NxD Inference's modules_to_not_convert lists `lm_head`; here it shares its table with the
host embeddings), the MoE router, the MoE experts (fused parameters, not linear modules) and the
per-layer-input linears (E2B/E4B: small, replicated, outside the parallel layers).

Both sides use this module: the port (harness/port/quantized.py holds the int8 weights and scales
and calls `dequantize`) and the structural reference (harness/inputs/quantized_checkpoint.py
writes the same weights dequantized to fp32 for transformers), so the two hold the same numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


# Layer weights (names relative to a decoder layer) stored quantized; every other weight is kept
# in the checkpoint's precision (module docstring).
QUANTIZED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
SCALE_DTYPE = torch.float32  # NxD keeps the scales in fp32
STORAGE_DTYPE = torch.int8


@dataclass(frozen=True)
class Scheme:
    """How weights are quantized. INT8 is `--quantize int8`; the other settings exist to judge the
    judge (a per-tensor or 4-bit quantization must cost more than the stated threshold, and int8
    rounding by truncation is a fault of tests/faults/quant_catalog.py)."""

    bits: int = 8
    granularity: str = "channel"  # "channel": one scale per output row; "tensor": one for the weight
    rounding: str = "nearest"  # "nearest" (round half to even, as torch.round) or "truncate"

    def __post_init__(self):
        if not 2 <= self.bits <= 8 or self.granularity not in ("channel", "tensor") \
                or self.rounding not in ("nearest", "truncate"):
            raise ValueError(f"unsupported quantization scheme {self}")

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def describe(self) -> dict:
        return {**asdict(self), "symmetric": True, "scale_dtype": "float32", "quantized": list(QUANTIZED)}


INT8 = Scheme()
SCHEMES = {"int8": INT8}


def scheme_of(name: str | None) -> Scheme | None:
    """The Scheme of a `--quantize` value (None: unquantized); an unknown name is refused naming it."""
    if name is None:
        return None
    if name not in SCHEMES:
        raise ValueError(f"--quantize {name!r}: use one of {', '.join(QUANTIZE_CHOICES)}")
    return SCHEMES[name]


def scale_name(name: str) -> str:
    """The scale's state-dict name of a quantized weight: "mlp.up_proj.weight" -> "mlp.up_proj.scale"
    (NxD's key)."""
    return name.removesuffix("weight") + "scale"


def weight_name(name: str) -> str | None:
    """The weight a scale belongs to ("x.scale" -> "x.weight"); None for a name that is not a scale."""
    return name.removesuffix("scale") + "weight" if name.endswith(".scale") else None


def quantize_weight(weight: torch.Tensor, scheme: Scheme = INT8) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] weight -> (q [out, in] int8, scale [out, 1] fp32), symmetric. A row of zeros keeps
    scale 1 (its q is 0 whatever the scale). A per-tensor scheme repeats its one scale per row."""
    w = weight.to(SCALE_DTYPE)
    amax = w.abs().amax(dim=1, keepdim=True)
    if scheme.granularity == "tensor":
        amax = amax.amax().expand_as(amax)
    scale = torch.where(amax > 0, amax / scheme.qmax, torch.ones_like(amax)).contiguous()
    codes = w / scale
    codes = torch.round(codes) if scheme.rounding == "nearest" else torch.trunc(codes)
    return codes.clamp(-scheme.qmax, scheme.qmax).to(STORAGE_DTYPE), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight the matmul uses: q in fp32 times its row's scale, cast once to `dtype`."""
    return (q.to(SCALE_DTYPE) * scale.to(SCALE_DTYPE)).to(dtype)


def quantize_layer(weights: dict[str, torch.Tensor], scheme: Scheme = INT8,
                   dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """One decoder layer's weights as the quantized port holds them: each QUANTIZED weight as int8
    codes plus its `scale_name` entry, every other weight cast to `dtype` (None: as given)."""
    out = {}
    for name, w in weights.items():
        if name in QUANTIZED:
            out[name], out[scale_name(name)] = quantize_weight(w, scheme)
        else:
            out[name] = w if dtype is None else w.to(dtype)
    return out


def dequantized_layer(weights: dict[str, torch.Tensor], scheme: Scheme = INT8,
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The same layer as the quantized model holds it (the structural reference's weights):
    QUANTIZED weights quantized then dequantized to `dtype`, the others cast to `dtype`."""
    return {name: dequantize(*quantize_weight(w, scheme), dtype) if name in QUANTIZED else w.to(dtype)
            for name, w in weights.items()}


def port_layer_weights(checkpoint, index: int, scheme: Scheme, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Layer `index` for the quantized port, quantized from the weights as stored in the
    unquantized checkpoint (a quantized reference checkpoint names it as `unquantized`), so the
    codes never depend on the run's dtype."""
    source = getattr(checkpoint, "unquantized", None) or checkpoint
    return quantize_layer(source.layer_weights(index), scheme, dtype)


def quantized_weight_bytes(rows: int, cols: int, scheme: Scheme = INT8) -> int:
    """Device bytes of one stored [rows, cols] quantized weight: one byte a code, 4 a row's scale."""
    return rows * cols * torch.tensor([], dtype=STORAGE_DTYPE).element_size() + rows * 4
