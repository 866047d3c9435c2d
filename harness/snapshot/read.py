"""Reading a snapshot, validated before any model work: its sealed files read as a golden's are
(harness/inputs/sealed.py: the manifest's kind and format, the tensor file's sha256, the seal over
manifest and tensors, every tensor's own recorded digest and shape), its fields
(harness/snapshot/fields.py), the call's rows consistent across inputs and outputs; then, against
the checkpoint the replay runs, its identity (another checkpoint) and the stored weights against
that checkpoint's layer (another layer's weights). Every refusal is a SnapshotError (exit 2) naming
the file and the problem."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.snapshot.fields import FIX, SNAPSHOT, FieldProblem, SnapshotError, check_manifest, check_tensors


@dataclass
class Snapshot:
    path: Path
    manifest: dict
    tensors: dict[str, torch.Tensor]

    @property
    def target(self) -> dict:
        return self.manifest["target"]

    @property
    def layer(self) -> int:
        return int(self.target["layer"])

    @property
    def tp(self) -> int:
        return int(self.manifest["settings"]["tp"])

    def weights(self, rank: int) -> dict[str, torch.Tensor]:
        prefix = f"weights.r{rank}."
        return {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}

    def kv(self, rank: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        prefix, out = f"kv.r{rank}.", {}
        for name in self.tensors:
            if name.startswith(prefix) and name.endswith(".k"):
                layer = int(name[len(prefix):-2])
                out[layer] = self.tensors[name], self.tensors[f"{prefix}{layer}.v"]
        return out

    def run_settings(self, **changes):
        from harness.base.settings import RunSettings

        s = self.manifest["settings"]
        # every setting that changes the computation, as recorded (harness.snapshot.write.make_manifest)
        settings = RunSettings(backend=s["backend"], tp=s["tp"], dtype=s["dtype"], buckets=tuple(s["buckets"]),
                               kv_len=s["kv_len"], sliding_cache=s["sliding_cache"], batch=s.get("batch", 1),
                               quantize=s.get("quantize"), speculate=s.get("speculate", 0),
                               assistant=s.get("assistant"), demo_fault=s.get("demo_fault"))
        return settings.but(**changes)


def _consistent(path: Path, manifest: dict, tensors: dict) -> None:
    target = manifest.get("target") or {}
    n = target.get("length")
    for name, t in tensors.items():
        if name.split(".")[0] in ("port", "ref", "env", "bits") and t.shape[0] != n:
            raise SnapshotError(f"{path}: {name} has {t.shape[0]} rows but the call has {n} real rows: "
                                f"inconsistent, resealed after an edit; {FIX}")
    ranks = {int(k.split(".")[1][1:]) for k in tensors if k.startswith("weights.")}
    if target.get("host"):  # a host step: its own tensors, no layer's weights
        from harness.snapshot.host import missing_tensors

        missing = missing_tensors(target["host"], tensors)
        if missing or ranks:
            why = f"lacks {', '.join(missing)}" if missing else "holds layer weights"
            raise SnapshotError(f"{path}: a {target['host']} host-step snapshot that {why}: resealed after an edit; "
                                f"{FIX}")
        return
    if ranks != set(range(int(manifest["settings"]["tp"]))):
        raise SnapshotError(f"{path}: weights of ranks {sorted(ranks)} for TP {manifest['settings']['tp']}; {FIX}")


def read_snapshot(path) -> Snapshot:
    """A snapshot verified by itself (hashes, seal, every tensor, consistency)."""
    path = Path(path)
    manifest = SNAPSHOT.read_manifest(path)
    file = SNAPSHOT.check_seal(path, manifest)
    try:  # the seal holds; what the manifest says must hold too (edited and resealed)
        check_manifest(manifest)
        tensors = SNAPSHOT.load(file, manifest)
        check_tensors(manifest, tensors)
    except FieldProblem as exc:
        raise SnapshotError(f"{path / SNAPSHOT.manifest}: {exc}: not what a snapshot holds (edited and resealed?); "
                            f"{FIX}") from None
    _consistent(path, manifest, tensors)
    return Snapshot(path, manifest, tensors)


def check_checkpoint(snap: Snapshot, checkpoint) -> None:
    """The checkpoint a replay runs is the one the snapshot came from, and the stored weights are
    its layer's, as every rank holds them (harness.port.sharding)."""
    from harness.snapshot.record import rank_layer_weights

    from harness.snapshot.write import user_checkpoint

    recorded = snap.manifest["checkpoint"]["files"]
    if snap.manifest.get("spec_hash") != checkpoint.spec.spec_hash():
        raise SnapshotError(f"{snap.path}: written for spec {snap.manifest.get('spec_hash')}, but "
                            f"{checkpoint.path} resolves to spec {checkpoint.spec.spec_hash()}: another model")
    current = user_checkpoint(checkpoint).file_hashes()
    if current != recorded:
        changed = sorted(k for k in set(recorded) | set(current) if recorded.get(k) != current.get(k))
        raise SnapshotError(f"{snap.path}: written from another checkpoint than {checkpoint.path} (files differ: "
                            f"{', '.join(changed[:3])}); pass the checkpoint it came from with --checkpoint")
    if snap.target.get("host"):
        from harness.snapshot.host import check_host_rows

        problem = check_host_rows(snap, checkpoint)
        if problem:
            raise SnapshotError(f"{snap.path}: {problem} ({checkpoint.path}); {FIX}")
        return
    from harness.snapshot.fields import check_judged
    from harness.snapshot.record import judged_points
    from harness.snapshot.target import BITS_STAGE

    if snap.target["stage"] != BITS_STAGE:
        try:
            check_judged(snap.tensors, judged_points(checkpoint.spec, snap.layer, "" if snap.target.get("step") is None
                                                     else "decode."))
        except FieldProblem as exc:
            raise SnapshotError(f"{snap.path}: {exc}: edited and resealed?; {FIX}") from None
    layer, settings = snap.layer, snap.run_settings()
    dtype, quantize = settings.torch_dtype, settings.quantize
    for rank, expected in enumerate(rank_layer_weights(checkpoint, snap.tp, layer, dtype, quantize)):
        stored = snap.weights(rank)
        if set(stored) != set(expected) or any(not torch.equal(stored[k], expected[k]) for k in expected):
            other = _whose_weights(checkpoint, snap, stored, rank, dtype, quantize=quantize)
            raise SnapshotError(f"{snap.path}: the stored weights (rank {rank}) are not layer {layer}'s of "
                                f"{checkpoint.path}{other}: the snapshot was assembled from another layer's "
                                f"weights; {FIX}")


