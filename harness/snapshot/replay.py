"""Replaying a snapshot's call on a backend and judging it by the check's own judge
(harness.judge.compare, the snapshot's stage: bf16 envelope or fp32 structural) against the
reference rows stored beside it.

Whole: the call as recorded (inputs, positions, the KV rows it reads) through the backend's
parity build; the snapshot's layer points and final norm judged. Where the recorded KV rows cannot
be loaded (a compiled backend, another TP degree), the engine's earlier calls of the prompt, also
recorded, run first and build the cache on that backend. Layer: the layer alone (its
ranks, real collectives, harness.parity.layer_alone) on the stage reference's input to it, with
the recorded KV rows; only where ranks live on the host (cpu) and the layer runs alone
(harness.inputs.family.runs_alone). Several backends name whose failure it is: shown by every
backend, the port's; shown by a compiled backend and not by cpu, that backend's compilation or
runtime divergence."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.base.errors import OptionError
from harness.base.points import Point
from harness.inputs.family import runs_alone
from harness.judge.compare import JUDGES, compare_point
from harness.snapshot.record import BEFORE_EXPERTS, LOGITS, call_name, judged_points
from harness.snapshot.target import BITS_STAGE

MODES = ("whole", "layer")


@dataclass
class BackendReplay:
    backend: str
    tp: int
    mode: str
    points: list = field(default_factory=list)  # PointResult, in run order
    rerouted: list = field(default_factory=list)  # MoE layers where the replay chose other experts than recorded

    @property
    def judged(self) -> list:
        """The points the stored references can judge: all of them, or, where this replay routes otherwise
        than the recorded call, those computed before the first rerouted layer's experts ran (the
        references follow the recorded routing from there on)."""
        return [p for p in self.points if not self.rerouted or before_experts(p.name, min(self.rerouted))]

    @property
    def reproduces(self) -> bool:
        return any(not p.passed for p in self.judged)

    def describe(self) -> str:
        failing = [p for p in self.judged if not p.passed]
        head = f"{self.backend} (TP {self.tp}, {self.mode}): "
        unjudged = [p for p in self.points if not p.passed and p not in failing]
        routed = (f"; it routes otherwise than the recorded call at MoE layers {self.rerouted} (a router near tie): "
                  f"the stored references follow the recorded routing, so points from layer {min(self.rerouted)}'s "
                  f"experts on are not judged ({len(unjudged)} of them outside the judge)" if self.rerouted else "")
        if failing:
            return head + (f"REPRODUCES: {failing[0].name} {failing[0].required_factor:.3g}x (first of {len(failing)})"
                           + routed)
        if not self.judged:
            return head + "judged no point: every point of the snapshot comes after the rerouted experts" + routed
        worst = max(self.judged, key=lambda p: p.required_factor)
        return head + f"agrees: every point within the judge (largest {worst.name} {worst.required_factor:.3g}x)" + routed


def before_experts(name: str, layer: int) -> bool:
    """Whether point `name` is computed before MoE layer `layer`'s experts run (so that a different
    expert choice there cannot move it)."""
    point = Point.parse(name)
    if not point.in_layer:
        return point.kind == "embeddings"
    return point.layer < layer or (point.layer == layer and point.part in BEFORE_EXPERTS)


def check_mode(snap, backend_name: str, mode: str, tp: int) -> None:
    """What a replay of `mode` needs, refused before any model work."""
    from harness.backends import backend_class, backend_unavailable

    if snap.target["stage"] == BITS_STAGE:  # the layer alone as the bit-exact stage ran it
        from harness.snapshot.bits import check_bits_mode

        return check_bits_mode(backend_name, tp)
    if snap.target.get("host"):  # host code: the same on every backend, nothing built
        if mode == "layer":
            raise OptionError(f"--layer: this snapshot is of a host step ({snap.target['host']}), no layer is behind "
                              "it; drop --layer")
        return None
    cls = backend_class(backend_name)
    why = backend_unavailable(backend_name)
    if why:
        raise OptionError(f"--backend {backend_name}: {why}")
    if mode == "layer":
        if not cls.host_ranks:
            raise OptionError(f"--layer on the {backend_name} backend: a layer runs alone only where the ranks live on "
                              "this host (cpu); replay the whole call there (drop --layer)")
        spec_layer = snap.layer
        if snap.target["point"] in LOGITS or snap.target["point"].endswith("final_norm"):
            raise OptionError(f"--layer {spec_layer}: the failing point is the call's head ({snap.target['point']}, "
                              "after its last layer); replay the whole call (drop --layer)")
        if snap.manifest.get("runs_alone") is False:
            raise OptionError(f"--layer {spec_layer}: this layer reads per-layer inputs or another layer's cache and "
                              "cannot run alone; replay the whole call (drop --layer)")
    if snap.kv(0) and not _loads_kv(cls, snap, tp) and (mode == "layer" or not _priors(snap)):
        raise OptionError(f"the call reads {snap.target['start']} cached rows, recorded per rank at TP {snap.tp}: they "
                          f"load only into a host backend at TP {snap.tp} (cpu); replay the whole call there")


def _loads_kv(cls, snap, tp: int) -> bool:
    return bool(cls.host_ranks) and tp == snap.tp


def _priors(snap) -> list[tuple]:
    """The engine's earlier calls of the prompt, (inputs_embeds, positions), in order."""
    t, out = snap.tensors, []
    while f"prior.{len(out)}.positions" in t:
        out.append((t[f"prior.{len(out)}.inputs_embeds"], t[f"prior.{len(out)}.positions"]))
    return out


