"""What a stage observed, as data: per capture point the device, reference and envelope values
stacked over prompts with a label per row, assembled point by point from the port's runs and the
references (harness/parity/observe.py runs them; the judges read this)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from harness.base.points import KV_PARTS, Point, kv_points, layer_points
from harness.reference.run import ReferenceResult


class StageReferences(NamedTuple):
    """The references of a stage: the fp32 and the bf16 reference results, one per prompt."""

    fp32: list[ReferenceResult]
    bf16: list[ReferenceResult]


@dataclass
class PortPrompt:
    """One prompt through the port: teacher-forced run with captures and cache reads, free run."""

    forced: object  # DecodeResult
    free: object  # DecodeResult
    kv: list  # [(written, [(k, v) per layer])]
    prefill_probs: torch.Tensor
    step_probs: torch.Tensor


@dataclass
class StageObservation:
    """Per capture point the device, fp32 reference and bf16 reference (envelope) values stacked
    over prompts, a label per row, and the token runs. `rerouted`: the references' dtypes computed
    again along the port's path; `pinned`: the gated per-layer input rows the references took from
    the port; `followed`: whether the references could follow the port's path at all."""

    stage: str
    runs: list[PortPrompt]
    ref32: list[ReferenceResult]
    ref16: list[ReferenceResult]
    dev: dict[str, torch.Tensor] = field(default_factory=dict)
    ref: dict[str, torch.Tensor] = field(default_factory=dict)
    env: dict[str, torch.Tensor] = field(default_factory=dict)
    labels: dict[str, list[str]] = field(default_factory=dict)
    reads_cache: bool = True
    seconds: float = 0.0
    rerouted: list[str] = field(default_factory=list)
    pinned: list[str] = field(default_factory=list)
    followed: bool = True
    forcing: list = field(default_factory=list)  # what the references were forced to (forced_path.Forced per prompt)
    # the bf16 stage's own path (harness/parity/own_path.py): transformers' routers alone on the port's
    # router inputs, per router point (fp32, bf16), and its head alone on demand (OwnPath)
    alone_routers: dict = field(default_factory=dict)
    own_path: object = None

    @property
    def references(self) -> StageReferences:
        return StageReferences(self.ref32, self.ref16)

    def add(self, name: str, values: tuple, labels: list[str]) -> None:
        """values: (device, fp32 reference, bf16 reference) rows of one prompt."""
        for store, t in zip((self.dev, self.ref, self.env), values):
            store.setdefault(name, []).append(t.float())
        if name in ("embeddings", "decode.embeddings", "decode_logits", "decode.kv.0.k"):
            self.labels.setdefault(Point.parse(name).rows, []).extend(labels)
        if Point.parse(name).kind == "kv":  # a ring layer holds fewer rows than its row group
            self.labels.setdefault(name, []).extend(labels)

    def stack(self) -> None:
        for store in (self.dev, self.ref, self.env):
            for name, parts in store.items():
                store[name] = torch.cat(parts)

    def label(self, name: str, row: int) -> str:
        labels = self.labels.get(name) or self.labels.get(Point.parse(name).rows, [])
        return labels[row] if 0 <= row < len(labels) else f"row {row}"


def assemble_observation(stage: str, runs: list[PortPrompt], spec, refs: StageReferences,
                         reads_cache: bool = True) -> StageObservation:
    """The port's runs beside the references, point by point."""
    obs = StageObservation(stage, runs, refs.fp32, refs.bf16, reads_cache=reads_cache)
    for k, (run, r32, r16) in enumerate(zip(runs, refs.fp32, refs.bf16)):
        _prefill_points(obs, spec, k, run, (r32, r16))
        _decode_points(obs, spec, k, run, (r32, r16))
    obs.stack()
    return obs


def own_caches(cache: list) -> list:
    """(layer, (k, v)) of the layers that hold a cache (None: a KV-shared layer)."""
    return [(i, c) for i, c in enumerate(cache) if c is not None]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A cache read [kv_heads, positions, head_dim] as the reference stores it: [positions, kv_heads * head_dim]."""
    return t.transpose(0, 1).reshape(t.shape[1], -1)


def _prefill_points(obs: StageObservation, spec, k: int, run: PortPrompt, refs: tuple) -> None:
    r32, r16 = refs
    pre = run.forced.prefill
    dev = dict(pre.captures, logits=pre.logits)
    labels = [f"prompt {k} position {p}" for p in range(pre.logits.shape[0])]
    names = ["embeddings"] + [n for layer in spec.layers for n in layer_points(layer.index, spec=spec)] + ["final_norm", "logits"]
    for name in names:
        obs.add(name, (dev[name], r32.captures[name], r16.captures[name]), labels)
    if run.kv and all(kv_points(i)[0] in r32.captures for i, c in enumerate(run.kv[0][1]) if c is not None):
        written, cache = run.kv[0]
        for i, pair in own_caches(cache):  # a KV-shared layer (model_blocks) holds none
            held = written - pair[0].shape[1]  # a ring layer holds only its last window positions
            for name, t in zip(kv_points(i), pair):
                obs.add(name, (_rows(t), r32.captures[name][held:written], r16.captures[name][held:written]),
                        labels[held:])


def _decode_points(obs: StageObservation, spec, k: int, run: PortPrompt, refs: tuple) -> None:
    r32, r16 = refs
    n, forced = len(r32.prompt), run.forced
    steps = forced.step_logits.shape[0]
    step_labels = [f"prompt {k} decode step {s} (position {n + s - 1})" for s in range(steps)]
    if steps:
        obs.add("decode_logits", (forced.step_logits, r32.step_logits, r16.step_logits), step_labels)
    if steps > 1 and "decode.final_norm" in r32.captures:
        for name, dev in forced.step_captures.items():
            full = f"decode.{name}"
            obs.add(full, (dev, r32.captures[full], r16.captures[full]), step_labels[1:])
    if len(run.kv) > 1 and "kv.0.k" in r32.captures:
        for s, (written, cache) in enumerate(run.kv[1:], 1):
            # after each step every slot decode has written so far, and after the last step every
            # written slot (a step that overwrote a prefill slot shows there)
            start = 0 if s == len(run.kv) - 1 else n
            labels = [f"prompt {k} position {p} after decode step {s}" for p in range(start, written)]
            for i, pair in own_caches(cache):  # a KV-shared layer (model_blocks) holds none
                first = written - pair[0].shape[1]  # a ring layer holds only its last window positions
                held = max(start, first)
                for side, t in zip(KV_PARTS, pair):
                    ref_name = Point("kv", i, side).name
                    obs.add(Point("kv", i, side, decode=True).name,
                            (_rows(t)[held - first:], r32.captures[ref_name][held:written],
                             r16.captures[ref_name][held:written]), labels[held - start:])
