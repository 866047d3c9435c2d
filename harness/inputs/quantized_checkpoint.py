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
import math
import re
import shutil
import struct
import sys
from pathlib import Path

import torch

from harness.base.atomic import atomic_directory
from harness.base.errors import OutputError
from harness.inputs.checkpoint import Checkpoint, sha256_file
from harness.inputs.quantize import QUANTIZED, SCHEMES, dequantize, quantize_weight
from harness.inputs.tiny import cache_dir
from harness.inputs.weight_files import open_safetensors

FORMAT_VERSION = 3  # bump when what is written changes: a new cache entry (3: the entry's own hashes)
RECORD = "gemma-parity-entry.json"  # every file's sha256 as written: an entry is reused only when it still matches


def _entry(ckpt: Checkpoint, name: str) -> Path:
    scheme = SCHEMES[name]
    key = json.dumps({"files": ckpt.file_hashes(), "scheme": scheme.describe(), "version": FORMAT_VERSION},
                     sort_keys=True)
    return cache_dir() / "quantized" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:20]}"


_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
          "F8_E4M3": 1, "F8_E5M2": 1}


def _layout(ckpt: Checkpoint, f) -> dict[str, tuple[str, str, list[int]]]:
    """key -> (dtype as stored, dtype as written, shape) of one open weight file: the scheme's
    weights are written F32, the others as stored."""
    out = {}
    for key in f.keys():
        piece = f.get_slice(key)
        stored = piece.get_dtype()
        out[key] = (stored, "F32" if _quantized(ckpt, key) else stored, list(piece.get_shape()))
    return out


def _quantized(ckpt: Checkpoint, key: str) -> bool:
    """Whether the scheme stores this weight quantized (a decoder layer's QUANTIZED projection)."""
    match = re.match(re.escape(ckpt.prefix) + r"layers\.(\d+)\.(.+)$", key)
    return bool(match) and match.group(2) in QUANTIZED


# Host bytes per element converting one quantized weight holds beyond the stored tensor: its fp32
# codes, rounded codes and dequantized values (quantize_weight, dequantize); measured 9.1 (peak RSS
# over a 4096 x 8192 weight, bf16 or fp32 stored), counted as three fp32 temporaries.
CONVERT_BYTES = 12


def copy_host_bytes(ckpt: Checkpoint, name: str) -> int:
    """Host bytes writing the quantized copy holds at once, from the files' headers: the largest
    tensor as stored, plus CONVERT_BYTES an element for a quantized one (an unquantized tensor is
    written from the tensor read); 0 when the copy is already in the cache (nothing is written)."""
    if entry_problem(_entry(ckpt, name)) is None:
        return 0
    largest = 0
    for file in ckpt.weight_files():
        with open_safetensors(file) as f:
            for key, (stored, _, shape) in _layout(ckpt, f).items():
                extra = CONVERT_BYTES if _quantized(ckpt, key) else 0
                largest = max(largest, math.prod(shape) * (_BYTES[stored] + extra))
    return largest


class _Hashing:
    """A file sink that hashes what it writes (the entry's record costs no second read)."""

    def __init__(self, path: Path):
        self.file, self.digest = open(path, "wb"), hashlib.sha256()

    def write(self, data) -> None:
        self.digest.update(memoryview(data).cast("B"))
        self.file.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def _write(ckpt: Checkpoint, name: str, out: Path) -> None:
    """The copy, file by file and tensor by tensor: each file's safetensors header (from the source's
    shapes and the written dtypes), then each tensor's bytes as it is converted; last, RECORD: every
    file's sha256."""
    scheme = SCHEMES[name]
    hashes = {}
    for entry in sorted(ckpt.path.iterdir()):
        if entry.is_file() and entry.suffix != ".safetensors":
            shutil.copy2(entry, out / entry.name)
            hashes[entry.name] = sha256_file(out / entry.name)
    for file in ckpt.weight_files():
        with open_safetensors(file) as f, _Hashing(out / file.name) as sink:
            layout, header, offset = _layout(ckpt, f), {}, 0
            for key, (_, written, shape) in layout.items():
                size = math.prod(shape) * _BYTES[written]
                header[key] = {"dtype": written, "shape": shape, "data_offsets": [offset, offset + size]}
                offset += size
            header["__metadata__"] = {"format": "pt", "gemma_parity_quantize": name}
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
            sink.write(struct.pack("<Q", len(text)) + text)
            for key, (stored, written, _) in layout.items():
                tensor = f.get_tensor(key)
                if _quantized(ckpt, key):  # what the port computes
                    tensor = dequantize(*quantize_weight(tensor, scheme), torch.float32)
                sink.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())  # a view: no copy
                del tensor
        hashes[file.name] = sink.digest.hexdigest()
    (out / RECORD).write_text(json.dumps({"files": hashes}, indent=1) + "\n", encoding="utf-8")