def _load_kv(backend, snap) -> None:
    """The recorded cache rows into every rank's caches (linear: rows [0, start); ring: whole)."""
    for rank in range(backend.tp):
        for layer, (k, v) in snap.kv(rank).items():
            cache = backend.ranks[rank].layers[layer].self_attn.cache
            rows = k.shape[2]
            cache.k = cache.k.clone()
            cache.v = cache.v.clone()
            cache.k[:, :, :rows] = k.to(cache.k.dtype)
            cache.v[:, :, :rows] = v.to(cache.v.dtype)


def _load_layer_weights(backend, snap) -> None:
    """The snapshot's own weights of its layer on every rank (a host backend at the snapshot's TP)."""
    if not backend.host_ranks or backend.tp != snap.tp:
        return
    for rank in range(backend.tp):
        layer = backend.ranks[rank].layers[snap.layer]
        missing, unexpected = layer.load_state_dict(snap.weights(rank), strict=False)
        if unexpected:
            raise OptionError(f"{snap.path}: weights {unexpected[:3]} do not belong to layer {snap.layer}'s module")


def _judge(snap, outputs: dict[str, torch.Tensor], names: list[str]) -> list:
    judge = JUDGES[snap.target["stage"]]
    t = snap.tensors
    pooled = {name: tuple(t[f"pooled.{name}"].tolist()) for name in names if f"pooled.{name}" in t}
    return [compare_point(name, outputs[call_name(name)], t[f"ref.{name}"], t[f"env.{name}"], judge,
                          pooled=pooled.get(name, (0.0, 0.0))) for name in names]


def replay_whole(engine, snap) -> dict[str, torch.Tensor]:
    backend = engine.backend
    backend.reset()
    _load_layer_weights(backend, snap)
    if snap.kv(0) and _loads_kv(type(backend), snap, backend.tp):
        _load_kv(backend, snap)
    else:  # a compiled backend or another TP: the engine's earlier calls build the cache there
        for embeds, positions in _priors(snap):
            backend.forward(embeds, positions)
    t, n = snap.tensors, snap.target["length"]
    logits, captures = backend.forward(t["call.inputs_embeds"], t["call.positions"], capture=True,
                                       seq_ids=t.get("call.seq_ids"))  # as the engine passed them
    return {name: v[0, :n].float() for name, v in dict(captures, logits=logits).items()}


