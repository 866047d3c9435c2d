"""The quantized model itself, as a checkpoint: the structural reference of a quantized port.

`check --quantize int8` asks "is the port right?" of a port that stores int8 weights; its truth is
the same int8 weights dequantized (harness/inputs/quantize.py), run by transformers in fp32 and
bf16. This module writes that model once per checkpoint and scheme into the cache (every weight
file as stored, the quantized weights replaced by their dequantized fp32 values; config and
tokenizer copied) and opens it as an ordinary Checkpoint, so every reference path (transformers'
from_pretrained, the float64 and streamed references, the local verdicts' layers, goldens keyed
by file hashes) reads the quantized model unchanged. The opened checkpoint names the original as
`unquantized`: the port quantizes from the stored weights, never from dequantized values.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import torch

from harness.base.atomic import atomic_directory
from harness.base.errors import OutputError
from harness.inputs.checkpoint import Checkpoint
from harness.inputs.quantize import QUANTIZED, SCHEMES, dequantize, quantize_weight
from harness.inputs.tiny import cache_dir
from harness.inputs.weight_files import open_safetensors

FORMAT_VERSION = 1  # bump when what is written changes: a new cache entry


def _entry(ckpt: Checkpoint, name: str) -> Path:
    scheme = SCHEMES[name]
    key = json.dumps({"files": ckpt.file_hashes(), "scheme": scheme.describe(), "version": FORMAT_VERSION},
                     sort_keys=True)
    return cache_dir() / "quantized" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:20]}"


def _write(ckpt: Checkpoint, name: str, out: Path) -> None:
    from safetensors.torch import save_file

    scheme = SCHEMES[name]
    layer_key = re.compile(re.escape(ckpt.prefix) + r"layers\.(\d+)\.(.+)$")
    for entry in sorted(ckpt.path.iterdir()):
        if entry.is_file() and entry.suffix != ".safetensors":
            shutil.copy2(entry, out / entry.name)
    for file in ckpt.weight_files():
        tensors = {}
        with open_safetensors(file) as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                match = layer_key.match(key)
                if match and match.group(2) in QUANTIZED:
                    tensor = dequantize(*quantize_weight(tensor, scheme), torch.float32)  # what the port computes
                tensors[key] = tensor.contiguous()
        save_file(tensors, str(out / file.name), metadata={"format": "pt", "gemma_parity_quantize": name})


def quantized_reference(ckpt: Checkpoint, name: str) -> Checkpoint:
    """The checkpoint of the quantized model under scheme `name` (written on first use, cached by
    the original's file hashes and the scheme), with `unquantized` (the original) and
    `quantization` (the scheme's name) set."""
    out = _entry(ckpt, name)
    if not (out / "config.json").is_file():
        try:
            with atomic_directory(out, replace=out.exists()) as tmp:
                _write(ckpt, name, tmp)
        except OutputError:
            if not (out / "config.json").is_file():  # not another run's finished copy of the same entry
                raise
    opened = Checkpoint.open(out, validate=False)
    opened.unquantized, opened.quantization = ckpt, name
    opened.quantization_note = (f"structural reference: the {name} quantized model of {ckpt.path} (its {name} weights "
                                "dequantized, run by transformers); what quantization costs against the unquantized "
                                f"model is `quality --quantize {name}`'s question (docs/quantization.md)")
    return opened
