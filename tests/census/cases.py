"""The census's healthy ports (issue 26): shapes x weights x prompt sets x run settings. FAST runs
in the default lane; the rest in the slow lane."""

from __future__ import annotations

from dataclasses import dataclass

from tests.census.ports import ISSUE_SHAPE, Run, Shape, prompt_of

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Case:
    id: str
    shape: Shape
    run: Run
    fast: bool = False


ONE = Run((prompt_of(1),), 0)  # one 1-token prompt, no new tokens
ONE_NEW = Run((prompt_of(1),), 1)
SHORT = Run((prompt_of(3), prompt_of(8)), 20)
PAST_WINDOW = Run((prompt_of(40), prompt_of(5)), 8)  # the tiny window is 16
CHUNKED = Run((prompt_of(40),), 4, buckets=(16,))  # prefilled in chunks of 16
RING = Run((prompt_of(40), prompt_of(8)), 8, sliding_cache="ring")

GLOBAL_KV = {f"global-kv{n}-kev{int(kev)}": Shape(f"gkv{n}{int(kev)}", "default",
                                                  (("num_global_key_value_heads", n), ("attention_k_eq_v", kev)))
             for n in (1, 2, 4) for kev in (True, False)}
PATTERNS = {
    "pattern-3to1": Shape("p31", "default", (("layer_types", (SLIDING,) * 3 + (FULL,) + (SLIDING,) * 3 + (FULL,)),)),
    "pattern-1to1-window8": Shape("p11", "default", (("layer_types", (SLIDING, FULL) * 3), ("sliding_window", 8))),
    "pattern-5to1-window32": Shape("p51", "builder", (("sliding_window", 32),)),
    "pattern-all-sliding-last-full": Shape("pas", "default", (("layer_types", (SLIDING,) * 7 + (FULL,)),)),
}
FAMILY = {f"family-{v}-{init}": Shape(f"fam{v}", init, (), 0, v) for v in ("31b", "e2b", "e4b", "26b-a4b")
          for init in ("builder", "default")}

CASES = [
    Case("issue26-short", ISSUE_SHAPE, Run((prompt_of(8), prompt_of(3)), 10), fast=True),
    Case("builder-seed0-one-token", Shape("builder", "builder"), ONE, fast=True),
    Case("default-seed0-one-new", Shape("default", "default"), ONE_NEW, fast=True),
    Case("builder-seed1-past-window-tp4", Shape("builder", "builder", (), 1), Run(PAST_WINDOW.prompts, 8, tp=4)),
    Case("family-26b-a4b-builder-4-new", FAMILY["family-26b-a4b-builder"], Run((prompt_of(3), prompt_of(8)), 4),
         fast=True),
]
CASES += [Case(f"builder-seed{s}-short", Shape("builder", "builder", (), s), SHORT) for s in (0, 1, 2)]
CASES += [Case(f"default-seed{s}-short", Shape("default", "default", (), s), SHORT) for s in (0, 1, 2)]
CASES += [Case(f"default-seed{s}-past-window", Shape("default", "default", (), s), PAST_WINDOW) for s in (1, 2)]
CASES += [Case(f"{name}-short", shape, SHORT) for name, shape in GLOBAL_KV.items()]
CASES += [Case(f"{name}-past-window", shape, PAST_WINDOW) for name, shape in PATTERNS.items()]
CASES += [Case(f"{name}-short", shape, Run(SHORT.prompts, 8)) for name, shape in FAMILY.items()]
CASES += [Case(f"{name}-one-token", shape, ONE) for name, shape in FAMILY.items() if name.endswith("builder")]
CASES += [
    Case("builder-seed2-chunked", Shape("builder", "builder", (), 2), CHUNKED),
    Case("default-seed1-chunked", Shape("default", "default", (), 1), CHUNKED),
    Case("builder-seed0-ring", Shape("builder", "builder"), RING),
    Case("default-seed2-ring", Shape("default", "default", (), 2), RING),
    Case("builder-seed0-tp1", Shape("builder", "builder"), Run(SHORT.prompts, 20, tp=1)),
    Case("default-seed0-tp4", Shape("default", "default"), Run(SHORT.prompts, 20, tp=4)),
    Case("global-kv4-tp4", GLOBAL_KV["global-kv4-kev1"], Run(PAST_WINDOW.prompts, 8, tp=4)),
    Case("issue26-one-token", ISSUE_SHAPE, ONE),
    Case("issue26-one-new", ISSUE_SHAPE, ONE_NEW),
]