# Entries verified in this process, with their files' stat signatures: a copy is hashed once a run,
# and again if any of its files changed since.
_INTACT: dict[Path, tuple[tuple, dict[str, str]]] = {}


def _signature(out: Path, files) -> tuple:
    try:
        return tuple((f, st.st_ino, st.st_size, st.st_mtime_ns) for f in sorted(files)
                     for st in [(out / f).lstat()])
    except OSError:
        return ()


def entry_problem(out: Path) -> str | None:
    """What is wrong with cache entry `out` (None: it is whole, every file a regular file matching the
    sha256 recorded when it was written). A missing entry, one of an older format (no record), one
    edited in place or whose files were replaced by links are all problems: the entry is rebuilt."""
    if out in _INTACT and _INTACT[out][0] == _signature(out, [*_INTACT[out][1], RECORD]):
        return None
    if not (out / "config.json").is_file():
        return "absent"
    try:
        recorded = json.loads((out / RECORD).read_text(encoding="utf-8"))["files"]
        if not isinstance(recorded, dict) or not recorded:
            raise ValueError("no files")
        for file, digest in recorded.items():
            path = out / file
            if path.is_symlink() or not path.is_file():
                return f"{file} is {'a link' if path.is_symlink() else 'not a regular file'}"
            if sha256_file(path) != digest:
                return f"{file} does not match the sha256 recorded when it was written"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its record {RECORD} is missing or unreadable ({type(exc).__name__})"
    _INTACT[out] = (_signature(out, [*recorded, RECORD]), recorded)
    return None


def quantized_reference(ckpt: Checkpoint, name: str) -> Checkpoint:
    """The checkpoint of the quantized model under scheme `name` (written on first use, cached by
    the original's file hashes and the scheme), with `unquantized` (the original) and
    `quantization` (the scheme's name) set."""
    out = _entry(ckpt, name)
    problem = entry_problem(out)
    if problem is not None:
        if problem != "absent":  # the tool's own derived data: rebuilt, never trusted, never the user's to fix
            print(f"gemma-parity: note: the cached {name} copy of {ckpt.path} ({out}) was damaged ({problem}); "
                  "rebuilding it from the checkpoint", file=sys.stderr)
        try:
            with atomic_directory(out, replace=out.exists()) as tmp:
                _write(ckpt, name, tmp)
        except OutputError:
            if entry_problem(out) is not None:  # not another run's finished copy of the same entry
                raise
        if entry_problem(out) is not None:
            raise OutputError(f"the cached {name} copy of {ckpt.path} at {out} does not verify after it was written "
                              f"({entry_problem(out)}): the cache directory is being changed under this run; "
                              f"remove {out} and rerun")
    opened = Checkpoint.open(out, validate=False)
    opened._hashes = {k: v for k, v in _INTACT[out][1].items()  # verified now: not hashed a second time
                      if k == "config.json" or k in {p.name for p in opened.weight_files()}}
    opened.unquantized, opened.quantization = ckpt, name
    opened.quantization_note = (f"structural reference: the {name} quantized model of {ckpt.path} (its {name} weights "
                                "dequantized, run by transformers); what quantization costs against the unquantized "
                                f"model is `quality --quantize {name}`'s question (docs/quantization.md)")
    return opened
