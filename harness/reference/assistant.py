"""The assistant's reference: transformers' own Gemma-4 assistant classes (never the port's code).

- `AssistantReference.captures`: the assistant fed given target states (the target's scaled
  embedding of a token, a hidden state, the target's keys and values of its store layers, a
  position), at the drafter's capture points;
- `exact_acceptance`: transformers' target and assistant run under the port's speculative rules
  (the acceptance judge's like-for-like reference);
- `assisted_acceptance`: transformers' assisted generation (its SinglePositionMultiTokenCandidate
  generator) of a target with its assistant at a fixed draft length, and the accepted draft tokens
  per verify call it achieved (from the target calls it made)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

DRAFTER = "drafter."


def _assistant_class(model_type: str):
    import transformers

    return getattr(transformers, "Gemma4UnifiedAssistantForCausalLM" if model_type == "gemma4_unified_assistant"
                   else "Gemma4AssistantForCausalLM")


def load_assistant(path, dtype: torch.dtype):
    config = json.loads((Path(path) / "config.json").read_text())
    model = _assistant_class(config["model_type"]).from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return model.eval()


def load_target(path):
    """The target through transformers' multimodal class, fp32, eager attention (as the reference runs it)."""
    import transformers

    config = json.loads((Path(path) / "config.json").read_text())
    cls = ("Gemma4UnifiedForConditionalGeneration" if config["model_type"] == "gemma4_unified"
           else "Gemma4ForConditionalGeneration")
    return getattr(transformers, cls).from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


class AssistantReference:
    def __init__(self, path, dtype: torch.dtype):
        self.model, self.dtype = load_assistant(path, dtype), dtype

    def captures(self, embeds: torch.Tensor, state: torch.Tensor, position: int,
                 shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """embeds, state [1, 1, H]; shared_kv: attention type -> (k, v) [1, kv_heads, position, d]."""
        m, found, hooks = self.model, {}, []

        def keep(name):
            def hook(module, args, out):
                found[name] = (out[0] if isinstance(out, tuple) else out).detach()
            return hook

        hooks.append(m.pre_projection.register_forward_hook(keep("pre_projection")))
        for i, layer in enumerate(m.model.layers):
            hooks.append(layer.register_forward_hook(keep(f"layers.{i}.output")))
        hooks.append(m.model.norm.register_forward_hook(keep("final_norm")))
        kv = {t: (k.to(self.dtype), v.to(self.dtype)) for t, (k, v) in shared_kv.items()}
        try:
            with torch.no_grad():
                out = m(inputs_embeds=torch.cat([embeds, state], -1).to(self.dtype),
                        position_ids=torch.tensor([[position]]), shared_kv_states=kv, use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        found["post_projection"] = out.last_hidden_state
        found["logits"] = out.logits
        if m.masked_embedding is not None:
            found["centroid_scores"] = m.masked_embedding.centroids(found["final_norm"]).detach()
            found["clusters"] = torch.topk(found["centroid_scores"], m.config.centroid_intermediate_top_k, dim=-1).indices
        return {DRAFTER + k: v.float() for k, v in found.items()}


def assisted_acceptance(target, assistant, prompt: list[int], new_tokens: int, k: int) -> tuple[list[int], float, int]:
    """(tokens, accepted draft tokens per verify, verify calls) of transformers' assisted greedy
    generation. Every target call after the prefill is one verify; each emits its accepted drafts
    plus one token of its own, so accepted = (new_tokens - 1 - verifies) / verifies."""
    assistant.generation_config.num_assistant_tokens = k
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    calls = []
    hook = target.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        with torch.no_grad():
            out = target.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, assistant_model=assistant)
    finally:
        hook.remove()
    tokens = out[0, len(prompt):].tolist()
    verifies = len(calls) - 1
    return tokens, ((len(tokens) - 1 - verifies) / verifies if verifies else 0.0), verifies


def exact_acceptance(target, assistant, prompt: list[int], new_tokens: int, k: int) -> tuple[list[int], list[int]]:
    """(tokens, accepted drafts per verify) of speculative greedy decode run with transformers' own
    target and assistant under the port's rules (harness/port/speculate.py): each round's drafts at
    the constant position p read the target's store-layer keys [0, p) exactly (no rejected key
    left in view, unlike assisted generation), each later step fed the step before's
    post-projection; the verify is the target on the whole sequence. The like-for-like acceptance
    the port's is judged against (docs/speculative.md#the-judge)."""
    embed = target.get_input_embeddings()

    def run(ids):
        return target(input_ids=torch.tensor([ids]), output_hidden_states=True, return_shared_kv_states=True,
                      use_cache=False)

    with torch.no_grad():
        out = run(prompt)
        tokens, accepted = [int(out.logits[0, -1].argmax())], []
        hidden = out.hidden_states[-1][:, -1:]
        while len(tokens) < new_tokens:
            p = len(prompt) + len(tokens) - 1  # the last token's position (not yet in the cache)
            drafts, state = [], hidden
            for _ in range(min(k, new_tokens - len(tokens) - 1)):
                logits, state = _draft(assistant, embed(torch.tensor([[drafts[-1] if drafts else tokens[-1]]])), state,
                                       p, out.shared_kv_states)
                drafts.append(int(logits[0, -1].argmax()))
            out = run(prompt + tokens + drafts)
            greedy = out.logits[0, p:p + len(drafts) + 1].argmax(-1).tolist()
            m = next((i for i, d in enumerate(drafts) if d != greedy[i]), len(drafts))
            tokens += greedy[:m + 1]
            accepted.append(m)
            hidden = out.hidden_states[-1][:, p + m:p + m + 1]
    return tokens[:new_tokens], accepted


def _draft(assistant, embeds, hidden, position: int, shared_kv):
    """One assistant call at `position` on the target's keys [0, position): (logits, post-projected state)."""
    kv = {t: (k[:, :, :position], v[:, :, :position]) for t, (k, v) in shared_kv.items()}
    out = assistant(inputs_embeds=torch.cat([embeds, hidden], dim=-1).to(assistant.dtype),
                    position_ids=torch.tensor([[position]]), shared_kv_states=kv, use_cache=False)
    return out.logits.float(), out.last_hidden_state.to(hidden.dtype)
