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

import math
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

from harness.compare import (ENVELOPE_FACTOR, LayerResult, PointResult, classify_mismatch, compare_layers,
                             compare_logits, compare_point, layer_points, rel_l2)
from harness.errors import HarnessInputError
from harness.model import attention_mask, rms_norm, rope_cos_sin
from harness.parity import stack_prompts
from harness.reference import ReferenceResult

MODES = ("capture", "truncate")


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"[bisect] {text}", file=sys.stderr, flush=True)


def _finite_or_none(value):
    """JSON has no Infinity or NaN: a non-finite number is written as null (with `finite` beside it)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def tensor_stats(t: torch.Tensor | None) -> dict | None:
    """Polygraphy-style summary of one side's values."""
    if t is None:
        return None
    t = t.double()
    finite = bool(torch.isfinite(t).all())
    return {"mean": float(t.mean()), "std": float(t.std()) if t.numel() > 1 else 0.0,
            "min": float(t.min()), "max": float(t.max()), "finite": finite}


def _layer_input_name(index: int) -> str:
    return "embeddings" if index == 0 else f"layers.{index - 1}.output"


# ---- verdicts ------------------------------------------------------------------------------------

@dataclass
class LayerVerdict:
    """One layer: cumulative points (the port's own run) and local points (the layer alone on the
    golden's input). Truncate mode fills only `cumulative`, with the points its builds read out
    (the output, and the attention residual of the first failing prefix)."""

    index: int
    type: str
    cumulative: list[PointResult]
    local: list[PointResult] = field(default_factory=list)
    # How far transformers' fp32 layer on this checkpoint is from the golden at this layer's output:
    # nonzero when the weights changed since the golden was written.
    checkpoint_drift_rel_l2: float | None = None
    # The port's local run judged against transformers on *this* checkpoint: passes when the port
    # computes today's weights right, so a local failure against the golden is a weight change.
    port_matches_checkpoint: bool | None = None
    stats: dict = field(default_factory=dict)

    @property
    def judged(self) -> list[PointResult]:
        return self.local or self.cumulative

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.judged)

    @property
    def cumulative_passed(self) -> bool:
        return all(p.passed for p in self.cumulative)

    @property
    def component(self) -> str | None:
        """attention when the attention residual breaks the policy; mlp when only the MLP residual
        or the scaled output does (the attention half was fine on the same input)."""
        return _component(self.judged)

    @property
    def finite(self) -> bool:
        return all(p.finite for p in self.cumulative + self.local)

    def to_json(self) -> dict:
        cum, loc = self.cumulative[-1], (self.local[-1] if self.local else None)
        out = {
            "index": self.index, "type": self.type,
            "cumulative_rel_l2": cum.rel_l2, "envelope_rel_l2": cum.envelope_rel_l2,
            "cumulative_ratio": max(p.required_factor for p in self.cumulative),
            "cumulative_pass": self.cumulative_passed,
            "local_rel_l2": loc.rel_l2 if loc else None,
            "local_envelope_rel_l2": loc.envelope_rel_l2 if loc else None,
            "local_ratio": max(p.required_factor for p in self.local) if self.local else None,
            "required_factor": max(p.required_factor for p in self.judged),
            "tolerance_factor": ENVELOPE_FACTOR,
            "pass": self.passed, "finite": self.finite, "component": self.component,
            "checkpoint_drift_rel_l2": self.checkpoint_drift_rel_l2,
            "port_matches_checkpoint": self.port_matches_checkpoint,
            "stats": self.stats,
            "cumulative_points": [asdict(p) for p in self.cumulative],
            "local_points": [asdict(p) for p in self.local],
        }
        return _finite_or_none(out)


def _component(points: list[PointResult]) -> str | None:
    """Without an attention-residual point (a truncate read-out of the output alone) the component
    is not known."""
    attention = [p for p in points if p.name.endswith(".attn_residual")]
    if all(p.passed for p in points) or not attention:
        return None
    return "attention" if not all(p.passed for p in attention) else "mlp"


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
        return self._first_point() is None

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

def _on_ranks(backend, step: Callable[[int], object]) -> list:
    """Run `step(rank)` on every rank's thread, as the CPU backend does, so collectives meet."""
    return backend.on_ranks(step)


