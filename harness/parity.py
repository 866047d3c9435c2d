"""One parity run: the port on a backend against the reference (fresh or from a golden), judged
by compare.py's policy. What `gemma-parity check` and the parity suites execute."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.compare import (LayerResult, LogitsResult, PointResult, compare_layers, compare_logits, compare_point,
                             stack_prompts)
from harness.local import PortRun, local_verdicts
from harness.progress import status
from harness.reference import ReferenceResult

@dataclass
class PromptOutcome:
    prompt: list[int]
    reference_tokens: list[int]
    device_tokens: list[int]
    prefill: LogitsResult
    decode: LogitsResult  # teacher-forced on the reference tokens

    @property
    def seq_match(self) -> bool:
        return self.reference_tokens == self.device_tokens

    @property
    def first_mismatch(self) -> int | None:
        return next((i for i, (a, b) in enumerate(zip(self.reference_tokens, self.device_tokens)) if a != b), None)

    def to_json(self) -> dict:
        return {"prompt_length": len(self.prompt), "reference_tokens": self.reference_tokens,
                "device_tokens": self.device_tokens, "seq_match": self.seq_match,
                "first_mismatch": self.first_mismatch, "prefill_logits": self.prefill.to_json(),
                "decode_logits_teacher_forced": self.decode.to_json()}


@dataclass
class CheckResult:
    backend: str
    tp: int
    dtype: str
    embeddings: PointResult
    layers: list[LayerResult]
    final_norm: PointResult
    prompts: list[PromptOutcome]
    # Raw logits at every prompt position and at every teacher-forced decode step, judged like the
    # hidden states: a device graph that softcaps (then the host caps again) or a decode step that
    # reads the wrong cache slots shows here even when the argmax survives.
    logits: PointResult | None = None
    decode_logits: PointResult | None = None
    # The host embedding lookup is the same lookup and the same multiply as transformers': in the
    # port's dtype it must be bit-exact with the reference of that dtype. (An uncast sqrt(hidden)
    # moves the bf16 embedding *toward* fp32, which no fp32-anchored envelope can see.)
    embeddings_exact: bool = True
    # Local verdicts (CPU backend): each layer run alone on the reference's input to it, judged by
    # the same policy. Cumulative error can stay under the factor for a layer that is itself wrong
    # (a full layer's fault adds ~2x the error accumulated upstream); the local ratio does not.
    local: list[dict] | None = None
    notes: list[str] = field(default_factory=list)
    # The port's captures stacked over prompts (name -> [rows, ...]), for the local verdicts.
    device_captures: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def seq_match(self) -> bool:
        return all(p.seq_match for p in self.prompts)

    @property
    def first_divergent_layer(self) -> int | None:
        """The first layer that is itself wrong (local verdict) when local verdicts exist and one
        fails; otherwise the first whose cumulative error breaks the policy."""
        local = next((v["index"] for v in self.local or [] if not v["pass"]), None)
        if local is not None:
            return local
        return next((layer.index for layer in self.layers if not layer.passed), None)

    @property
    def first_divergent_component(self) -> str | None:
        index = self.first_divergent_layer
        if index is None:
            return None
        local = next((v for v in self.local or [] if v["index"] == index and not v["pass"]), None)
        return local["component"] if local else self.layers[index].component

    @property
    def near_ties(self) -> int:
        return sum(p.prefill.near_ties + p.decode.near_ties for p in self.prompts)

    @property
    def divergences(self) -> int:
        return sum(p.prefill.divergences + p.decode.divergences for p in self.prompts)

    @property
    def passed(self) -> bool:
        """Every capture point within the envelope policy, and no token mismatch that is not a
        near tie (a near-tie flip can change a free-running sequence without being a bug)."""
        logit_points = [p for p in (self.logits, self.decode_logits) if p is not None]
        return (self.embeddings.passed and self.embeddings_exact and self.final_norm.passed
                and all(p.passed for p in logit_points) and all(v["pass"] for v in self.local or [])
                and all(layer.passed for layer in self.layers) and self.divergences == 0)

    def _layer_json(self, layer: LayerResult) -> dict:
        out = layer.to_json()
        local = next((v for v in self.local or [] if v["index"] == layer.index), None)
        if local is not None:
            out["local_ratio"], out["local_pass"] = local["ratio"], local["pass"]
            out["pass"] = out["pass"] and local["pass"]
            out["component"] = out["component"] or local["component"]
        return out

    def to_json(self) -> dict:
        return {"passed": self.passed, "seq_match": self.seq_match, "backend": self.backend,
                "tp": self.tp, "dtype": self.dtype, "first_divergent_layer": self.first_divergent_layer,
                "first_divergent_component": self.first_divergent_component, "local_layers": self.local,
                "near_tie_flips": self.near_ties, "real_divergences": self.divergences,
                "embeddings": self.embeddings.__dict__, "embeddings_exact": self.embeddings_exact,
                "final_norm": self.final_norm.__dict__,
                "logits": self.logits.__dict__ if self.logits else None,
                "decode_logits": self.decode_logits.__dict__ if self.decode_logits else None,
                "layers": [self._layer_json(layer) for layer in self.layers],
                "prompts": [p.to_json() for p in self.prompts], "notes": self.notes}


def run_check(engine, spec, ref32: list[ReferenceResult], ref16: list[ReferenceResult],
              backend: str = "cpu", tp: int = 2, dtype: str = "bfloat16", progress: bool = False) -> CheckResult:
    """Run every prompt through the engine (prefill with captures, free greedy decode, and
    teacher-forced decode on the reference tokens) and judge it against the two references."""
    device_caps, outcomes, decode_steps = [], [], []
    say = status(backend, progress, total=len(ref32))
    for k, (r32, r16) in enumerate(zip(ref32, ref16)):
        say(f"prompt {k + 1}/{len(ref32)}: prefill, decode {len(r32.generated)} tokens")
        n_new = len(r32.generated)
        free = engine.generate(r32.prompt, n_new, capture=True)
        forced = engine.generate(r32.prompt, n_new, forced=r32.generated) if n_new else free
        caps = dict(free.prefill.captures)
        caps["logits"] = free.prefill.logits
        device_caps.append(caps)
        decode_steps.append(forced.step_logits)
        cap = spec.final_logit_softcapping
        outcomes.append(PromptOutcome(
            prompt=r32.prompt, reference_tokens=r32.generated, device_tokens=free.tokens,
            prefill=compare_logits(free.prefill.logits, r32.captures["logits"], r16.captures["logits"], cap),
            decode=compare_logits(forced.step_logits, r32.step_logits, r16.step_logits, cap,
                                  ref_tokens=r32.generated),
        ))
    ref_caps = [r.captures for r in ref32]
    env_caps = [r.captures for r in ref16]
    names = ["embeddings", "final_norm", "logits"] + [n for layer in spec.layers
                                            for n in (f"layers.{layer.index}.attn_residual",
                                                      f"layers.{layer.index}.mlp_residual",
                                                      f"layers.{layer.index}.output")]
    dev = {n: stack_prompts(device_caps, n) for n in names}
    ref = {n: stack_prompts(ref_caps, n) for n in names}
    env = {n: stack_prompts(env_caps, n) for n in names}
    same_dtype = ref16 if dtype == "bfloat16" else ref32
    embeddings_exact = all(torch.equal(d["embeddings"], r.captures["embeddings"])
                           for d, r in zip(device_caps, same_dtype))
    decode_logits = None
    if any(steps.numel() for steps in decode_steps):
        decode_logits = compare_point("decode_logits", torch.cat(decode_steps),
                                      torch.cat([r.step_logits for r in ref32]),
                                      torch.cat([r.step_logits for r in ref16]))
    return CheckResult(
        backend=backend, tp=tp, dtype=dtype, embeddings_exact=embeddings_exact,
        logits=compare_point("logits", dev["logits"], ref["logits"], env["logits"]),
        decode_logits=decode_logits, device_captures=dev,
        embeddings=compare_point("embeddings", dev["embeddings"], ref["embeddings"], env["embeddings"]),
        layers=compare_layers(spec, dev, ref, env),
        final_norm=compare_point("final_norm", dev["final_norm"], ref["final_norm"], env["final_norm"]),
        prompts=outcomes,
    )


def check_port(checkpoint, engine, ref32: list[ReferenceResult], ref16: list[ReferenceResult],
               backend: str = "cpu", tp: int = 2, dtype: str = "bfloat16", local: bool | None = None,
               progress: bool = False) -> CheckResult:
    """run_check, plus (by default wherever the backend's ranks run on CPU) the local verdict of
    every layer: that layer alone on the reference's input to it, so `check` names the layer that
    is itself wrong, not only the one where accumulated error first crosses the line."""
    result = run_check(engine, checkpoint.spec, ref32, ref16, backend=backend, tp=tp, dtype=dtype,
                       progress=progress)
    if local is None:
        local = hasattr(engine.backend, "on_ranks")
    if local:
        port_run = PortRun(result.device_captures, result.seq_match, result.near_ties, result.divergences)
        verdicts, _ = local_verdicts(checkpoint, engine.backend, ref32, ref16, port_run, progress)
        result.local = [{"index": v.index, "pass": v.passed, "component": v.component,
                         "ratio": max(p.required_factor for p in v.local)} for v in verdicts]
    else:
        result.notes.append("local (reference-fed) layer verdicts need the CPU backend's ranks; "
                            "run `gemma-parity bisect` to pin a layer on this backend")
    return result


def load_reference_source(checkpoint, checkpoint_dir, golden=None, prompts=None):
    """The golden (read and verified against the checkpoint's spec) or the validated prompts:
    every input checked before any expensive work starts."""
    from harness.golden import read_golden
    from harness.prompts import load_prompts, validate_prompt_ids

    if golden:
        return read_golden(golden, expected_spec=checkpoint.spec)
    loaded = load_prompts(prompts, checkpoint_dir)
    validate_prompt_ids(checkpoint.spec, loaded, prompts)
    return loaded


def load_references(source, checkpoint_dir, new_tokens: int, progress: bool = False):
    """(fp32, bf16) reference results: from a golden, or computed now for the prompts."""
    from harness.golden import Golden
    from harness.reference import run_reference

    if isinstance(source, Golden):
        return source.results("float32"), source.results("bfloat16")
    refs = run_reference(checkpoint_dir, source, new_tokens, progress=progress)
    return refs["float32"], refs["bfloat16"]


def run_parity_check(checkpoint, checkpoint_dir, golden=None, prompts=None, backend: str = "cpu", tp: int = 2,
                     dtype: torch.dtype = torch.bfloat16, new_tokens: int = 8, buckets=(64,), kv_len: int = 256,
                     progress: bool = False) -> CheckResult:
    """What `gemma-parity check` does: the port on `backend` against the reference (recomputed
    for `prompts`, or read from `golden`), judged by the policy."""
    from harness.backends import build_engine
    from harness.reference import dtype_name

    source = load_reference_source(checkpoint, checkpoint_dir, golden, prompts)
    # The backend before the reference: a missing SDK or a bad TP degree is reported before minutes
    # of reference work, and loading the shards checks every weight for NaN/Inf (Checkpoint.get)
    # before transformers (which does not) computes the reference. A parity build: the per-layer
    # captures are extra graph outputs on the device.
    engine = build_engine(checkpoint, backend=backend, tp=tp, dtype=dtype, buckets=buckets, kv_len=kv_len,
                          capture=True)
    ref32, ref16 = load_references(source, checkpoint_dir, new_tokens, progress)
    return check_port(checkpoint, engine, ref32, ref16, backend=backend, tp=tp, dtype=dtype_name(dtype),
                      progress=progress)
