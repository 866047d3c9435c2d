"""First divergent layer: which layer of the port breaks parity with a golden, which part, and why.

Two modes (DESIGN §5: extra graph outputs change what the compiler builds):

- capture (CPU): one run of the parity build gives every layer's cumulative error against the
  golden. Each layer is then also run alone on the golden's input to it (Polygraphy's `debug
  reduce` idea: feed reference intermediates to the piece under test), which gives its *local*
  error: a layer that is itself wrong is told apart from error accumulated upstream. The first
  divergent layer is the first whose local error breaks compare.py's policy; its inner residual
  points name the component.
- truncate (devices): build models of the first k layers whose head reads out the last layer's
  (normalized) hidden state instead of logits, judge that against the golden's output of layer
  k - 1, and binary-search k. Builds are cached by (k, part); the build function is injectable.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

from harness.compare import ENVELOPE_FACTOR, PointResult, compare_point, stack_prompts
from harness.errors import HarnessInputError
from harness.local import (LayerVerdict, PortRun, ReferenceLayers, _component, _finite_or_none, final_norm_points,
                           first_nonfinite, intra_op_threads_for, local_verdicts, run_port_with_captures)
from harness.model import rms_norm
from harness.progress import status
from harness.reference import ReferenceResult

MODES = ("capture", "truncate")


# ---- verdicts ------------------------------------------------------------------------------------

@dataclass
class BisectResult:
    mode: str
    backend: str
    tp: int
    dtype: str
    num_layers: int
    layers: list[LayerVerdict]
    builds: int
    nonfinite: dict | None = None
    seq_match: bool | None = None
    near_tie_flips: int | None = None
    real_divergences: int | None = None
    first_failing_prefix: int | None = None  # truncate mode: the smallest k whose output fails
    notes: list[str] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)  # rows are the prompts' positions, stacked
    # capture mode: the points around the layers. The host embedding lookup against the golden's,
    # and the final norm in the port's run and alone on the golden's last layer output.
    embeddings: PointResult | None = None
    final_norm: list[PointResult] = field(default_factory=list)
    # The fp32 structural stage (harness.parity): the port in fp32 against the golden's fp32
    # reference to fp32 precision. A structural bug inside bf16 noise fails here.
    fp32_stage: dict | None = None

    def _first_point(self) -> tuple[str, LayerVerdict | None] | None:
        """(name, layer) of the first point that breaks the policy, in this order: embeddings; the
        first layer whose local error breaks it; the final norm alone; then, when nothing is wrong
        on its own, the first layer (or the final norm) whose cumulative error breaks it."""
        if self.embeddings is not None and not self.embeddings.passed:
            return "embeddings", None
        if self.mode == "truncate":
            if self.first_failing_prefix is None:
                return None
            bad = next(v for v in self.layers if v.index == self.first_failing_prefix - 1)
            return f"layers.{bad.index}", bad
        bad = next((v for v in self.layers if not v.passed), None)
        if bad is not None:
            return f"layers.{bad.index}", bad
        if self.final_norm and not self.final_norm[-1].passed:
            return "final_norm", None
        bad = next((v for v in self.layers if not v.cumulative_passed), None)
        if bad is not None:
            return f"layers.{bad.index}", bad
        if self.final_norm and not self.final_norm[0].passed:
            return "final_norm", None
        return None

    @property
    def first_divergent_point(self) -> str | None:
        first = self._first_point()
        return None if first is None else first[0]

    @property
    def first_bad(self) -> LayerVerdict | None:
        first = self._first_point()
        return None if first is None else first[1]

    @property
    def first_divergent_layer(self) -> int | None:
        bad = self.first_bad
        return None if bad is None else bad.index

    @property
    def component(self) -> str | None:
        bad = self.first_bad
        if bad is None:
            return None
        return bad.component or _component(bad.cumulative)

    @property
    def cause(self) -> str | None:
        """nonfinite | weights (the port computes this checkpoint right; the checkpoint differs
        from the golden's here) | port (the port's layer differs from transformers on the same
        weights) | accumulated (nothing wrong alone) | divergent (truncate: not told apart) |
        embeddings | final_norm."""
        first = self._first_point()
        if first is None:
            return None
        name, bad = first
        if bad is None:
            points = [self.embeddings] if name == "embeddings" else self.final_norm
            if not all(p.finite for p in points):
                return "nonfinite"
            return name if name == "embeddings" or not self.final_norm[-1].passed else "accumulated"
        if not all(p.finite for p in bad.judged):
            return "nonfinite"
        if self.mode == "truncate":
            return "divergent"
        if bad.passed:
            return "accumulated"
        return "weights" if bad.port_matches_checkpoint else "port"

    @property
    def passed(self) -> bool:
        return self._first_point() is None and (self.fp32_stage is None or self.fp32_stage["passed"])

    def to_json(self) -> dict:
        layers = [v.to_json() for v in self.layers]
        edges = {"embeddings": asdict(self.embeddings) if self.embeddings else None,
                 "final_norm": dict(zip(("cumulative", "local"), (asdict(p) for p in self.final_norm))) or None}
        self._locate_positions([p for layer in layers for p in layer["cumulative_points"] + layer["local_points"]]
                               + [p for p in [edges["embeddings"], *(edges["final_norm"] or {}).values()] if p])
        return _finite_or_none({
            "passed": self.passed, "mode": self.mode, "backend": self.backend, "tp": self.tp,
            "dtype": self.dtype, "num_layers": self.num_layers,
            "first_divergent_layer": self.first_divergent_layer, "component": self.component,
            "first_divergent_point": self.first_divergent_point, "cause": self.cause, "builds": self.builds,
            "nonfinite": self.nonfinite, "first_failing_prefix": self.first_failing_prefix,
            "seq_match": self.seq_match, "near_tie_flips": self.near_tie_flips,
            "real_divergences": self.real_divergences, "tolerance_factor": ENVELOPE_FACTOR,
            "prompt_lengths": self.prompt_lengths, **edges, "layers": layers, "notes": self.notes,
            "fp32_stage": self.fp32_stage,
        })

    def _locate_positions(self, points: list[dict]) -> None:
        """Points' worst_position indexes the prompts' stacked rows: say which prompt and position."""
        for p in points:
            row = p["worst_position"]
            for k, n in enumerate(self.prompt_lengths):
                if row < n:
                    p["worst_prompt"], p["worst_prompt_position"] = k, row
                    break
                row -= n


# ---- capture mode: the port's per-layer run on the golden's inputs ------------------------------

def bisect_capture(checkpoint, engine, layer_backend, ref32: list[ReferenceResult],
                   ref16: list[ReferenceResult], backend: str = "cpu", tp: int = 2, dtype: str = "bfloat16",
                   progress: bool = False, port_run: PortRun | None = None) -> BisectResult:
    """Capture mode. `engine` runs the parity build (any backend) unless `port_run` already holds
    its captures; `layer_backend` is a CPU backend whose rank modules run each layer alone on the
    golden's input."""
    with intra_op_threads_for(checkpoint.spec):
        return _bisect_capture(checkpoint, engine, layer_backend, ref32, ref16, backend, tp, dtype, progress,
                               port_run)


