"""The upstream census (issue 45): transformers' own Gemma-4 tester configurations, built with the
classes' own initialisation (no margin-widening builder), at several seeds, TP 1 and TP 2.

Where each configuration comes from (transformers' test suite, as read in the public repository;
the commit is the stored version read):

- `Gemma4TextModelTester` (huggingface/transformers/tests/models/gemma4/test_modeling_gemma4.py:58-86 at commit
  bb7902f58039bb42cfe06b92a07e7b538a0c8dbc): 4 layers sliding/full/sliding/full, 2 KV-shared
  layers, per-layer inputs (vocab 99, width 16), the MoE block (moe_intermediate 16, top-2),
  `global_head_dim = head_dim`, bidirectional attention "vision". The rest are
  `CausalLMModelTester`'s defaults (huggingface/transformers/tests/causal_lm_tester.py:77-159 at commit
  00d3cdbeaab26587a543f75df7997a53a6fb146b: vocab 99, hidden 32, 2 heads, 2 KV heads, intermediate
  37, max positions 512, initializer range 0.02, pad/bos/eos 0/1/2, 8 experts), passed to the config
  when its `__init__` names them (`get_config`, same file :184-189). transformers 5.24's
  `Gemma4TextConfig.__init__` has no `global_head_dim`: it is dropped, so full layers keep the
  class default (head_dim 512) with the class's unit q/k norms.
- `Gemma4UnifiedTextModelTester` (huggingface/transformers/tests/models/gemma4_unified/test_modeling_gemma4_unified.py:71-90
  at commit 043bb8dde14aae1a56b84cd230737cf5d0877912): the same 4-layer pattern and 2 KV-shared
  layers, no MoE, no per-layer inputs.
- Per-test edits: `test_use_cache_false_with_kv_sharing` (test_modeling_gemma4.py, the stored
  version with that test) sets `attention_k_eq_v = True` and
  `num_global_key_value_heads = num_key_value_heads` (k=v full layers).
- A sliding window of 2 is this project's edit, not upstream's: none of the Gemma-4 testers or
  their per-test edits sets `sliding_window` (the files above, read whole); issue 45 names it as
  the smallest window that still masks, so it stays, labelled as ours.

TP 2: where a size does not split over 2 ranks (intermediate 37, vocabularies of 99), the smallest
change that does (38, 100) is made; nothing else changes.
"""

from __future__ import annotations

import functools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.census.ports import Run, prompt_of

_ROOT = Path(tempfile.mkdtemp(prefix="census-upstream-"))
SLIDING, FULL = "sliding_attention", "full_attention"

# CausalLMModelTester's defaults that the Gemma-4 configs' __init__ names (huggingface/transformers/tests/causal_lm_tester.py)
CAUSAL_LM_TESTER = {"vocab_size": 99, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
                    "intermediate_size": 37, "max_position_embeddings": 512, "initializer_range": 0.02,
                    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "head_dim": 32 // 2}
# Gemma4TextModelTester.__init__ (test_modeling_gemma4.py:64-86)
GEMMA4_TEXT = {**CAUSAL_LM_TESTER, "num_hidden_layers": 4, "num_kv_shared_layers": 2,
               "layer_types": [SLIDING, FULL, SLIDING, FULL], "vocab_size_per_layer_input": 99,
               "hidden_size_per_layer_input": 16, "enable_moe_block": True, "moe_intermediate_size": 16,
               "top_k_experts": 2, "num_experts": 8, "use_bidirectional_attention": "vision"}
# Gemma4UnifiedTextModelTester.__init__ (test_modeling_gemma4_unified.py:77-90)
UNIFIED_TEXT = {**CAUSAL_LM_TESTER, "num_hidden_layers": 4, "num_kv_shared_layers": 2,
                "layer_types": [SLIDING, FULL, SLIDING, FULL], "use_bidirectional_attention": "vision"}
# test_use_cache_false_with_kv_sharing's edit: full layers with k = v
K_EQ_V = {"attention_k_eq_v": True, "num_global_key_value_heads": 2}
WINDOW_2 = {"sliding_window": 2}
# Gemma4Vision2TextModelTester (test_modeling_gemma4.py, its __init__ defaults and get_config)
VISION_TOWERS = {"vision_config": {"use_labels": True, "image_size": 20, "patch_size": 5, "num_channels": 3,
                                   "is_training": True, "hidden_size": 32, "num_key_value_heads": 1,
                                   "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 37,
                                   "dropout": 0.1, "attention_dropout": 0.1, "initializer_range": 0.02},
                 "image_token_id": 4, "video_token_id": 7, "audio_token_id": 8, "boi_token_id": 5, "eoi_token_id": 6,
                 "mm_tokens_per_image": 2}
# Gemma4Audio2TextModelTester (the same file): no vision tower, the text tester without bidirectional attention
AUDIO_TOWERS = {"vision_config": None,
                "audio_config": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "hidden_act": "silu", "subsampling_conv_channels": [16, 8], "conv_kernel_size": 3,
                                 "attention_chunk_size": 4, "attention_context_left": 5, "attention_context_right": 0,
                                 "output_proj_dims": 32, "use_clipped_linears": False},
                "image_token_id": 4, "boi_token_id": 5, "eoi_token_id": 6, "audio_token_id": 7, "boa_token_id": 8,
                "eoa_token_index": 9, "video_token_id": 10}
