"""Writing a snapshot: a plan line naming its size before anything is written, then the tensors and
the manifest into a temp directory renamed into place (harness.base.atomic: nothing half written
after an error or a signal), sealed as goldens are (harness/inputs/sealed.py: the tensor file
checked complete, one seal over the manifest and the tensors' hash)."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path

import torch

from harness.base.atomic import atomic_directory
from harness.base.errors import OutputError
from harness.base.provenance import package_versions
from harness.inputs.family import runs_alone
from harness.inputs.sealed import tensor_digest, tensor_entries
from harness.snapshot.fields import SNAPSHOT

SEALING_BYTES = 256  # what sealing adds to the manifest: tensors_sha256 and the seal (64 hex each), keys


def planned_bytes(tensors: dict[str, torch.Tensor], manifest: dict) -> int:
    """What the snapshot will take on disk: the tensors' bytes, the safetensors header as it will
    be written (one JSON entry per tensor), and the manifest as written, before its seal."""
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    offset, header = 0, {}
    for name, t in sorted(tensors.items()):
        size = t.numel() * t.element_size()
        header[name] = {"dtype": str(t.dtype), "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = 8 + len(json.dumps(header, separators=(",", ":"))) + 8  # length prefix, padding
    planned = dict(manifest, planned_bytes=10 ** 12)  # the number's width: at most 13 digits
    return data + header_bytes + len(json.dumps(planned, indent=SNAPSHOT.indent)) + SEALING_BYTES


def directory_bytes(path) -> int:
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())


def refuse_existing(out_dir, flag: str) -> None:
    """An output directory must be new or empty: a snapshot is never written over anything."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise OutputError(f"{flag} {out}: already exists and is not an empty directory; a snapshot is never "
                          "written over anything: choose a new directory")


def layer_weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    """One hash over the stored layer weights of every rank (their names and bytes)."""
    h = hashlib.sha256()
    for name in sorted(n for n in tensors if n.startswith("weights.")):
        h.update(name.encode() + tensor_digest(tensors[name]).encode())
    return h.hexdigest()


def settings_record(settings) -> dict:
    """Every run setting that changes the computation, as the snapshot and the repro record them
    (read back by harness.snapshot.read.Snapshot.run_settings)."""
    return {"backend": settings.backend, "tp": settings.tp, "dtype": settings.dtype,
            "buckets": list(settings.buckets), "kv_len": settings.kv_len,
            "sliding_cache": settings.sliding_cache, "batch": settings.batch,
            "quantize": settings.quantize, "speculate": settings.speculate, "assistant": settings.assistant,
            "demo_fault": settings.demo_fault,
            "backend_options": {k: str(v) for k, v in settings.backend_options.items()}}


def user_checkpoint(checkpoint):
    """The checkpoint the user named: for `--quantize`, the original behind the quantized model's copy
    (harness/inputs/quantized_checkpoint.py)."""
    return getattr(checkpoint, "unquantized", None) or checkpoint


def make_manifest(checkpoint, settings, target, tensors: dict[str, torch.Tensor], source: str) -> dict:
    """Everything but the tensors: what the call is, how it was built, where it came from."""
    spec = checkpoint.spec
    return {
        "format_version": SNAPSHOT.version, "kind": SNAPSHOT.kind, "source": source,
        "target": target.to_json(),
        "settings": settings_record(settings),
        "spec_hash": spec.spec_hash(), "num_layers": spec.num_layers,
        "layer_type": "host" if target.host else spec.layers[target.layer].type,
        "runs_alone": False if target.host else runs_alone(spec, target.layer),
        # the user's checkpoint: a quantized run's reference copy is the tool's own, rebuilt from it on replay
        "checkpoint": {"path": str(user_checkpoint(checkpoint).path), "files": user_checkpoint(checkpoint).file_hashes()},
        "layer_weights_sha256": layer_weights_digest(tensors),
        "versions": package_versions(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tensors": tensor_entries(tensors),
    }


def plan_line(out_dir, target, nbytes: int, count: int) -> str:
    from harness.snapshot.target import measure

    kind = "failing" if target.failing else "control (passing run: largest ratio)"
    what = f"host step {target.host} (no device call)" if target.host else f"{target.graph_tag} call"
    return (f"snapshot plan: {out_dir}: {count} tensors, {nbytes / 2**20:.2f} MiB; the {what} of "
            f"prompt {target.prompt} (rows {target.start}..{target.start + target.length - 1}), {kind} point "
            f"{target.point} ({measure(target.to_json())}, {target.stage} stage)")


def write_snapshot(out_dir, checkpoint, settings, target, tensors: dict[str, torch.Tensor], source: str,
                   say=print, extra: dict | None = None) -> dict:
    """Plan (printed through `say`), write, seal: the manifest as written (with `extra`'s keys)."""
    out_dir = Path(out_dir)
    refuse_existing(out_dir, "--snapshot")
    manifest = make_manifest(checkpoint, settings, target, tensors, source=source)
    manifest.update(extra or {})
    nbytes = planned_bytes(tensors, manifest)
    say(plan_line(out_dir, target, nbytes, len(tensors)))
    manifest["planned_bytes"] = nbytes
    with atomic_directory(out_dir, final=True) as tmp:  # a signal after its rename: held, the run ends (commit_point)
        return SNAPSHOT.write(tmp, manifest, tensors, out_dir)


def snapshot_check(result, checkpoint, settings, out_dir, source: str, say=print) -> dict:
    """What `check --snapshot` and `bisect --snapshot` do after their run: choose the call
    (harness.snapshot.target), record it, write it. The written manifest."""
    from harness.snapshot.record import record_call
    from harness.snapshot.target import BITS_STAGE, choose_target, stage_settings

    target = choose_target(result, settings)
    stage = result.judged(target.stage)
    run, extra = stage_settings(settings, target.stage), None
    if target.stage == BITS_STAGE:  # the port's layer alone, bit for bit (harness.snapshot.bits)
        from harness.snapshot.bits import bits_manifest, bits_settings, record_bits

        run, extra = bits_settings(settings), bits_manifest()
        target, tensors = record_bits(checkpoint, target, result.bf16.observation)
    elif target.host:  # no device call: the host step behind the failure (harness.snapshot.host)
        from harness.snapshot.host import record_host

        target, tensors = record_host(checkpoint, run, target, stage)
    else:
        tensors = record_call(checkpoint, run, target, stage.observation)
    manifest = write_snapshot(out_dir, checkpoint, run, target, tensors, source=source, say=say, extra=extra)
    backends = ("cpu (a bit-exact snapshot: cpu at TP 1 only)" if target.stage == BITS_STAGE else
                "cpu (a host step: the same host code on every backend)" if target.host else "cpu|xla|neuron")
    say(f"snapshot written to {out_dir} ({directory_bytes(out_dir) / 2**20:.2f} MiB); replay it with "
        f"`gemma-parity replay {out_dir} --backend {backends}`")
    return manifest
