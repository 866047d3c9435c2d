"""What a checkpoint says about quantization, read before model work (docs/quantization.md#qat-and-pre-quantized-checkpoints).

A quantization-aware-trained checkpoint exported in half precision (Google's QAT Gemma exports
meant for downstream compilers) is an ordinary bf16 checkpoint: it runs through the port unchanged
and the loader only says what it found (QAT metadata, a quantization_config). A checkpoint whose
weights are stored in a packed low-bit format (a quantization_config of fewer than 8 bits or a
packing method, packed or integer weight tensors, GPTQ/AWQ-style qweight/qzeros keys) is refused:
the port does not run those formats, and `--quantize int8` quantizes half-precision weights itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.base.errors import CheckpointError

PACKED_METHODS = ("gptq", "awq", "bitsandbytes", "aqlm", "hqq", "eetq", "exl2", "marlin", "quanto")
PACKED_KEY_SUFFIXES = (".qweight", ".qzeros", ".g_idx", ".weight_packed", ".weight_shape", ".SCB", ".absmax",
                       ".quant_map", ".quant_state.bitsandbytes__nf4", ".quant_state.bitsandbytes__fp4")
INTEGER_DTYPES = ("U8", "I8", "I16", "I32", "U32", "I64", "F8_E4M3", "F8_E5M2")
QAT_WORDS = ("qat", "quantization_aware", "quantization-aware")


def _configs(config: dict) -> list[tuple[str, dict]]:
    found = [("quantization_config", config.get("quantization_config"))]
    text = config.get("text_config")
    if isinstance(text, dict):
        found.append(("text_config.quantization_config", text.get("quantization_config")))
    return [(k, v) for k, v in found if isinstance(v, dict)]


def _bits(qc: dict) -> list[int]:
    bits = [qc[k] for k in ("bits", "weight_bits", "w_bit", "nbits") if isinstance(qc.get(k), int)]
    if qc.get("load_in_4bit") is True:
        bits.append(4)
    for group in (qc.get("config_groups") or {}).values():
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict) and isinstance(weights.get("num_bits"), int):
            bits.append(weights["num_bits"])
    return bits


def refuse_packed_config(config: dict, source: Path) -> None:
    for key, qc in _configs(config):
        method = str(qc.get("quant_method", "")).lower()
        low = [b for b in _bits(qc) if b < 8]
        packed = method in PACKED_METHODS or "pack" in str(qc.get("format", "")).lower()
        if low or packed:
            what = f"bits {min(low)}" if low else f"quant_method {method!r}" if method in PACKED_METHODS \
                else f"format {qc.get('format')!r}"
            raise CheckpointError(
                f"{source}: {key} has {what}: the weights are stored in a packed low-bit format the port does not "
                "run. Use the half-precision (bf16) export of the checkpoint (for a QAT model, its unquantized "
                "export), and --quantize int8 for int8 weight storage on the device")


def refuse_packed_tensors(decoder_keys: dict[str, str], source: Path) -> None:
    """`decoder_keys`: text-decoder key -> safetensors dtype string (header only)."""
    for key, dtype in sorted(decoder_keys.items()):
        packed_name, integer = key.endswith(PACKED_KEY_SUFFIXES), dtype in INTEGER_DTYPES
        if packed_name or integer:
            what = ", not a floating-point type (a quantized or packed weight)" if integer else ""
            layout = " under a packed quantized layout's name" if packed_name else ""
            raise CheckpointError(
                f"{source}: tensor {key} is stored as {dtype}{what}{layout}: the port runs half- or full-precision "
                "weights only. Use the checkpoint's bf16 export, and --quantize int8 for int8 weight storage on "
                "the device")


def describe_quantization(config: dict) -> str | None:
    """One line on the QAT metadata and quantization_config a (runnable) checkpoint carries, or None."""
    notes = []
    for key, qc in _configs(config):
        notes.append(f"{key} {json.dumps({k: qc[k] for k in sorted(qc) if k in ('quant_method', 'bits', 'format')})}")
    text = json.dumps({k: v for k, v in config.items() if k != "quantization_config"}).lower()
    if any(word in text for word in QAT_WORDS):
        notes.append("QAT metadata (the config names quantization-aware training)")
    if not notes:
        return None
    return ("quantization: " + "; ".join(notes) + "; the weights are stored in half or full precision: the port "
            "runs them as any checkpoint (docs/quantization.md)")