AUDIO_TEXT = {**GEMMA4_TEXT, "use_bidirectional_attention": None}
# the smallest change that lets every size split over 2 ranks
SPLIT_2 = {"intermediate_size": 38, "vocab_size": 100, "vocab_size_per_layer_input": 100}

CLASSES = {"gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
           "gemma4_unified": ("Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM")}


@dataclass(frozen=True)
class Upstream:
    """One tester configuration: its model type, its config (canonical JSON), a seed."""

    name: str
    model_type: str
    blob: str
    seed: int = 0

    @property
    def config(self) -> dict:
        return json.loads(self.blob)

    @property
    def text(self) -> dict:
        return self.config.get("text_config", self.config)


def _split(config: dict, tp: int) -> dict:
    """At TP 2, the smallest change that lets every size split (only the keys the config has)."""
    return {**config, **{k: v for k, v in SPLIT_2.items() if k in config}} if tp == 2 else dict(config)


def upstream(name: str, model_type: str, base: dict, *edits: dict, seed: int = 0, tp: int = 1) -> Upstream:
    """A text tester configuration with the suite's edits, and at TP 2 the smallest change that splits."""
    config = dict(base)
    for edit in edits:
        config.update(edit)
    return Upstream(name, model_type, json.dumps(_split(config, tp), sort_keys=True), seed)


def multimodal(name: str, text: dict, towers: dict, seed: int = 0, tp: int = 1) -> Upstream:
    """A Vision2Text / Audio2Text tester: Gemma4Config(text_config=..., towers and token ids), as its
    get_config builds it, saved the way published checkpoints are (the conditional-generation class)."""
    from transformers import Gemma4Config

    config = Gemma4Config(text_config=_split(text, tp), **towers).to_dict()
    return Upstream(name, "gemma4", json.dumps(config, sort_keys=True, default=str), seed)


@functools.lru_cache(maxsize=None)
def checkpoint(case: Upstream):
    """The configuration's checkpoint, initialised by the class's own init at the case's seed."""
    import transformers

    from harness.inputs.checkpoint import Checkpoint

    if case.model_type == "trained":  # tests/census/trained.py: trained once, then cached
        from tests.census.trained import trained_checkpoint

        return Checkpoint.open(trained_checkpoint())
    out = _ROOT / f"{case.name}-{abs(hash(case.blob)) % 10**8}-{case.seed}"
    if case.model_type == "gemma4":  # towers: the conditional-generation class, as published
        from harness.inputs.tiny import build_checkpoint

        return Checkpoint.open(build_checkpoint(out, case.config, seed=case.seed, weights="init"))
    config_cls, model_cls = CLASSES[case.model_type]
    torch.manual_seed(case.seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**case.config))
    model.save_pretrained(out)
    return Checkpoint.open(out)


