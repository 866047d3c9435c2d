"""The snapshot's format: its two files, sealed as goldens are (harness/inputs/sealed.py), and its
manifest's fields and tensors' kinds, validated before any model work.

The seal proves that the files are the ones the manifest lists; it says nothing of what the
manifest holds, so a snapshot edited and resealed (by hand or by a tool that knows the format) is
read field by field here: each field the replay uses has its type and range, each tensor the
replay feeds or judges is present with its dtype and rank. A bad one is named (exit 2: SnapshotError,
raised by harness.snapshot.read), never left to crash the replay."""

from __future__ import annotations

import torch

from harness.base.errors import HarnessInputError
from harness.base.settings import QUANTIZE_CHOICES, SLIDING_CACHES, dtype_name
from harness.inputs.sealed import SealedFormat


class SnapshotError(HarnessInputError):
    """A snapshot that cannot be trusted: refused before any model work (exit 2)."""


FIX = "write the snapshot again with `check --snapshot DIR` or `bisect --snapshot DIR`"
SNAPSHOT = SealedFormat("snapshot", "snapshot.json", "snapshot.safetensors", seal_key="snapshot_sha256", version=1,
                        error=SnapshotError, source="a directory written by --snapshot", fix=FIX, kind="gemma-parity device-call snapshot",
                        indent=1, digests=True)


class FieldProblem(ValueError):
    """One manifest field or tensor that is not what the replay needs (its message names it)."""