# Realistic width and depth (slow lane): 12 layers, 5 sliding : 1 full, transformers' default init and
# the builder's conditioned weights; short prompts bound the time.
REALISTIC = (("hidden_size", 768), ("intermediate_size", 3072), ("num_attention_heads", 12), ("num_key_value_heads", 4),
             ("head_dim", 64), ("global_head_dim", 128))
WIDE = (("hidden_size", 1024), ("intermediate_size", 4096), ("num_attention_heads", 16), ("num_key_value_heads", 8),
        ("head_dim", 64), ("global_head_dim", 128))
REALISTIC_CASES = [
    Case("realistic-768-default", Shape("r768", "default", REALISTIC), Run((prompt_of(8), prompt_of(3)), 4)),
    Case("realistic-768-builder", Shape("r768", "builder", REALISTIC), Run((prompt_of(8), prompt_of(3)), 4)),
    Case("realistic-1024-default-past-window", Shape("r1024", "default", WIDE), Run((prompt_of(40),), 4)),
]
CASES += REALISTIC_CASES

# Issue 38: the family at prompts of 40 and 5 tokens (45 positions a point): enough rows for the
# distributional gate (harness/judge/ratios.py MIN_POSITIONS) to judge each variant. transformers'
# default init only (the calibration run had both inits: the default init's R reached the census's
# largest cumulative medians, docs/judging.md#the-distributional-gate), to bound the slow lane.
CASES += [Case(f"{name}-past-window", shape, PAST_WINDOW) for name, shape in FAMILY.items() if name.endswith("default")]

# Issue 38: the E2B whose per-layer model projection is small next to its norm's eps (its weights x
# 1e-3), where leaving out the projection's 1/sqrt(hidden) scale is large (tests/faults/precision.py
# ple-projection-scale-missing fails it at `layers.0.per_layer_input` in both stages, fp32 at ~1e5x).
E2B_SMALL_PROJECTION = Case("family-e2b-small-projection-past-window",
                            Shape("e2bsmall", "default", (), 0, "e2b", (("per_layer_model_projection", 1e-3),)),
                            PAST_WINDOW)
CASES += [E2B_SMALL_PROJECTION]

# Issue 38, slow lane, run ONCE by the lead on an idle machine (~14 GiB, ~4 minutes): the 12B's real
# widths (hidden 3840, vocabulary 262144, heads of 256 and 512, one KV head on the full layer), two
# layers (one sliding, one full), the fp32 stage skipped (its fp32 port would not fit beside the
# references), the local verdicts on: the distributional gate's calibration at the real widths.
REAL_WIDTHS = (("hidden_size", 3840), ("intermediate_size", 15360), ("vocab_size", 262144),
               ("num_attention_heads", 16), ("num_key_value_heads", 8), ("head_dim", 256), ("global_head_dim", 512),
               ("num_global_key_value_heads", 1), ("sliding_window", 1024),
               ("layer_types", ("sliding_attention", "full_attention")))
REAL_WIDTH_CASE = Case("real-widths-12b-two-layers", Shape("w12b", "default", REAL_WIDTHS),
                       Run((prompt_of(40), prompt_of(5)), 4, fp32_stage=False, local=True))
CASES += [REAL_WIDTH_CASE]

# Issue 45: KV sharing in gemma4_unified (transformers 5.24's Gemma4UnifiedTextConfig has
# num_kv_shared_layers and its modeling applies it): the tiny 12B's layers 8-11 read layers 7 and 5's
# caches, with the double-wide MLP on them; both inits, TP 1 and 2 (TP 2 of the builder's in the default lane).
UNIFIED_KV = {init: Shape(f"ukv{init}", init, (("num_kv_shared_layers", 4), ("use_double_wide_mlp", True)))
              for init in ("builder", "default")}
CASES += [Case(f"unified-kv-shared-{init}-tp{tp}", shape, Run(SHORT.prompts, 8, tp=tp), fast=(init, tp) == ("builder", 2))
          for init, shape in UNIFIED_KV.items() for tp in (1, 2)]