@functools.lru_cache(maxsize=None)
def references(case: Upstream, prompts: tuple, new_tokens: int):
    from harness.parity.local import intra_op_threads_for
    from harness.reference.run import run_reference

    ckpt = checkpoint(case)
    with intra_op_threads_for(ckpt.spec):
        return run_reference(ckpt.path, [list(p) for p in prompts], new_tokens)


def run_check(case: Upstream, run: Run, local: bool = False):
    """`check` (both stages) of the bf16 port of the case at the run's settings."""
    from harness.backends import build_engine
    from harness.base.settings import RunSettings
    from harness.parity.check import check_port

    ckpt = checkpoint(case)
    refs = references(case, run.prompts, run.new_tokens)
    settings = RunSettings(tp=run.tp, buckets=run.buckets, kv_len=run.kv_len, sliding_cache=run.sliding_cache)
    engine = build_engine(ckpt, settings, capture=True)
    return check_port(ckpt, engine, refs["float32"], refs["bfloat16"], local=local or run.local,
                      fp32_engine="auto" if run.fp32_stage else None)


def prompts(vocab: int) -> tuple:
    """Prompts of 40 and 5 tokens (past a window of 2) inside the tester's vocabulary, clear of its
    special and multimodal placeholder ids (0-10: pad, bos, eos, image, video, audio and their
    delimiters)."""
    return tuple(tuple(t if t > 10 else t + 11 for t in prompt_of(n, vocab=vocab)) for n in (40, 5))


@dataclass(frozen=True)
class UpstreamCase:
    id: str
    case: Upstream
    run: Run
    fast: bool = False


def _cases() -> list[UpstreamCase]:
    out = []
    for tp in (1, 2):
        for seed in (0, 1, 2):
            c = upstream("gemma4-text", "gemma4_text", GEMMA4_TEXT, seed=seed, tp=tp)
            out.append(UpstreamCase(f"gemma4-text-seed{seed}-tp{tp}", c, Run(prompts(c.text["vocab_size"]), 8, tp=tp)))
        for name, edit in (("k-eq-v", K_EQ_V), ("window2", WINDOW_2)):
            c = upstream(f"gemma4-text-{name}", "gemma4_text", GEMMA4_TEXT, edit, seed=0, tp=tp)
            out.append(UpstreamCase(f"gemma4-text-{name}-seed0-tp{tp}", c, Run(prompts(c.text["vocab_size"]), 8, tp=tp)))
        for seed in (0, 1):
            c = upstream("gemma4-unified-text", "gemma4_unified", UNIFIED_TEXT, seed=seed, tp=tp)
            out.append(UpstreamCase(f"gemma4-unified-text-seed{seed}-tp{tp}", c,
                                    Run(prompts(c.text["vocab_size"]), 8, tp=tp)))
        for name, text, towers in (("vision", GEMMA4_TEXT, VISION_TOWERS), ("audio", AUDIO_TEXT, AUDIO_TOWERS)):
            c = multimodal(f"gemma4-{name}2text", text, towers, seed=0, tp=tp)
            out.append(UpstreamCase(f"gemma4-{name}2text-seed0-tp{tp}", c, Run(prompts(c.text["vocab_size"]), 8, tp=tp)))
    # the trained member: peaked distributions and sharp attention (tests/census/trained.py)
    from tests.census import trained

    for tp in (1, 2):
        c = Upstream("trained", "trained", json.dumps(trained.RECIPE, sort_keys=True))
        out.append(UpstreamCase(f"trained-stdlib-bytes-tp{tp}", c, Run(trained.prompts(), 8, tp=tp)))
    # the default lane's sample: the MoE + per-layer-input + KV-sharing tester at TP 2, short prompts
    c = upstream("gemma4-text", "gemma4_text", GEMMA4_TEXT, seed=0, tp=2)
    out.append(UpstreamCase("gemma4-text-seed0-tp2-short", c,
                            Run(tuple(p[:n] for p, n in zip(prompts(100), (8, 3))), 4, tp=2), fast=True))
    return out


UPSTREAM_CASES = _cases()
