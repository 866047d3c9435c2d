"""transformers' own decoder layer on a checkpoint's weights, one at a time, in fp32 and bf16: what
a port layer alone is judged against (the local verdicts, harness/parity/local.py; bisect). Like
harness/reference/run.py it imports nothing of the port."""

from __future__ import annotations

from types import SimpleNamespace

import torch


class ReferenceLayers:
    """transformers' own decoder layer on this checkpoint's weights, fp32 and bf16, one at a time:
    the local envelope (bf16 vs fp32 on the same input) and the checkpoint's drift from the golden."""

    MEMO_BYTES = 256 << 20  # the layer runs kept for a later reader of the same inputs (captures)

    def __init__(self, checkpoint, memo_bytes: int = MEMO_BYTES):
        from transformers import AutoConfig

        from harness.reference.run import hf_decoder_parts

        # modeling_gemma4's classes for the family, the unified 12B's otherwise
        self.hf, self.checkpoint, self.spec = hf_decoder_parts(checkpoint.spec), checkpoint, checkpoint.spec
        self.config = AutoConfig.from_pretrained(checkpoint.path).get_text_config()
        self.config._attn_implementation = "eager"  # as the port and the reference run
        self.config._experts_implementation = "eager"
        self.rotary = self.hf.rotary(self.config)
        self.memo_bytes, self._kept = memo_bytes, []

    def layer(self, index: int, dtype: torch.dtype):
        with torch.device("meta"):
            layer = self.hf.layer(self.config, index)
        layer.load_state_dict(self.checkpoint.layer_weights(index, dtype), assign=True, strict=True)
        return layer.eval()

    def final_norm(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        norm = self.hf.norm(self.spec.hidden_size, eps=self.spec.rms_norm_eps)
        norm.weight.data = self.checkpoint.final_norm_weight(dtype)
        with torch.no_grad():
            return norm(x.to(dtype)).float()

    def router_logits(self, index: int, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """transformers' own router of MoE layer `index` alone on x [n, hidden] (the residual after
        attention, what the layer feeds it), in `dtype`: its expert scores [n, experts] fp32."""
        from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRouter

        with torch.device("meta"):
            router = Gemma4TextRouter(self.config)
        router.load_state_dict({k: self.checkpoint.get(self.checkpoint.layer_key(index, "router." + k), dtype)
                                for k in router.state_dict()}, assign=True, strict=True)
        found: dict = {}
        hooks = _router_hooks(SimpleNamespace(router=router), found)
        try:
            with torch.no_grad():
                router(x.to(dtype))
        finally:
            for h in hooks:
                h.remove()
        return found["router_logits"]

    def head_logits(self, x: torch.Tensor, dtype: torch.dtype, chunk: int = 1 << 16,
                    weight: torch.Tensor | None = None) -> torch.Tensor:
        """transformers' head alone (its final norm, then lm_head) on the last layer's output x
        [n, hidden], in `dtype`: raw logits [n, vocab] fp32. lm_head is applied in vocabulary
        chunks of the stored weight (each logit is one whole dot product, as nn.Linear computes it),
        so a 262144-word head never sits in fp32 at once. `weight`: the stored lm_head, if already read."""
        h = self.final_norm(x, dtype).to(dtype)
        weight = self.checkpoint.lm_head_weight() if weight is None else weight
        with torch.no_grad():
            return torch.cat([torch.nn.functional.linear(h, w.to(dtype)).float() for w in weight.split(chunk)], -1)

    def captures(self, layer, index: int, x: torch.Tensor, dtype: torch.dtype,
                 routes: torch.Tensor | None = None, per_layer_input: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The layer's capture points on x [n, hidden]; on an MoE layer with `routes` [n, k], its
        router forced to those experts (harness.reference.run.force_routing); on a layer with a
        per-layer input, `per_layer_input` [n, width] fed to it. A run on the very same input tensor
        (routes and per-layer input equal) is computed once while the runs kept fit `memo_bytes`: the
        local verdicts' runs serve the bit-exact stage, which reads the same references' inputs."""
        for kept_x, kept_routes, kept_ple, key, out in self._kept:
            if (key == (index, dtype) and kept_x is x and _same(kept_routes, routes)
                    and _same(kept_ple, per_layer_input)):
                return dict(out)
        out = self._run(layer, index, x, dtype, routes=routes, per_layer_input=per_layer_input)
        size = sum(v.numel() * v.element_size() for v in out.values())
        if size <= self.memo_bytes:  # kept with its input: the input cannot be freed and its id reused
            self.memo_bytes -= size
            self._kept.append((x, routes, per_layer_input, (index, dtype), out))
        return dict(out)

    def release(self) -> None:
        """Forget the runs kept (a later reader of the same inputs runs them again)."""
        self._kept.clear()

    def _run(self, layer, index: int, x: torch.Tensor, dtype: torch.dtype, routes, per_layer_input) -> dict:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        from harness.reference.forcing import force_routing

        layer_type = self.spec.layers[index].type
        x = x.to(dtype)[None]
        positions = torch.arange(x.shape[1])[None]
        make_mask = create_sliding_window_causal_mask if layer_type == "sliding_attention" else create_causal_mask
        mask = make_mask(config=self.config, inputs_embeds=x, attention_mask=None, cache=None,
                         position_ids=positions)
        prefix, found = f"layers.{index}.", {}

        def attn_hook(module, args, out):
            found["attn"] = x + out

        def mlp_hook(module, args, out):
            found["mlp"] = found["attn"] + out

        hooks = [layer.post_attention_layernorm.register_forward_hook(attn_hook),
                 layer.post_feedforward_layernorm.register_forward_hook(mlp_hook)] + _router_hooks(layer, found)
        hooks += force_routing({index: layer}, {index: routes}) if routes is not None else []
        try:
            with torch.no_grad():
                extra = {} if per_layer_input is None else {"per_layer_input": per_layer_input.to(dtype)[None]}
                out = layer(x, position_embeddings=self.rotary(x, positions, layer_type), attention_mask=mask,
                            position_ids=positions, shared_kv_states={}, **extra)  # a "store" layer writes into it
        finally:
            for h in hooks:
                h.remove()
        routed = {prefix + k: found[k] for k in ("router_logits", "expert_weights") if k in found}
        return {prefix + "attn_residual": found["attn"][0].float(), prefix + "mlp_residual": found["mlp"][0].float(),
                prefix + "output": out[0].float(), **routed}


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or (a is not None and b is not None and a.shape == b.shape and torch.equal(a, b))


def _router_hooks(layer, found: dict) -> list:
    """An MoE layer's router logits and chosen experts' weights (dense over the experts, as the port
    captures them; layer_points judges them), stored in `found`; none on other layers."""
    router = getattr(layer, "router", None)
    if router is None:
        return []

    def logits_hook(module, args, out):
        found["router_logits"] = out.reshape(-1, out.shape[-1]).float()

    def weights_hook(module, args, out):
        probs, weights, chosen = out
        found["expert_weights"] = torch.zeros(probs.shape, dtype=torch.float32).scatter(
            -1, chosen, weights.float()).reshape(-1, probs.shape[-1])

    return [router.proj.register_forward_hook(logits_hook), router.register_forward_hook(weights_hook)]
