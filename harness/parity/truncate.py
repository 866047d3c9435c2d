"""Truncate-mode bisection (devices): build models of the first k layers whose head reads out the
last layer's (normalized) hidden state, judge that against the golden's output of layer k - 1, and
binary-search k. No extra graph outputs: the same graph the perf build compiles, only shorter.
Builds are cached by (k, part); the build function is injectable."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from harness.base.errors import HarnessInputError
from harness.base.progress import status
from harness.base.settings import RunSettings
from harness.judge.compare import PointResult, compare_point
from harness.parity.bisect_result import BisectResult
from harness.judge.layers import LayerVerdict
from harness.parity.local import intra_op_threads_for
from harness.port.model import rms_norm
from harness.reference.run import ReferenceResult


# build(k, part) -> a callable prompt -> [n, hidden] fp32 read-out of layer k-1's output ("layer")
# or of its attention residual ("attention"), RMS-normalized (the read-out goes through the
# final norm with unit weight; see PrefixCheckpoint).
PrefixBuild = Callable[[int, str], Callable[[list[int]], torch.Tensor]]


def first_failing_prefix(num_layers: int, fails: Callable[[int], bool]) -> int | None:
    """The smallest k in 1..num_layers with fails(k), assuming a failing prefix stays failing as it
    grows (error propagates down the residual stream); None when the whole model passes.
    ceil(log2(num_layers + 1)) probes at most: <= ceil(log2 L) + 1."""
    lo, hi = 1, num_layers + 1  # hi == num_layers + 1 stands for "no prefix fails"
    while lo < hi:
        mid = (lo + hi) // 2
        if fails(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo if lo <= num_layers else None


class PrefixCheckpoint:
    """A checkpoint seen as its first k layers, with a head that reads the hidden state out.

    The device graph of the perf build returns logits = lm_head(final_norm(x)). With the final
    norm's weight set to ones and lm_head's first `hidden` rows set to the identity, the first
    `hidden` logits are rms_norm(x) of the last layer: no extra graph outputs, the same graph the
    perf build compiles, only shorter. The per-position scale of x is lost to the norm; every other
    error shows. With part="attention" the last layer's MLP is silenced (down_proj zero, so
    post_feedforward_layernorm(0) = 0) and its layer_scalar set to 1: the read-out is then its
    attention residual, which names the component with one more build.
    """

    def __init__(self, checkpoint, k: int, part: str = "layer"):
        spec = checkpoint.spec
        if not 1 <= k <= spec.num_layers:
            raise HarnessInputError(f"prefix of {k} layers: choose 1..{spec.num_layers}")
        if spec.vocab_size < spec.hidden_size:
            raise HarnessInputError(f"vocab_size {spec.vocab_size} < hidden_size {spec.hidden_size}: the "
                                    "truncate read-out needs one logit per hidden lane; use --mode capture")
        self.base, self.k, self.part = checkpoint, k, part
        self.path = checkpoint.path
        self.spec = replace(spec, layers=spec.layers[:k])

    def layer_weights(self, index: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        weights = self.base.layer_weights(index, dtype)
        if self.part == "attention" and index == self.k - 1:
            weights["mlp.down_proj.weight"] = torch.zeros_like(weights["mlp.down_proj.weight"])
            weights["layer_scalar"] = torch.ones_like(weights["layer_scalar"])
        return weights

    def embed_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.base.embed_weight(dtype)

    def final_norm_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.ones(self.spec.hidden_size, dtype=dtype or torch.float32)

    def lm_head_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        h, v = self.spec.hidden_size, self.spec.vocab_size
        readout = torch.zeros(v, h, dtype=dtype or torch.float32)
        readout[:h] = torch.eye(h)
        return readout

    def file_hashes(self) -> dict[str, str]:
        return self.base.file_hashes()


def backend_prefix_build(checkpoint, settings: RunSettings, progress: bool = False) -> PrefixBuild:
    """Builds through the normal backend path (build_engine): on a device each prefix is a real
    compile of the perf graph, cached by the backend under its spec (which differs per k); the
    attention-only build of the same k has the same spec, so it reuses that compile with other
    weights (the backends load weights through rank_state_dicts(view))."""
    from harness.backends import build_engine

    say = status("bisect", progress)

    def build(k: int, part: str):
        say(f"build {settings.backend}: first {k} layer(s), read-out of layer {k - 1}'s "
            f"{'attention residual' if part == 'attention' else 'output'}")
        view = PrefixCheckpoint(checkpoint, k, part)
        engine = build_engine(view, settings)  # a perf build: the graph the device times
        hidden = checkpoint.spec.hidden_size
        return lambda prompt: engine.prefill(prompt).logits[:, :hidden]

    return build


def _readout(x: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """What the read-out head gives for hidden states x: rms_norm in `dtype`, back to fp32."""
    return rms_norm(x.to(dtype), None, eps).float()


def bisect_truncate(spec, ref32: list[ReferenceResult], ref16: list[ReferenceResult], build: PrefixBuild, *,
                    settings: RunSettings = RunSettings(), progress: bool = False,
                    name_component: bool = True) -> BisectResult:
    """Truncate mode: binary-search the first failing prefix of the port, judging each prefix's
    read-out against the golden's (cumulative) output at its last layer. Each (k, part) is built
    at most once."""
    builds: dict[tuple[int, str], Callable] = {}
    say = status("bisect", progress)
    judged: dict[tuple[int, str], PointResult] = {}

    def point(k: int, part: str) -> PointResult:
        if (k, part) not in judged:
            if (k, part) not in builds:
                builds[(k, part)] = build(k, part)
            run = builds[(k, part)]
            name = f"layers.{k - 1}.{'attn_residual' if part == 'attention' else 'output'}"
            dev = torch.cat([run(r.prompt).float() for r in ref32])
            ref = torch.cat([_readout(r.captures[name], spec.rms_norm_eps, torch.float32) for r in ref32])
            env = torch.cat([_readout(r.captures[name], spec.rms_norm_eps, torch.bfloat16) for r in ref16])
            judged[(k, part)] = compare_point(name, dev, ref, env)
            say(judged[(k, part)].explain())
        return judged[(k, part)]

    with intra_op_threads_for(spec):
        first = first_failing_prefix(spec.num_layers, lambda k: not point(k, "layer").passed)
        if first is not None and name_component:
            point(first, "attention")  # the verdict reads the component from this point
    verdicts = [LayerVerdict(index=k - 1, type=spec.layers[k - 1].type,
                             cumulative=[judged[(k, p)] for p in ("attention", "layer") if (k, p) in judged])
                for k in sorted({k for k, _ in judged})]
    bad = next((v for v in verdicts if v.index == (first or 0) - 1), None)
    nonfinite = None
    if bad is not None and not bad.finite:
        nonfinite = {"layer": bad.index, "point": next(p.name for p in bad.cumulative if not p.finite),
                     "where": "prefix read-out"}
    notes = ["truncate mode: each build's read-out is the RMS-normalized last hidden state (no extra graph "
             "outputs); errors are cumulative, so the first failing prefix is where the error first breaks "
             "the policy; a fault that only rescales whole positions shows one layer later"]
    return BisectResult(mode="truncate", backend=settings.backend, tp=settings.tp, dtype=settings.dtype,
                        num_layers=spec.num_layers,
                        layers=verdicts, builds=len(builds), nonfinite=nonfinite, first_failing_prefix=first,
                        notes=notes,
                        prompt_lengths=[len(r.prompt) for r in ref32])


