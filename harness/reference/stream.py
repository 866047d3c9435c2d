"""The streaming reference: prefill captures computed one decoder layer at a time from the
checkpoint with transformers' own layer classes, so peak memory stays near the embedding matrix
plus one layer (what makes a 12B golden possible on a small host). Every member of the family
streams: per-layer inputs (E2B/E4B) come from transformers' own text-model methods over the
checkpoint's per-layer table, and KV-shared layers read what their "store" layer left. Like harness/reference/run.py it
imports nothing of the port (tests/unit/test_reference_boundary.py)."""

from __future__ import annotations

import torch

from harness.base.settings import torch_dtype
from harness.reference.capture import Recorder, kv_rows, record_cache_writes
from harness.reference.run import hf_decoder_parts, transformers_capped


def stream_prefill_captures(checkpoint, prompt: list[int], dtype=torch.float32,
                            progress: bool = False) -> dict[str, torch.Tensor]:
    """Prefill captures computed layer by layer from the checkpoint with transformers' own decoder
    layer class; peak memory is about the embedding matrix plus one layer."""
    return stream_prefill_captures_many(checkpoint, [prompt], dtype, progress)[0]


def text_ids(spec, ids: torch.Tensor) -> torch.Tensor:
    """The ids transformers' multimodal wrapper hands its text model: the image, video and audio
    placeholder ids become the pad id (Gemma4Model.forward's llm_input_ids, which both the word and
    the per-layer embeddings read; the unified wrapper does the same). The reference side's one
    home for that step; the port's is its engine's embed."""
    if not spec.placeholder_token_ids:
        return ids
    return torch.where(torch.isin(ids, torch.tensor(spec.placeholder_token_ids)), spec.pad_token_id, ids)


class _StreamedPrompt:
    """One prompt's hidden state on its way through the streamed layers, and its captures. A
    [batch, n] tensor of equal-length prompts runs as one batch (the corpus-quality pass); its
    captures keep the batch dimension."""

    def __init__(self, checkpoint, config, embedding, prompt, forcing=None, per_layer=None):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        spec = checkpoint.spec
        ids = torch.as_tensor(prompt, dtype=torch.long)
        self.rows = slice(None) if ids.dim() == 2 else 0  # which rows of [batch, n, ...] are captured
        ids = ids if ids.dim() == 2 else ids[None]
        ids = text_ids(spec, ids)
        self.x = embedding(ids)
        # a PLE model's per-layer inputs [batch, n, layers, width], as transformers' text model makes them
        self.per_layer = per_layer.project_per_layer_inputs(self.x, per_layer.get_per_layer_inputs(ids, self.x)) \
            if per_layer is not None else None
        self.captures = {"embeddings": self.x[self.rows].float()}
        self.positions = torch.arange(ids.shape[1])[None]
        self.shared_kv: dict = {}  # what "store" layers leave for the "reuse" layers after them
        mask_args = dict(config=config, inputs_embeds=self.x, attention_mask=None, cache=None,
                         position_ids=self.positions)
        self.forcing, self.cache, self.writes = forcing, None, {}
        self.masks = {"full_attention": create_causal_mask(**mask_args),
                      "sliding_attention": create_sliding_window_causal_mask(**mask_args)}

    def through(self, layer, layer_spec, rotary, keep: bool = True) -> None:
        """One decoder layer; its capture points are kept only when `keep` (else only the logits)."""
        i = layer_spec.index
        recorder = Recorder.on_layer(layer, i, self.x) if keep else None
        forced = self.forcing.hooks({i: layer}) if self.forcing is not None else []
        cos_sin = rotary(self.x, self.positions, layer_spec.type)
        extra = {"cache": self.cache} if self.cache is not None else {}
        if self.per_layer is not None:
            extra["per_layer_input"] = self.per_layer[:, :, i]
        try:
            self.x = layer(self.x, position_embeddings=cos_sin, attention_mask=self.masks[layer_spec.type],
                           position_ids=self.positions, shared_kv_states=self.shared_kv, **extra)
        finally:
            for handle in forced:
                handle.remove()
        if recorder is not None:
            recorder.remove()
            self.captures.update({k: v[self.rows].float() for k, v in recorder.captures.items()})
            self.captures[f"layers.{i}.output"] = self.x[self.rows].float()

    def finish(self, norm, head: torch.Tensor, cap) -> dict[str, torch.Tensor]:
        x = norm(self.x)
        self.captures["final_norm"] = x[self.rows].float()
        logits = (x[self.rows] @ head.T).float()
        self.captures["logits"] = logits
        self.captures["capped_logits"] = transformers_capped(logits, cap)
        self.captures.update(kv_rows(self.writes))
        return self.captures


