"""CPU reference through transformers (eager attention), fp32 and bf16, with per-layer captures.

Capture points, the same names the port's parity build returns:
  embeddings, layers.{i}.attn_residual (after the attention residual add), layers.{i}.mlp_residual
  (after the MLP residual add, before layer_scalar), layers.{i}.output, final_norm, logits (raw,
  before the softcap) and capped_logits. With decode: step_capped_logits (transformers' own capped
  distribution at every step), decode.<point> for every point above at each decode step the model
  runs (rows: steps 1..), and kv.{i}.k / kv.{i}.v: what transformers wrote into its past_key_values
  for layer i (keys after k_norm and rope, values after v_norm), one row per position.
  The hooks that record them: harness/reference/capture.py.
  A streaming mode (harness/reference/stream.py) computes the prefill captures one decoder layer
  at a time from the checkpoint, so peak memory stays near embeddings plus one layer.

The truth never leans on the port: this module imports nothing of the port (engine, model,
sharding, backends) nor the port's numerics (embedding scale, softcap); every number comes from
transformers' own modules (tests/unit/test_layering.py enforces the boundary).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# The dtype vocabulary is the run settings' (one parser for every command and library function).
from harness.base.settings import DTYPES, dtype_name, torch_dtype  # noqa: F401
from harness.inputs.spec import TRANSFORMERS_CLASSES
from harness.reference.capture import Recorder, kv_rows, record_cache_writes
from harness.reference.forcing import Forced, routes_of


@dataclass
class ReferenceResult:
    """One prompt through the reference at one dtype. Tensors are fp32 copies, [n, ...]."""

    prompt: list[int]
    dtype: str
    captures: dict[str, torch.Tensor]
    generated: list[int] = field(default_factory=list)
    step_logits: torch.Tensor | None = None  # [new_tokens, vocab] raw logits that chose each token


def transformers_capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The final softcap exactly as transformers' Gemma-4 forward writes it (divide, tanh,
    multiply), in fp32: the capped distribution the judge holds the host's probabilities to, and the
    streaming reference's capped logits."""
    logits = logits.float()
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def load_reference_model(checkpoint_dir, dtype=torch.float32):
    """transformers' own class for the checkpoint, eager attention (as the port runs)."""
    import transformers
    from transformers import AutoConfig

    from harness.base.progress import third_party_bars

    third_party_bars()
    config = AutoConfig.from_pretrained(checkpoint_dir)
    name, kwargs = TRANSFORMERS_CLASSES.get(config.model_type, TRANSFORMERS_CLASSES["gemma4_unified_text"])[1], {}
    if config.model_type in ("gemma4", "gemma4_text"):
        kwargs["experts_implementation"] = "eager"  # the plain per-expert loop, not a fused kernel
    dtype = dtype if isinstance(dtype, torch.dtype) else torch_dtype(dtype)  # float64: harness/reference/float64.py
    model = getattr(transformers, name).from_pretrained(checkpoint_dir, dtype=dtype,
                                                        attn_implementation="eager", **kwargs)
    return model.eval()


def hf_decoder_parts(spec):
    """transformers' own decoder-layer, rotary, norm and scaled-embedding classes for the spec's
    model type: modeling_gemma4 for the family, modeling_gemma4_unified for the 12B."""
    from types import SimpleNamespace

    if spec.model_type in ("gemma4", "gemma4_text"):
        from transformers.models.gemma4 import modeling_gemma4 as hf

        return SimpleNamespace(layer=hf.Gemma4TextDecoderLayer, rotary=hf.Gemma4TextRotaryEmbedding,
                               norm=hf.Gemma4RMSNorm, embedding=hf.Gemma4TextScaledWordEmbedding,
                               text_model=hf.Gemma4TextModel)
    from transformers.models.gemma4_unified import modeling_gemma4_unified as hf

    return SimpleNamespace(layer=hf.Gemma4UnifiedTextDecoderLayer, rotary=hf.Gemma4UnifiedTextRotaryEmbedding,
                           norm=hf.Gemma4UnifiedRMSNorm, embedding=hf.Gemma4UnifiedTextScaledWordEmbedding,
                           text_model=None)


def text_model(model):
    inner = model.model
    return getattr(inner, "language_model", inner)


def _stack_steps(steps: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"decode.{k}": torch.cat([s[k] for s in steps]) for k in steps[0]} if steps else {}