def port_layer_captures(backend, index: int, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Layer `index` of the port (every rank's shard, real all-reduce) alone on x [n, hidden]
    from a reset KV cache: its three capture points, [n, hidden] fp32."""
    spec = backend.spec
    positions = torch.arange(x.shape[0])[None]
    window = spec.layers[index].window
    prefix = f"layers.{index}."

    def step(rank):
        module = backend.ranks[rank]
        module.reset_cache()
        layer = module.layers[index]
        mask = attention_mask(positions, module.max_len, window, module.dtype)
        cos, sin = rope_cos_sin(getattr(module, f"inv_freq_{index}"), positions, module.dtype)
        captures: dict[str, torch.Tensor] = {}
        out = layer(x.to(module.dtype)[None], cos, sin, positions, mask, captures, prefix)
        captures[prefix + "output"] = out
        return {k: v[0].float() for k, v in captures.items()}

    return _on_ranks(backend, step)[0]


class ReferenceLayers:
    """transformers' own decoder layer on this checkpoint's weights, fp32 and bf16, one at a time:
    the local envelope (bf16 vs fp32 on the same input) and the checkpoint's drift from the golden."""

    def __init__(self, checkpoint):
        from transformers import AutoConfig
        from transformers.models.gemma4_unified import modeling_gemma4_unified as hf

        self.hf, self.checkpoint, self.spec = hf, checkpoint, checkpoint.spec
        self.config = AutoConfig.from_pretrained(checkpoint.path).get_text_config()
        self.config._attn_implementation = "eager"  # as the port runs (DESIGN §3, fix 3)
        self.rotary = hf.Gemma4UnifiedTextRotaryEmbedding(self.config)

    def layer(self, index: int, dtype: torch.dtype):
        with torch.device("meta"):
            layer = self.hf.Gemma4UnifiedTextDecoderLayer(self.config, index)
        layer.load_state_dict(self.checkpoint.layer_weights(index, dtype), assign=True, strict=True)
        return layer.eval()

    def final_norm(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        norm = self.hf.Gemma4UnifiedRMSNorm(self.spec.hidden_size, eps=self.spec.rms_norm_eps)
        norm.weight.data = self.checkpoint.final_norm_weight(dtype)
        with torch.no_grad():
            return norm(x.to(dtype)).float()

    def captures(self, layer, index: int, x: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        layer_type = self.spec.layers[index].type
        x = x.to(dtype)[None]
        positions = torch.arange(x.shape[1])[None]
        make_mask = create_sliding_window_causal_mask if layer_type == "sliding_attention" else create_causal_mask
        mask = make_mask(config=self.config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                         position_ids=positions)
        prefix, found = f"layers.{index}.", {}

        def attn_hook(module, args, out):
            found["attn"] = x + out

        def mlp_hook(module, args, out):
            found["mlp"] = found["attn"] + out

        hooks = [layer.post_attention_layernorm.register_forward_hook(attn_hook),
                 layer.post_feedforward_layernorm.register_forward_hook(mlp_hook)]
        try:
            with torch.no_grad():
                out = layer(x, position_embeddings=self.rotary(x, positions, layer_type), attention_mask=mask,
                            position_ids=positions)
        finally:
            for h in hooks:
                h.remove()
        return {prefix + "attn_residual": found["attn"][0].float(), prefix + "mlp_residual": found["mlp"][0].float(),
                prefix + "output": out[0].float()}


def _local_layer(spec, index: int, port: list[dict], golden: list[dict], ref32: list[dict],
                 ref16: list[dict], cumulative: LayerResult, device_out: torch.Tensor) -> LayerVerdict:
    """Judge one layer's local run. The error is the port against the golden; the envelope is the
    bf16-vs-fp32 noise of transformers' layer on the same input, added to the golden's value so
    compare_point applies the same policy (floor, per-position ratio) as everywhere else. Using
    this checkpoint's own bf16 output as the envelope would hide a weight change in the envelope."""
    local, against_checkpoint = [], []
    for name in layer_points(index):
        dev, gold = stack_prompts(port, name), stack_prompts(golden, name)
        r32, r16 = stack_prompts(ref32, name), stack_prompts(ref16, name)
        local.append(compare_point(name, dev, gold, _shifted_envelope(gold, r32, r16)))
        against_checkpoint.append(compare_point(name, dev, r32, r16))
    out = f"layers.{index}.output"
    return LayerVerdict(
        index=index, type=spec.layers[index].type, cumulative=cumulative.points, local=local,
        checkpoint_drift_rel_l2=rel_l2(stack_prompts(ref32, out), stack_prompts(golden, out)),
        port_matches_checkpoint=all(p.passed for p in against_checkpoint),
        stats={"golden": tensor_stats(stack_prompts(golden, out)), "port_local": tensor_stats(stack_prompts(port, out)),
               "port_cumulative": tensor_stats(device_out)},
    )


def _prompt_positions(rows: list[int], prompt_lengths: list[int]) -> list[list[int]]:
    """Rows of the prompts' stacked positions -> [prompt, position] pairs."""
    starts = [sum(prompt_lengths[:k]) for k in range(len(prompt_lengths))]
    out = []
    for row in rows:
        k = max(i for i, start in enumerate(starts) if start <= row)
        out.append([k, row - starts[k]])
    return out


def _shifted_envelope(golden: torch.Tensor, r32: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """The golden plus the bf16-vs-fp32 noise of transformers on this checkpoint: compare_point
    then judges the port against the golden by the local bf16 noise, with its usual floor and
    per-position ratio. This checkpoint's own bf16 output would carry any weight change into the
    envelope and hide it."""
    return golden + (r16 - r32)


def final_norm_points(layer_backend, reference: ReferenceLayers, golden_caps: list[dict],
                      port: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                      env: dict[str, torch.Tensor]) -> list[PointResult]:
    """The final norm in the port's run (judged by the golden's bf16 run), and alone on the
    golden's last layer output (rank 0's norm: replicated, no collective)."""
    last = f"layers.{reference.spec.num_layers - 1}.output"
    module = layer_backend.ranks[0]
    with torch.no_grad():
        alone = torch.cat([module.norm(caps[last].to(module.dtype)).float() for caps in golden_caps])
    r32 = torch.cat([reference.final_norm(caps[last], torch.float32) for caps in golden_caps])
    r16 = torch.cat([reference.final_norm(caps[last], torch.bfloat16) for caps in golden_caps])
    gold = ref["final_norm"]
    return [compare_point("final_norm", port["final_norm"], gold, env["final_norm"]),
            compare_point("final_norm", alone, gold, _shifted_envelope(gold, r32, r16))]


def first_nonfinite(spec, captures: dict[str, torch.Tensor], prompt_lengths: list[int]) -> dict | None:
    """The first capture point, in execution order, holding NaN or Inf, and at which [prompt,
    position] pairs (the first 16)."""
    order = ["embeddings"] + [n for layer in spec.layers for n in layer_points(layer.index)] + ["final_norm"]
    for name in order:
        t = captures.get(name)
        if t is not None and not bool(torch.isfinite(t).all()):
            bad = ~torch.isfinite(t)
            rows = bad.reshape(bad.shape[0], -1).any(-1).nonzero().flatten().tolist()
            layer = int(name.split(".")[1]) if name.startswith("layers.") else None
            return {"layer": layer, "point": name, "nan": bool(torch.isnan(t).any()),
                    "inf": bool(torch.isinf(t).any()), "positions": _prompt_positions(rows[:16], prompt_lengths)}
    return None


@dataclass
class PortRun:
    captures: dict[str, torch.Tensor]  # stacked over prompts
    seq_match: bool | None
    near_ties: int
    divergences: int


def run_port_with_captures(engine, spec, ref32: list[ReferenceResult], ref16: list[ReferenceResult],
                           progress: bool = False) -> PortRun:
    """The parity build once per golden prompt: captures at every point, and greedy decode for as
    many tokens as the golden has (SEQ_MATCH, and near-tie flips vs real divergences)."""
    runs, near, real, seq_match = [], 0, 0, True
    cap = spec.final_logit_softcapping
    for k, (r32, r16) in enumerate(zip(ref32, ref16)):
        _say(progress, f"prompt {k + 1}/{len(ref32)} ({len(r32.prompt)} tokens): port run with captures")
        n_new = len(r32.generated)
        if n_new:
            result = engine.generate(r32.prompt, n_new, capture=True)
            pre, tokens = result.prefill, result.tokens
        else:
            pre, tokens = engine.prefill(r32.prompt, capture=True), []
        runs.append(pre.captures)
        logits = compare_logits(pre.logits, r32.captures["logits"], r16.captures["logits"], cap)
        near, real = near + logits.near_ties, real + logits.divergences
        if tokens != r32.generated:
            seq_match = False
            step = next(i for i, (a, b) in enumerate(zip(r32.generated, tokens)) if a != b)
            # the first departing step saw the same prefix on both sides, so its logits compare
            verdict = classify_mismatch(step, r32.step_logits[step], tokens[step], r16.step_logits[step],
                                        r32.generated[step])
            near, real = near + (verdict.kind == "near_tie"), real + (verdict.kind == "divergence")
    names = ["embeddings", "final_norm"] + [n for layer in spec.layers for n in layer_points(layer.index)]
    return PortRun({n: stack_prompts(runs, n) for n in names}, seq_match if any(r.generated for r in ref32) else None,
                   near, real)


# Below this width a layer's ops are too small for intra-op threads to repay their synchronization:
# on the tiny model (hidden 64) on a busy 2-core machine, one thread runs the local phase ~10x and
# a bisect ~2x faster (the CPU backend's rank threads already use the cores).
SMALL_HIDDEN = 1024


@contextmanager
def intra_op_threads_for(spec):
    """One intra-op thread for models narrower than SMALL_HIDDEN, restored afterwards."""
    before = torch.get_num_threads()
    if spec.hidden_size < SMALL_HIDDEN:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _bisect_layer(spec, layer_spec, golden_caps, layer_backend, reference, cumulative, port_run, progress):
    """One layer alone on the golden's input: the port's ranks and transformers' fp32 and bf16."""
    i = layer_spec.index
    _say(progress, f"layer {i + 1}/{spec.num_layers} ({layer_spec.type}): alone on the golden's input")
    inputs = [caps[_layer_input_name(i)] for caps in golden_caps]
    port = [port_layer_captures(layer_backend, i, x) for x in inputs]
    ref_layers = {dt: reference.layer(i, dt) for dt in (torch.float32, torch.bfloat16)}
    r32 = [reference.captures(ref_layers[torch.float32], i, x, torch.float32) for x in inputs]
    r16 = [reference.captures(ref_layers[torch.bfloat16], i, x, torch.bfloat16) for x in inputs]
    verdict = _local_layer(spec, i, port, golden_caps, r32, r16, cumulative[i],
                           port_run.captures[f"layers.{i}.output"])
    lengths = [caps["embeddings"].shape[0] for caps in golden_caps]
    return verdict, first_nonfinite(spec, {n: stack_prompts(port, n) for n in layer_points(i)}, lengths)


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
    cumulative = compare_layers(spec, port_run.captures, ref, env)
    reference = ReferenceLayers(checkpoint)
    verdicts, local_nonfinite = [], None
    for layer_spec in spec.layers:
        verdict, nonfinite = _bisect_layer(spec, layer_spec, golden_caps, layer_backend, reference,
                                           cumulative, port_run, progress)
        verdicts.append(verdict)
        local_nonfinite = local_nonfinite or nonfinite
    final_norm = final_norm_points(layer_backend, reference, golden_caps, port_run.captures, ref, env)
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
    from harness.engine import build_engine

    def build(k: int, part: str):
        _say(progress, f"build {backend}: first {k} layer(s), read-out of layer {k - 1}'s "
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
            _say(progress, judged[(k, part)].explain())
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


# ---- the command ------------------------------------------------------------------------------------

def run_bisect(checkpoint, golden, mode: str | None = None, backend: str = "cpu", tp: int = 2,
               dtype: torch.dtype = torch.bfloat16, buckets=(64,), kv_len: int = 256,
               build: PrefixBuild | None = None, progress: bool = False) -> BisectResult:
    """Bisect `checkpoint` (run on `backend`) against a golden read for the checkpoint's spec. The
    golden may come from other weights (yesterday's): only the architecture must match."""
    from harness.reference import dtype_name

    mode = mode or ("capture" if backend == "cpu" else "truncate")
    if mode not in MODES:
        raise HarnessInputError(f"unknown bisect mode {mode!r}; choose one of {MODES}")
    ref32, ref16 = golden.results("float32"), golden.results("bfloat16")
    longest = max(len(r.prompt) for r in ref32)
    if longest > max(buckets):
        raise HarnessInputError(f"the golden's longest prompt has {longest} tokens, more than the largest "
                                f"bucket {max(buckets)}; pass --buckets with a bucket >= {longest}")
    if mode == "truncate":
        build = build or backend_prefix_build(checkpoint, backend, tp, dtype, buckets, kv_len, progress)
        return bisect_truncate(checkpoint.spec, ref32, ref16, build, backend, tp, dtype_name(dtype), progress)
    from harness.backends.cpu import CpuBackend
    from harness.engine import build_engine

    # capture=True asks a device backend for its parity build (captures as graph outputs)
    engine = build_engine(checkpoint, backend=backend, tp=tp, dtype=dtype, buckets=buckets, kv_len=kv_len,
                          capture=True)
    layer_backend = engine.backend if backend == "cpu" else CpuBackend(checkpoint, tp=tp, dtype=dtype,
                                                                       max_len=kv_len)
    return bisect_capture(checkpoint, engine, layer_backend, ref32, ref16, backend, tp, dtype_name(dtype),
                          progress)


def cmd_bisect(args) -> int:
    from harness.checkpoint import Checkpoint
    from harness.cli import EXIT_FAIL, EXIT_OK, _checkpoint_dir, write_json_atomic
    from harness.golden import read_golden
    from harness.reference import torch_dtype
    from harness.report import format_bisect, write_report

    ckpt = Checkpoint.open(_checkpoint_dir(args))
    print(ckpt.describe())
    golden = read_golden(args.golden, expected_spec=ckpt.spec)
    same = golden.manifest.get("checkpoint", {}).get("files") == ckpt.file_hashes()
    print(f"golden {args.golden}: {len(golden.prompts)} prompt(s); written from "
          f"{'these same weights' if same else 'other weights (checkpoint hashes differ)'}")
    result = run_bisect(ckpt, golden, args.mode, args.backend, args.tp, torch_dtype(args.dtype),
                        args.buckets, args.kv_len, progress=True)
    payload = result.to_json()
    payload["golden"] = str(args.golden)
    payload["golden_from_same_weights"] = same
    print(format_bisect(payload))
    if args.json:
        write_json_atomic(args.json, payload)
    if args.report:
        write_report(args.report, "bisect", payload, ckpt.spec)
        print(f"report written to {args.report}")
    return EXIT_OK if result.passed else EXIT_FAIL


def add_bisect_command(subparsers) -> None:
    from harness.cli import _add_model_args, buckets_arg

    p = subparsers.add_parser(
        "bisect", help="find the first layer that breaks parity with a golden, its component and why",
        description="Compare the port with a golden layer by layer. capture mode (default on cpu) runs "
                    "the parity build once and each layer alone on the golden's input to it; truncate "
                    "mode (default on neuron) binary-searches builds of the first k layers. Exit 0 when "
                    "no layer diverges, 1 when one does, 2 on bad input.")
    _add_model_args(p)
    p.add_argument("--golden", required=True, metavar="DIR",
                   help="golden written by `gemma-parity reference` (may be from other weights of the same spec)")
    p.add_argument("--backend", choices=["cpu", "neuron"], default="cpu")
    p.add_argument("--mode", choices=list(MODES), default=None,
                   help="capture (default on cpu) or truncate (default on neuron: no extra graph outputs)")
    p.add_argument("--tp", type=int, default=2, help="tensor parallel degree (default 2)")
    p.add_argument("--dtype", default="bfloat16", help="port dtype: bfloat16 (default) or float32")
    p.add_argument("--buckets", type=buckets_arg, default=(64,), help="prefill buckets, e.g. 16,64 (default 64)")
    p.add_argument("--kv-len", type=int, default=256, help="KV cache length (default 256)")
    p.add_argument("--json", metavar="FILE", help="write the result as JSON")
    p.add_argument("--report", metavar="DIR", help="write bisect.md, bisect.json and bisect_errors.png there")
    p.set_defaults(func=cmd_bisect)