def _int(value, name: str, low: int = 0, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
        raise FieldProblem(f"{name} is {value!r}, not {bound}")
    return value


def _str(value, name: str, choices=None) -> str:
    if not isinstance(value, str) or (choices is not None and value not in choices):
        raise FieldProblem(f"{name} is {value!r}, not " + (f"one of {', '.join(choices)}" if choices else "a string"))
    return value


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise FieldProblem(f"{name} is {value!r}, not a number")
    return value


def _dict(manifest: dict, name: str) -> dict:
    value = manifest.get(name)
    if not isinstance(value, dict):
        raise FieldProblem(f"{name} is {'missing' if name not in manifest else repr(value)}, not an object")
    return value


def check_settings(s: dict) -> None:
    from harness.backends import BACKENDS

    _str(s.get("backend"), "settings.backend", tuple(BACKENDS))
    _int(s.get("tp"), "settings.tp", 1)
    try:
        dtype_name(s.get("dtype"))
    except Exception:
        raise FieldProblem(f"settings.dtype is {s.get('dtype')!r}, not bfloat16 or float32") from None
    buckets = s.get("buckets")
    if not isinstance(buckets, list) or not buckets:
        raise FieldProblem(f"settings.buckets is {buckets!r}, not a list of positive integers")
    for b in buckets:
        _int(b, "settings.buckets", 1)
    _int(s.get("kv_len"), "settings.kv_len", 1)
    _str(s.get("sliding_cache"), "settings.sliding_cache", SLIDING_CACHES)
    _int(s.get("batch", 1), "settings.batch", 1)
    _int(s.get("speculate", 0), "settings.speculate", 0)
    if s.get("quantize") is not None:
        _str(s["quantize"], "settings.quantize", QUANTIZE_CHOICES)
    if s.get("demo_fault") is not None:
        from harness.port.demo_fault import DEMO_FAULTS

        _str(s["demo_fault"], "settings.demo_fault", tuple(DEMO_FAULTS))
    if s.get("assistant") is not None:
        _str(s["assistant"], "settings.assistant")
    if not isinstance(s.get("backend_options", {}), dict):
        raise FieldProblem("settings.backend_options is not an object")


def check_target(t: dict, num_layers: int) -> None:
    from harness.judge.compare import JUDGES
    from harness.snapshot.host import KINDS
    from harness.snapshot.target import BITS_STAGE

    _str(t.get("stage"), "target.stage", (*JUDGES, BITS_STAGE))
    _str(t.get("point"), "target.point")
    if t.get("host") is not None:
        _str(t["host"], "target.host", KINDS)
    else:  # a device call's (or the layer alone's) layer: one the model has
        _int(t.get("layer"), "target.layer", 0, num_layers - 1)
    if not isinstance(t.get("failing"), bool):
        raise FieldProblem(f"target.failing is {t.get('failing')!r}, not true or false")
    _number(t.get("ratio"), "target.ratio")
    _int(t.get("prompt"), "target.prompt")
    _int(t.get("start"), "target.start")
    _int(t.get("length"), "target.length", 1)
    if t.get("step") is not None:
        _int(t["step"], "target.step")


def check_manifest(manifest: dict) -> None:
    """Every field the reader and the replay use (FieldProblem naming the first bad one)."""
    _str(manifest.get("source"), "source")
    _str(manifest.get("spec_hash"), "spec_hash")
    num_layers = _int(manifest.get("num_layers"), "num_layers", 1)
    check_settings(_dict(manifest, "settings"))
    check_target(_dict(manifest, "target"), num_layers)
    ckpt = _dict(manifest, "checkpoint")
    _str(ckpt.get("path"), "checkpoint.path")
    files = ckpt.get("files")
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise FieldProblem(f"checkpoint.files is {files!r}, not an object of file names and sha256s")
    if not isinstance(manifest.get("versions", {}), dict):
        raise FieldProblem("versions is not an object")


def _tensor(tensors: dict, name: str, rank: int, floating: bool | None = None) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise FieldProblem(f"tensor {name} is missing")
    if t.dim() != rank:
        raise FieldProblem(f"tensor {name} has {t.dim()} dimensions {list(t.shape)}, not {rank}")
    if floating is not None and t.is_floating_point() != floating:
        raise FieldProblem(f"tensor {name} is {str(t.dtype).removeprefix('torch.')}, not "
                           f"{'a floating-point' if floating else 'an integer'} tensor")
    return t


def check_tensors(manifest: dict, tensors: dict) -> None:
    """The tensors the replay feeds and judges: present, of their dtype kind and rank, every stored
    row tensor at least one row deep (a 0-d tensor is named)."""
    for name, t in tensors.items():
        if t.dim() == 0 and not name.startswith("pooled."):
            raise FieldProblem(f"tensor {name} is 0-dimensional")
    from harness.snapshot.target import BITS_STAGE

    target = manifest["target"]
    if target.get("host") is not None or target["stage"] == BITS_STAGE:
        return  # their own tensors are checked by their kind (harness.snapshot.host, .bits)
    embeds = _tensor(tensors, "call.inputs_embeds", 3, floating=True)
    positions = _tensor(tensors, "call.positions", 2, floating=False)
    if positions.shape[1] != embeds.shape[1] or positions.shape[1] < target["length"]:
        raise FieldProblem(f"tensor call.positions {list(positions.shape)} does not fit call.inputs_embeds "
                           f"{list(embeds.shape)} and the call's {target['length']} rows")
    _tensor(tensors, "ref.input", 2, floating=True)
    j = 0
    while f"prior.{j}.positions" in tensors or f"prior.{j}.inputs_embeds" in tensors:
        _tensor(tensors, f"prior.{j}.inputs_embeds", 3, floating=True)
        _tensor(tensors, f"prior.{j}.positions", 2, floating=False)
        j += 1
    for name, t in tensors.items():
        if name.startswith("kv.") and (t.dim() != 4 or not t.is_floating_point()):
            raise FieldProblem(f"tensor {name} {list(t.shape)} is not a 4-dimensional floating-point cache")


def check_judged(tensors: dict, names: list[str]) -> None:
    """Each judged point's stored reference and envelope rows (names from the checkpoint's spec)."""
    for name in names:
        for side in ("ref", "env"):
            t = tensors.get(f"{side}.{name}")
            if t is None or not t.is_floating_point():
                raise FieldProblem(f"tensor {side}.{name} is {'missing' if t is None else 'not floating-point'}")