def reference_run(model, prompt: list[int], new_tokens: int = 0, forced: list[int] | None = None,
                  capture: bool = True, forcing: Forced | None = None) -> ReferenceResult:
    """Prefill with captures, then greedy decode (argmax of transformers' capped logits, as its
    generate does) with the transformers KV cache. With `forced`, feed those tokens instead
    (teacher forcing) so another run's step logits are comparable position by position. With
    capture, every decode step's capture points and the cache writes are recorded too. With
    `forcing` (harness/reference/forcing.py), MoE routers choose the given experts and PLE layers
    take the given gated per-layer inputs at the given positions (teacher-forced, likewise)."""
    from transformers import DynamicCache

    lm = text_model(model)
    recorder = Recorder.on_model(lm) if capture else None
    routing = forcing.hooks(dict(enumerate(lm.layers))) if forcing is not None else []
    raw_logits: list[torch.Tensor] = []
    head = model.lm_head.register_forward_hook(lambda m, a, out: raw_logits.append(out.detach().float()))
    writes: dict[int, list] = {}
    try:
        cache = DynamicCache(config=model.config.get_text_config())
        if capture:
            record_cache_writes(cache, writes)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([prompt], dtype=torch.long), cache=cache, use_cache=True)
            captures = {}
            if recorder is not None:
                captures = {k: v[0].float() for k, v in recorder.captures.items()}
                captures["logits"] = raw_logits[0][0]
                captures["capped_logits"] = out.logits[0].float()
            generated, steps, capped, step_caps = [], [], [], []
            for step in range(new_tokens):
                steps.append(raw_logits[-1][0, -1])
                capped.append(out.logits[0, -1].float())
                generated.append(int(out.logits[0, -1].argmax()))
                if step == new_tokens - 1:
                    break
                fed = forced[step] if forced is not None else generated[-1]
                if recorder is not None:
                    recorder.captures = {}
                out = model(input_ids=torch.tensor([[fed]]), cache=cache, use_cache=True)
                if recorder is not None:
                    step_caps.append({k: v[0].float() for k, v in recorder.captures.items()})
                    step_caps[-1]["logits"] = raw_logits[-1][0]
    finally:
        head.remove()
        for handle in routing:
            handle.remove()
        if recorder is not None:
            recorder.remove()
    if capture:
        captures.update(_stack_steps(step_caps))
        captures.update(kv_rows(writes))
        if capped:
            captures["step_capped_logits"] = torch.stack(capped)
    dtype = "float64" if model.dtype == torch.float64 else dtype_name(model.dtype)
    return ReferenceResult(prompt=list(prompt), dtype=dtype, captures=captures,
                           generated=generated,
                           step_logits=torch.stack(steps) if steps else torch.empty(0, raw_logits[0].shape[-1]))


def run_reference(checkpoint_dir, prompts: list[list[int]], new_tokens: int,
                  dtypes=("float32", "bfloat16"), progress: bool = False) -> dict[str, list[ReferenceResult]]:
    """The fp32 reference, and for the noise envelope the same computation in bf16, teacher-forced
    on the fp32 tokens so that decode steps line up, and on MoE models on the fp32 routing too (a
    near-tied router choice that bf16 flips would otherwise put whole expert outputs into the
    envelope)."""
    from harness.base.progress import status

    results: dict[str, list[ReferenceResult]] = {}
    fp32_runs = None
    say = status("reference", progress, total=len(dtypes) * len(prompts))
    for name in dtypes:
        model = load_reference_model(checkpoint_dir, name)
        top_k = getattr(model.config.get_text_config(), "top_k_experts", None)
        runs = []
        for k, prompt in enumerate(prompts):
            say(f"{name} prompt {k + 1}/{len(prompts)} ({len(prompt)} tokens)")
            forced = fp32_runs[k].generated if fp32_runs is not None else None
            routes = Forced(routes=routes_of(fp32_runs[k], top_k)) if fp32_runs is not None and top_k else None
            runs.append(reference_run(model, prompt, new_tokens, forced=forced, forcing=routes))
        if torch_dtype(name) == torch.float32:
            fp32_runs = runs
        results[dtype_name(torch_dtype(name))] = runs
        del model
    return results


def rerun_reference(checkpoint_dir, dtype: str, fed: list[list[int]],
                    runs_and_forcing: tuple[list[ReferenceResult], list[Forced]]) -> list[ReferenceResult]:
    """`runs` again (same prompts, teacher-forced on `fed`, the fp32 reference's tokens) with each
    prompt's `forcing[k]` (routing, gated per-layer inputs): the reference along another run's
    path. The fp32 results keep `fed` as their tokens (the tokens the port is judged on); logits,
    captures and the bf16 results' own choices are the re-run's."""
    runs, forcing = runs_and_forcing
    model = load_reference_model(checkpoint_dir, dtype)
    out = []
    for run, tokens, forced in zip(runs, fed, forcing):
        again = reference_run(model, run.prompt, len(tokens), forced=tokens, forcing=forced)
        if torch_dtype(dtype) == torch.float32:
            again.generated = list(tokens)
        out.append(again)
    del model
    return out