def replay_layer(engine, snap) -> dict[str, torch.Tensor]:
    """The layer alone on every rank over the recorded cache rows (harness.parity.layer_alone)."""
    from harness.parity.layer_alone import port_layer_on_cache

    backend = engine.backend
    _load_layer_weights(backend, snap)
    backend.reset()
    if snap.kv(0):
        _load_kv(backend, snap)  # the recorded rows: the layer's attention reads them
    t = snap.tensors
    return port_layer_on_cache(backend, snap.layer, t["ref.input"], t["call.positions"])


def replay(snap, checkpoint, backend_name: str, tp: int | None = None, mode: str = "whole") -> BackendReplay:
    """One backend's replay of the call, judged."""
    from harness.parity.local import intra_op_threads_for
    from harness.parity.observe import build_port

    if snap.target["stage"] == BITS_STAGE:  # the process's own threads, as the stage and the recording ran
        from harness.snapshot.bits import replay_bits

        return replay_bits(snap, checkpoint)
    if snap.target.get("host"):  # no device call: the port's host code on the recorded inputs
        from harness.snapshot.host_replay import replay_host

        return replay_host(snap, checkpoint, backend_name, tp or snap.tp)
    tp = tp or snap.tp
    settings = snap.run_settings(backend=backend_name, tp=tp)
    recorded = snap.manifest["settings"]
    if backend_name == recorded["backend"] and recorded.get("backend_options"):  # the build's own options
        from harness.backends import backend_options

        settings = settings.but(backend_options=backend_options(backend_name, recorded["backend_options"]))
    from harness.port.demo_fault import planted

    with intra_op_threads_for(checkpoint.spec), planted(settings.demo_fault):  # a demo snapshot's bug, again
        engine = build_port(checkpoint, settings)
        outputs = (replay_layer if mode == "layer" else replay_whole)(engine, snap)
    names = judged_points(checkpoint.spec, snap.layer, "" if snap.target.get("step") is None else "decode.")
    if mode == "layer":
        names = names[:-1]  # the layer's points: the final norm is not run
    else:
        names += [n for n in LOGITS if f"ref.{n}" in snap.tensors]  # a head target's logits
    return BackendReplay(backend_name, tp, mode, _judge(snap, outputs, names), _rerouted(snap, outputs, checkpoint.spec))


def _rerouted(snap, outputs: dict, spec) -> list[int]:
    """The MoE layers whose experts, chosen by this replay, differ from the recorded call's (routes.*)."""
    from harness.snapshot.record import call_routes

    recorded = {k: v for k, v in snap.tensors.items() if k.startswith("routes.")}
    if not recorded:
        return []
    captures = {k: v[None] for k, v in outputs.items()}  # call_routes reads a call's [1, rows, ...] captures
    replayed = call_routes(spec, captures, snap.layer, snap.target["length"])
    return [int(k.split(".")[1]) for k, v in recorded.items() if k in replayed and not torch.equal(v, replayed[k])]


def whose(snap, replays: list[BackendReplay]) -> str:
    """Which backends reproduce the snapshot's failure, and what that makes it."""
    shown = [r.backend for r in replays if r.reproduces]
    ran = [r.backend for r in replays]
    what = "the failure" if snap.target["failing"] else "a divergence from this passing control"
    moved = [r.backend for r in replays if r.rerouted]
    # a replay routing otherwise is judged only where its routing cannot move a point (BackendReplay.judged)
    routed = (f" ({', '.join(moved)} routes otherwise than the recorded call: judged only up to the first "
              "rerouted layer's experts)" if moved else "")
    if not shown:
        return f"no backend run ({', '.join(ran)}) reproduces {what}" + routed
    if len(shown) == len(ran):
        kind = "the port's own (it shows on every backend run)" if len(ran) > 1 else f"reproduced on {ran[0]}"
        return f"{what} reproduces on {', '.join(shown)}: {kind}" + routed
    clean = [b for b in ran if b not in shown]
    kind = ("a compilation or runtime divergence of " + ", ".join(shown)) if "cpu" in clean else \
        f"shown by {', '.join(shown)} only"
    return f"{what} reproduces on {', '.join(shown)} but not on {', '.join(clean)}: {kind}" + routed
