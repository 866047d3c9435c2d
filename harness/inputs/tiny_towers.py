"""Tiny family checkpoints saved the way the published ones are: Gemma4ForConditionalGeneration
with a vision tower (31B, 26B-A4B) or vision and audio towers (E2B, E4B) beside the text decoder.
The text decoders are the tiny family variants' (harness/inputs/tiny.py TINY_FAMILY); the towers are
small versions of the published configs (fixtures/configs/gemma-4-e2b-it.json and its siblings: the same switches,
tiny widths). The port never runs the towers; these fixtures exist so every command meets them."""

from __future__ import annotations

from pathlib import Path

from harness.base.errors import CheckpointError, read_json_file
from harness.inputs.tiny import TINY_FAMILY, cached_checkpoint

# The published vision towers' switches per variant (E2B/E4B clip their linears, 31B/26B-A4B
# standardize), at tiny widths; every tensor of the real tower's modules is present.
_VISION = {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8, "global_head_dim": 8,
           "patch_size": 4, "pooling_kernel_size": 3, "position_embedding_size": 64,
           "rope_parameters": {"rope_theta": 100.0, "rope_type": "axial"}}
_AUDIO = {"model_type": "gemma4_audio", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "hidden_act": "silu", "subsampling_conv_channels": [16, 8], "conv_kernel_size": 3,
          "attention_chunk_size": 4, "attention_context_left": 5, "attention_context_right": 0,
          "output_proj_dims": 32, "use_clipped_linears": True}
TOWERS = {"31b": ("vision",), "26b-a4b": ("vision",), "e2b": ("vision", "audio"), "e4b": ("vision", "audio")}


def tower_config(variant: str) -> dict:
    """The tiny family variant's config.json content with the towers its published checkpoint has."""
    config = read_json_file(TINY_FAMILY[variant], "config", CheckpointError, "reinstall the fixtures")
    clipped = "audio" in TOWERS[variant]  # E2B/E4B: clipped linears, no standardization
    config["vision_config"] = dict(_VISION, use_clipped_linears=clipped, standardize=not clipped)
    config["audio_config"] = dict(_AUDIO) if "audio" in TOWERS[variant] else None
    return config


def tiny_tower_checkpoint(variant: str, seed: int = 0) -> Path:
    """The cached tiny `variant` checkpoint with its towers (built on first use)."""
    return cached_checkpoint(tower_config(variant), seed, name=f"tiny-{variant}-towers")
