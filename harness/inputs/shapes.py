"""The tensors a checkpoint's text decoder must hold, by name and shape: derived from the spec (what
the port loads, layer by layer and outside the layers) and from transformers' own class built on
the meta device (what the reference loads); harness/inputs/checkpoint.py checks the files against
both."""

from __future__ import annotations

from pathlib import Path

import torch

from harness.base.errors import CheckpointError
from harness.inputs.spec import TRANSFORMERS_CLASSES, LayerSpec, ModelSpec


def expected_layer_shapes(spec: ModelSpec, layer: LayerSpec) -> dict[str, tuple[int, ...]]:
    """Names (relative to the layer) and shapes of one decoder layer's tensors."""
    h, d, i = spec.hidden_size, layer.head_dim, spec.mlp_size(layer)
    shapes = {
        "self_attn.q_proj.weight": (layer.q_heads * d, h),
        "self_attn.k_proj.weight": (layer.kv_heads * d, h),
        "self_attn.o_proj.weight": (h, layer.q_heads * d),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "pre_feedforward_layernorm.weight": (h,),
        "post_feedforward_layernorm.weight": (h,),
        "layer_scalar": (1,),
    }
    if not layer.k_eq_v:
        shapes["self_attn.v_proj.weight"] = (layer.kv_heads * d, h)
    if layer.kv_source is not None:  # a KV-shared layer reads another layer's cache: no k/v of its own
        for name in ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight"):
            shapes.pop(name, None)
    shapes.update(family_layer_shapes(spec))
    return shapes


def family_layer_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The per-layer input's gate (E2B/E4B) and the MoE block (26B-A4B), as modeling_gemma4 names them."""
    h, p, shapes = spec.hidden_size, spec.per_layer_input_size, {}
    if p:
        shapes.update({"per_layer_input_gate.weight": (p, h), "per_layer_projection.weight": (h, p),
                       "post_per_layer_input_norm.weight": (h,)})
    if spec.moe is not None:
        e, mi = spec.moe.num_experts, spec.moe.intermediate_size
        shapes.update({"router.proj.weight": (e, h), "router.scale": (h,), "router.per_expert_scale": (e,),
                       "experts.gate_up_proj": (e, 2 * mi, h), "experts.down_proj": (e, h, mi),
                       "post_feedforward_layernorm_1.weight": (h,), "post_feedforward_layernorm_2.weight": (h,),
                       "pre_feedforward_layernorm_2.weight": (h,)})
    return shapes


def model_level_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Decoder tensors outside the layers (names relative to the decoder prefix)."""
    h, p = spec.hidden_size, spec.per_layer_input_size
    shapes = {"embed_tokens.weight": (spec.vocab_size, h), "norm.weight": (h,)}
    if p:
        shapes.update({"embed_tokens_per_layer.weight": (spec.per_layer_vocab_size, spec.num_layers * p),
                       "per_layer_model_projection.weight": (spec.num_layers * p, h),
                       "per_layer_projection_norm.weight": (p,)})
    return shapes


# Model-level tensors the device holds (replicated on every rank); the per-layer table stays on the host.
DEVICE_MODEL_LEVEL = ("per_layer_model_projection.weight", "per_layer_projection_norm.weight")



def transformers_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape in transformers' class for the config, built on the meta device
    (no memory, no weights read)."""
    import transformers
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers raises several types for configs it cannot read
        raise CheckpointError(f"{path / 'config.json'}: transformers cannot read it ({exc})") from None
    # The class the reference loads for this model type (a gemma4 config in a unified class has
    # none of the attributes that class reads).
    cls = getattr(transformers, TRANSFORMERS_CLASSES[config.model_type][1])
    with torch.device("meta"):
        model = cls(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}