def _whose_weights(checkpoint, snap: Snapshot, stored: dict, rank: int, dtype, quantize=None) -> str:
    from harness.snapshot.record import rank_layer_weights

    for index in range(checkpoint.spec.num_layers):
        if index == snap.layer:
            continue
        other = rank_layer_weights(checkpoint, snap.tp, index, dtype, quantize)[rank]
        if set(other) == set(stored) and all(torch.equal(stored[k], other[k]) for k in other):
            return f" (they are layer {index}'s)"
    return ""


def describe(snap: Snapshot) -> str:
    from harness.snapshot.target import measure

    t = snap.target
    if t.get("host"):
        return (f"snapshot {snap.path}: the host step {t['host']} (no device call) of prompt {t['prompt']}, failing "
                f"point {t['point']} ({measure(t)}, {t['stage']} stage), written by {snap.manifest['source']} on "
                f"{snap.manifest['settings']['backend']} TP {snap.tp} {snap.manifest['settings']['dtype']}")
    return (f"snapshot {snap.path}: the {t['graph_tag']} call of prompt {t['prompt']} (rows {t['start']}.."
            f"{t['start'] + t['length'] - 1}), {'failing' if t['failing'] else 'control'} point {t['point']} "
            f"({measure(t)}, {t['stage']} stage), written by {snap.manifest['source']} on "
            f"{snap.manifest['settings']['backend']} TP {snap.tp} {snap.manifest['settings']['dtype']}; "
            f"{json.dumps(snap.manifest['versions'].get('torch', '?'))} torch")
