"""What transformers computes, recorded as it runs (the capture points of harness/reference/run.py's
docstring): forward hooks on its decoder layers and a wrapper around its KV cache's writes."""

from __future__ import annotations

import torch

class Recorder:
    """Forward hooks on the decoder that record the capture points (cloned: the layer scales its
    output in place after the residual add)."""

    def __init__(self):
        self.captures: dict[str, torch.Tensor] = {}
        self.handles = []
        self.enabled = True
        self._inputs: dict[int, torch.Tensor] = {}

    @classmethod
    def on_model(cls, lm) -> "Recorder":
        """Every capture point of a whole text model."""
        rec = cls()
        rec.handles.append(lm.layers[0].register_forward_pre_hook(rec._embeddings))
        for i, layer in enumerate(lm.layers):
            rec.handles.append(layer.register_forward_pre_hook(rec._layer_input(i)))
            rec._hook_residuals(layer, i)
            rec.handles.append(layer.register_forward_hook(rec._output(i)))
        rec.handles.append(lm.norm.register_forward_hook(rec._store("final_norm")))
        return rec

    @classmethod
    def on_layer(cls, layer, index: int, layer_input: torch.Tensor) -> "Recorder":
        """The two inner residual points of one decoder layer run alone on `layer_input`."""
        rec = cls()
        rec._inputs[index] = layer_input.clone()
        rec._hook_residuals(layer, index)
        return rec

    def _hook_residuals(self, layer, i):
        self.handles.append(layer.post_attention_layernorm.register_forward_hook(self._attn(i)))
        self.handles.append(layer.post_feedforward_layernorm.register_forward_hook(self._mlp(i)))
        self._hook_family(layer, i)

    def _hook_family(self, layer, i):
        """modeling_gemma4's extra parts: the router's logits and chosen weights (MoE), and the
        per-layer input after its gate (the input of per_layer_projection)."""
        prefix = f"layers.{i}."
        if getattr(layer, "router", None) is not None:
            self.handles.append(layer.router.proj.register_forward_hook(self._store(prefix + "router_logits", True)))
            self.handles.append(layer.router.register_forward_hook(self._expert_weights(prefix + "expert_weights")))
        if getattr(layer, "per_layer_projection", None) is not None:
            self.handles.append(layer.per_layer_projection.register_forward_pre_hook(
                lambda module, args: self._put(prefix + "per_layer_input", args[0])))

    def _expert_weights(self, name):
        def hook(module, args, out):
            probs, weights, chosen = out
            dense = torch.zeros(probs.shape, dtype=torch.float32).scatter(-1, chosen, weights.float())
            self._put(name, dense[None])
        return hook

    def _put(self, name, tensor):
        if self.enabled:
            self.captures[name] = tensor.detach().clone()

    def _embeddings(self, module, args, kwargs=None):
        self._put("embeddings", args[0])

    def _layer_input(self, i):
        def hook(module, args):
            self._inputs[i] = args[0].detach().clone()
        return hook

    def _attn(self, i):
        def hook(module, args, out):
            self._attn_res = self._inputs[i] + out
            self._put(f"layers.{i}.attn_residual", self._attn_res)
        return hook

    def _mlp(self, i):
        def hook(module, args, out):
            self._put(f"layers.{i}.mlp_residual", self._attn_res + out)
        return hook

    def _output(self, i):
        def hook(module, args, out):
            self._put(f"layers.{i}.output", out[0] if isinstance(out, tuple) else out)
        return hook

    def _store(self, name, batch_flat: bool = False):
        def hook(module, args, out):
            self._put(name, out[None] if batch_flat else out)  # the router runs on [tokens, hidden]
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def record_cache_writes(cache, writes: dict[int, list]) -> None:
    """Record every (key, value) transformers writes into `cache`, per layer, as it stores them."""
    update = cache.update

    def recording(key_states, value_states, layer_idx, *args, **kwargs):
        writes.setdefault(layer_idx, []).append((key_states.detach().clone(), value_states.detach().clone()))
        return update(key_states, value_states, layer_idx, *args, **kwargs)

    cache.update = recording


def kv_rows(writes: dict[int, list]) -> dict[str, torch.Tensor]:
    """kv.{i}.k / kv.{i}.v: [positions, kv_heads * head_dim] fp32, positions in write order."""
    out = {}
    for i, parts in sorted(writes.items()):
        for j, side in enumerate("kv"):
            t = torch.cat([p[j] for p in parts], dim=2)[0]  # [kv_heads, positions, head_dim]
            out[f"kv.{i}.{side}"] = t.transpose(0, 1).reshape(t.shape[1], -1).float()
    return out
