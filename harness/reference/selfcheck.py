"""The reference checked against itself before it judges: transformers is the reference,
and transformers has returned wrong logits before (the E-series without a cache, fixed upstream
since). Three checks on one short prompt, fp32, before `check` and `reference` do model work:

- its cached decode (what the references record) equals its uncached recomputation of the same
  sequence, step logits within CACHE_TOLERANCE of the largest |logit| and the same greedy tokens;
- its config survives a save and reload (the dictionary equal);
- its fp32 logits agree with its float64 pass within FP32_TOLERANCE (relative L2): the fp32 envelope
  of the structural stage, with room (docs/judging.md#the-reference-checked-against-itself).

A reference that fails one is refused with exit 2 naming what disagreed (ReferenceRefused). The
float64 pass runs only where a float64 copy is resident-small (harness/reference/float64.py
FLOAT64_RESIDENT_BYTES); a larger checkpoint's fp32 stage measures it against float64 anyway.
Cost: one fp32 and one float64 forward of SELF_CHECK_TOKENS + SELF_CHECK_STEPS tokens.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

import torch

from harness.base.errors import HarnessInputError

SELF_CHECK_TOKENS = 6  # the prompt's first tokens
SELF_CHECK_STEPS = 3  # greedy decode steps, cached, then recomputed uncached
# fp32 cached vs uncached differ by summation order only (~1e-6 of the largest logit on the census);
# a broken path differs by the logits' own size.
CACHE_TOLERANCE = 1e-4
# fp32 against float64 over the whole logits: the census's fp32 references sit at 1e-6 - 1e-5; a
# reference computing in bf16 somewhere sits at 1e-3 and above.
FP32_TOLERANCE = 1e-3


SMALL_HIDDEN = 1024  # as harness/parity/local.py's: narrower models run on one intra-op thread
# Keys that say where a config was read from, not what the model is.
WHERE_FROM = ("_name_or_path", "transformers_version")


class ReferenceRefused(HarnessInputError):
    """The reference disagrees with itself: it cannot judge a port."""


@dataclass
class SelfCheck:
    cache_error: float  # largest |cached - uncached| step logit / largest |logit|
    tokens_agree: bool
    config_equal: bool
    config_diff: list
    float64_error: float | None  # rel L2 of fp32 logits against float64 (None: not run)

    def problems(self) -> list[str]:
        out = []
        if self.cache_error > CACHE_TOLERANCE or not self.tokens_agree:
            out.append(f"cached decode differs from the uncached recomputation of the same sequence: step logits "
                       f"{self.cache_error:.2e} of the largest |logit| apart (tolerance {CACHE_TOLERANCE:g})"
                       + ("" if self.tokens_agree else ", and the greedy tokens differ"))
        if not self.config_equal:
            out.append(f"the config does not survive a save and reload: {', '.join(self.config_diff[:4])} differ")
        if self.float64_error is not None and not self.float64_error <= FP32_TOLERANCE:
            out.append(f"fp32 logits are {self.float64_error:.2e} (relative L2) from the float64 pass, outside the "
                       f"fp32 envelope ({FP32_TOLERANCE:g})")
        return out


def _raw_logits(model, ids: list[int], use_cache: bool) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=use_cache)
    finally:
        hook.remove()
    return seen[-1][0].double()


def _config_diff(checkpoint_dir) -> list[str]:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint_dir)
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        again = AutoConfig.from_pretrained(tmp)
    a, b = config.to_dict(), again.to_dict()
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k not in WHERE_FROM)


def self_check(checkpoint_dir, prompt: list[int], float64: bool = True) -> SelfCheck:
    """The three checks on `prompt`'s first SELF_CHECK_TOKENS tokens (module docstring)."""
    from harness.reference.run import load_reference_model, reference_run

    ids = list(prompt[:SELF_CHECK_TOKENS])
    model = load_reference_model(checkpoint_dir, torch.float32)
    cached = reference_run(model, ids, SELF_CHECK_STEPS, capture=False)
    sequence = ids + cached.generated[:-1]
    uncached = _raw_logits(model, sequence, use_cache=False)[len(ids) - 1:]
    scale = float(uncached.abs().max().clamp_min(1e-30))
    cache_error = float((cached.step_logits.double() - uncached).abs().max()) / scale
    tokens_agree = cached.generated[:-1] == [int(t) for t in uncached[:-1].argmax(-1)]
    l32 = _raw_logits(model, sequence, use_cache=True)
    error64 = None
    if float64:  # the same weights widened (exact): no second load
        l64 = _raw_logits(model.to(torch.float64), sequence, use_cache=True)
        error64 = float((l32 - l64).norm() / l64.norm().clamp_min(1e-30))
    del model
    diff = _config_diff(checkpoint_dir)
    return SelfCheck(cache_error, tokens_agree, not diff, diff, error64)


def refuse_unsound_reference(checkpoint, prompts: list[list[int]]) -> SelfCheck:
    """Run the self-checks on the shortest prompt; raise ReferenceRefused (exit 2) naming what disagreed."""
    from harness.reference.float64 import FLOAT64_RESIDENT_BYTES, float64_bytes

    prompt = min(prompts, key=len) if prompts else [2]
    threads = torch.get_num_threads()
    if checkpoint.spec.hidden_size < SMALL_HIDDEN:  # a small model's ops do not repay intra-op threads
        torch.set_num_threads(1)
    try:
        found = self_check(checkpoint.path, prompt, float64=float64_bytes(checkpoint) <= FLOAT64_RESIDENT_BYTES)
    finally:
        torch.set_num_threads(threads)
    problems = found.problems()
    if problems and hasattr(checkpoint, "check_finite"):
        checkpoint.check_finite()  # a NaN or Inf weight is named as such (NumericsError), not as a disagreement
    if problems:
        raise ReferenceRefused(f"{checkpoint.path}: the reference (transformers) disagrees with itself, so it cannot "
                               f"judge a port: {'; '.join(problems)}. Check the transformers version "
                               "(gemma-parity doctor) and the checkpoint's config")
    return found