def stream_sequences(checkpoint, sequences: list[list[int]], forcing: list, progress: bool = False) -> list[dict]:
    """Every capture point of each sequence in float64, one layer at a time, with the KV rows
    transformers writes (harness/reference/float64.py); forcing[k] (a Forced or None) steers sequence k's
    MoE routers."""
    return stream_prefill_captures_many(checkpoint, sequences, torch.float64, progress, forcing=forcing, kv=True)


def stream_prefill_captures_many(checkpoint, prompts: list[list[int]], dtype=torch.float32,
                                 progress: bool = False, layer_captures: bool = True,
                                 forcing: list | None = None, kv: bool = False) -> list[dict[str, torch.Tensor]]:
    """Prefill captures of every prompt in ONE pass over the checkpoint: each decoder layer is read
    and built once and runs every prompt's hidden state before the next layer is read. Peak memory
    is about the embedding matrix plus one layer plus the prompts' activations (without
    `layer_captures`, only the embeddings, final norm and logits are kept: the corpus-quality pass).
    `forcing` (one harness.reference.forcing.Forced or None per prompt) steers the MoE routers; with
    `kv` the KV rows transformers writes are recorded too."""
    from transformers import AutoConfig

    from harness.base.progress import status

    dtype = dtype if isinstance(dtype, torch.dtype) else torch_dtype(dtype)  # float64: harness/reference/float64.py
    config = AutoConfig.from_pretrained(checkpoint.path).get_text_config()
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    spec = checkpoint.spec
    hf = hf_decoder_parts(spec)
    embed = checkpoint.embed_weight(dtype)
    embedding = _scaled_embedding(hf, embed, spec)
    per_layer = _per_layer_parts(hf, checkpoint, config, dtype)
    states = [_StreamedPrompt(checkpoint, config, embedding, prompt, forced, per_layer=per_layer)
              for prompt, forced in zip(prompts, forcing or [None] * len(prompts))]
    if kv:
        from transformers import DynamicCache

        for state in states:
            state.cache = DynamicCache(config=config)
            record_cache_writes(state.cache, state.writes)
    rotary = hf.rotary(config)
    say = status("stream", progress, total=spec.num_layers)
    with torch.no_grad():
        for layer_spec in spec.layers:
            say(f"{str(dtype).removeprefix('torch.')} layer {layer_spec.index + 1}/{spec.num_layers}, {len(prompts)} prompt(s)")
            with torch.device("meta"):
                layer = hf.layer(config, layer_spec.index)
            layer.load_state_dict(checkpoint.layer_weights(layer_spec.index, dtype), assign=True, strict=True)
            for state in states:
                state.through(layer, layer_spec, rotary, keep=layer_captures)
            del layer
        norm = hf.norm(spec.hidden_size, eps=spec.rms_norm_eps)
        norm.weight.data = checkpoint.final_norm_weight(dtype)
        head = embed if spec.tie_word_embeddings else checkpoint.lm_head_weight(dtype)
        return [state.finish(norm, head, spec.final_logit_softcapping) for state in states]


def _per_layer_parts(hf, checkpoint, config, dtype):
    """A PLE model's text model with only its per-layer-input parts holding weights (the packed
    table, the model projection and its norm; everything else on the meta device, never
    allocated): transformers' own get_per_layer_inputs and project_per_layer_inputs. None for a
    model without per-layer inputs."""
    if not checkpoint.spec.per_layer_input_size:
        return None
    with torch.device("meta"):
        model = hf.text_model(config)
    table = model.embed_tokens_per_layer
    table.weight = torch.nn.Parameter(checkpoint.per_layer_table(dtype), requires_grad=False)
    table.embed_scale = _embed_scale(table, dtype)
    prefix = checkpoint.prefix
    for name in ("per_layer_model_projection", "per_layer_projection_norm"):
        getattr(model, name).weight = torch.nn.Parameter(checkpoint.get(f"{prefix}{name}.weight", dtype),
                                                         requires_grad=False)
    return model


def _scaled_embedding(hf, weight: torch.Tensor, spec):
    """transformers' own scaled word embedding (the scale cast to the weight dtype in its forward)
    over the checkpoint's matrix, without allocating a second copy."""
    with torch.device("meta"):
        emb = hf.embedding(spec.vocab_size, spec.hidden_size, spec.pad_token_id,
                                                      embed_scale=spec.hidden_size ** 0.5)
    emb.weight = torch.nn.Parameter(weight, requires_grad=False)
    emb.embed_scale = _embed_scale(emb, weight.dtype)
    return emb


def _embed_scale(embedding, dtype: torch.dtype) -> torch.Tensor:
    """The scale buffer transformers' init puts in a scaled embedding: float32, or float64 in a
    model loaded in float64 (sqrt(width) is inexact for most widths: a float32 scale would put an
    fp32 rounding into the float64 envelope)."""
    return torch.tensor(embedding.scalar_embed_scale, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