def _bisect_capture(checkpoint, engine, layer_backend, ref32, ref16, backend, tp, dtype, progress,
                    port_run=None) -> BisectResult:
    spec = checkpoint.spec
    port_run = port_run or run_port_with_captures(engine, spec, ref32, ref16, progress)
    golden_caps = [r.captures for r in ref32]
    ref = {n: stack_prompts(golden_caps, n) for n in port_run.captures}
    env = {n: stack_prompts([r.captures for r in ref16], n) for n in port_run.captures}
    verdicts, local_nonfinite = local_verdicts(checkpoint, layer_backend, ref32, ref16, port_run, progress)
    final_norm = final_norm_points(layer_backend, ReferenceLayers(checkpoint), golden_caps, port_run.captures,
                                   ref, env)
    embeddings = compare_point("embeddings", port_run.captures["embeddings"], ref["embeddings"], env["embeddings"])
    nonfinite = first_nonfinite(spec, port_run.captures, [len(r.prompt) for r in ref32])
    if nonfinite:
        nonfinite["where"] = "port run"
    elif local_nonfinite:
        nonfinite = dict(local_nonfinite, where="layer alone on the golden's input")
    notes = []
    if backend != "cpu":
        notes.append(f"cumulative errors come from the {backend} parity build; local runs use the port's "
                     "layer code on the CPU backend, so a compiler fault shows only as cumulative "
                     "error: use --mode truncate to pin it on the device")
    return BisectResult(mode="capture", backend=backend, tp=tp, dtype=dtype, num_layers=spec.num_layers,
                        layers=verdicts, builds=1, nonfinite=nonfinite, seq_match=port_run.seq_match,
                        near_tie_flips=port_run.near_ties, real_divergences=port_run.divergences, notes=notes,
                        prompt_lengths=[len(r.prompt) for r in ref32], embeddings=embeddings,
                        final_norm=final_norm)


# ---- truncate mode: binary search over builds of the first k layers -----------------------------

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


