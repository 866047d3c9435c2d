"""The assistant checkpoint beside its target: config validated against the target's spec
(spec_assistant), tensors read and checked by name and shape (a missing or misshapen tensor is
refused, naming it). Small next to the target (the 12B's assistant is a few hundred MB), so it is
read whole."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from harness.base.errors import CheckpointError
from harness.inputs.assistant_spec import AssistantSpec, load_assistant_spec


@dataclass
class AssistantCheckpoint:
    path: Path
    spec: AssistantSpec
    weights: dict[str, torch.Tensor]

    @classmethod
    def open(cls, path, target_spec) -> "AssistantCheckpoint":
        path = Path(path)
        aspec = load_assistant_spec(path, target_spec)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors beside the assistant's config.json; pass the "
                                  "assistant checkpoint directory as saved by save_pretrained")
        from safetensors.torch import load_file

        weights: dict[str, torch.Tensor] = {}
        for file in files:
            weights.update(load_file(str(file)))
        check_shapes(weights, aspec, path)
        return cls(path, aspec, weights)

    def bytes(self, dtype_bytes: int) -> int:
        return sum(t.numel() * (8 if t.dtype == torch.long else dtype_bytes) for t in self.weights.values())


def expected_shapes(aspec: AssistantSpec) -> dict[str, tuple[int, ...]]:
    h, inter, back = aspec.hidden_size, aspec.intermediate_size, aspec.backbone_hidden_size
    shapes = {"model.norm.weight": (h,), "pre_projection.weight": (h, 2 * back),
              "post_projection.weight": (back, h), "model.embed_tokens.weight": (aspec.vocab_size, h)}
    for i, layer in enumerate(aspec.layers):
        q = layer.q_heads * layer.head_dim
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.q_norm.weight": (layer.head_dim,),
                       p + "self_attn.o_proj.weight": (h, q), p + "mlp.gate_proj.weight": (inter, h),
                       p + "mlp.up_proj.weight": (inter, h), p + "mlp.down_proj.weight": (h, inter)})
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            shapes[p + norm + ".weight"] = (h,)
    if aspec.ordered:
        shapes["masked_embedding.centroids.weight"] = (aspec.num_centroids, h)
        shapes["masked_embedding.token_ordering"] = (aspec.vocab_size,)
    return shapes


def check_shapes(weights: dict[str, torch.Tensor], aspec: AssistantSpec, path: Path) -> None:
    for name, shape in expected_shapes(aspec).items():
        if name not in weights:
            raise CheckpointError(f"{path}: assistant tensor {name} is missing; the checkpoint does not match "
                                  "its config.json (re-save it)")
        if tuple(weights[name].shape) != shape:
            raise CheckpointError(f"{path}: assistant tensor {name} has shape {tuple(weights[name].shape)}, "
                                  f"expected {shape} from its config.json")
    if aspec.ordered:
        order = weights["masked_embedding.token_ordering"].long()
        if not torch.equal(torch.sort(order).values, torch.arange(aspec.vocab_size)):
            raise CheckpointError(f"{path}: assistant tensor masked_embedding.token_ordering is not a permutation "
                                  f"of the vocabulary [0, {aspec.vocab_size}); the checkpoint is damaged")