def backend_prefix_build(checkpoint, backend: str = "cpu", tp: int = 2, dtype: torch.dtype = torch.bfloat16,
                         buckets=(64,), kv_len: int = 256, progress: bool = False) -> PrefixBuild:
    """Builds through the normal backend path (build_engine): on a device each prefix is a real
    compile of the perf graph, cached by the backend under its spec (which differs per k); the
    attention-only build of the same k has the same spec, so it reuses that compile with other
    weights (the backends load weights through rank_state_dicts(view))."""
    from harness.backends import build_engine

    say = status("bisect", progress)

    def build(k: int, part: str):
        say(f"build {backend}: first {k} layer(s), read-out of layer {k - 1}'s "
            f"{'attention residual' if part == 'attention' else 'output'}")
        view = PrefixCheckpoint(checkpoint, k, part)
        engine = build_engine(view, backend=backend, tp=tp, dtype=dtype, buckets=buckets, kv_len=kv_len)
        hidden = checkpoint.spec.hidden_size
        return lambda prompt: engine.prefill(prompt).logits[:, :hidden]

    return build


def _readout(x: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """What the read-out head gives for hidden states x: rms_norm in `dtype`, back to fp32."""
    return rms_norm(x.to(dtype), None, eps).float()


def bisect_truncate(spec, ref32: list[ReferenceResult], ref16: list[ReferenceResult], build: PrefixBuild,
                    backend: str = "cpu", tp: int = 2, dtype: str = "bfloat16", progress: bool = False,
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
    return BisectResult(mode="truncate", backend=backend, tp=tp, dtype=dtype, num_layers=spec.num_layers,
                        layers=verdicts, builds=len(builds), nonfinite=nonfinite, first_failing_prefix=first,
                        notes=notes,
                        prompt_lengths=[len(r.prompt) for r in ref32])


# ---- the library entry point ------------------------------------------------------------------------------------

def run_bisect(checkpoint, golden, mode: str | None = None, backend: str = "cpu", tp: int = 2,
               dtype: torch.dtype = torch.bfloat16, buckets=(64, 256), kv_len: int = 256,
               build: PrefixBuild | None = None, progress: bool = False, sliding_cache: str = "linear") -> BisectResult:
    """Bisect `checkpoint` (run on `backend`) against a golden read for the checkpoint's spec. The
    golden may come from other weights (yesterday's): only the architecture must match."""
    from harness.reference import dtype_name

    mode = mode or ("capture" if backend == "cpu" else "truncate")
    if mode not in MODES:
        raise HarnessInputError(f"unknown bisect mode {mode!r}; choose one of {MODES}")
    ref32, ref16 = golden.results("float32"), golden.results("bfloat16")
    if mode == "truncate":
        build = build or backend_prefix_build(checkpoint, backend, tp, dtype, buckets, kv_len, progress)
        return bisect_truncate(checkpoint.spec, ref32, ref16, build, backend, tp, dtype_name(dtype), progress)
    from harness.backends.cpu import CpuBackend
    from harness.backends import build_engine

    # capture=True asks a device backend for its parity build (captures as graph outputs)
    engine = build_engine(checkpoint, backend=backend, tp=tp, dtype=dtype, buckets=buckets, kv_len=kv_len,
                          capture=True, sliding_cache=sliding_cache)
    layer_backend = engine.backend if backend == "cpu" else CpuBackend(checkpoint, tp=tp, dtype=dtype,
                                                                       max_len=kv_len, sliding_cache=sliding_cache)
    return bisect_capture(checkpoint, engine, layer_backend, ref32, ref16, backend, tp, dtype_name(dtype),
                          progress)


def bisect_golden(checkpoint, golden_path, mode: str | None = None, backend: str = "cpu", tp: int = 2,
                  dtype: torch.dtype = torch.bfloat16, buckets=(64, 256), kv_len: int = 256,
                  progress: bool = False, fp32_stage: bool = True,
                  sliding_cache: str = "linear") -> tuple[BisectResult, dict]:
    """What `gemma-parity bisect` does: read the golden for the checkpoint's spec (or take the
    Golden already read), bisect, and return the result with its JSON payload (which says whether
    the golden came from these weights)."""
    from harness.golden import Golden, read_golden, same_weights
    from harness.parity import fp32_structural_stage

    golden = golden_path if isinstance(golden_path, Golden) else read_golden(golden_path,
                                                                             expected_spec=checkpoint.spec)
    same = bool(same_weights(golden, checkpoint))
    result = run_bisect(checkpoint, golden, mode, backend, tp, dtype, buckets, kv_len, progress=progress,
                        sliding_cache=sliding_cache)
    if fp32_stage:
        stage = fp32_structural_stage(checkpoint, golden.results("float32"), golden.results("bfloat16"),
                                      backend, tp, buckets, kv_len, progress, sliding_cache)
        result.fp32_stage = {"passed": stage.stage_passed, "failures": stage.failures()[:20],
                             "first_divergent_layer": stage.first_divergent_layer,
                             "first_divergent_component": stage.first_divergent_component}
    payload = result.to_json()
    payload["golden"] = str(golden.path)
    payload["golden_from_same_weights"] = same
    return result, payload
