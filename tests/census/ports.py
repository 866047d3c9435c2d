"""Healthy ports for the census (issue 26): checkpoints of many shapes, weights and family members,
each built once per process, and `check` run on them with the prompt sets and run settings the census
names. Nothing here judges; margins.py reads the judged results."""

from __future__ import annotations

import functools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

_ROOT = Path(tempfile.mkdtemp(prefix="census-"))


@dataclass(frozen=True)
class Shape:
    """A checkpoint: `init` "default" (transformers' own initialisation) or "builder"
    (harness/inputs/tiny.py's margin-widening weights), config edits on the tiny config (or a family
    variant's), a seed."""

    name: str
    init: str = "default"
    edits: tuple = ()
    seed: int = 0
    variant: str | None = None  # a harness.inputs.tiny.TINY_FAMILY key
    # (parameter-name substring, factor): weights scaled after init, e.g. a per-layer model projection
    # made small next to its norm's eps, where a missing projection scale is large (issue 38)
    shrink: tuple = ()


@dataclass(frozen=True)
class Run:
    """A prompt set and run settings."""

    prompts: tuple  # of tuples of token ids
    new_tokens: int
    tp: int = 2
    buckets: tuple = (64,)
    kv_len: int = 96
    sliding_cache: str = "linear"
    fp32_stage: bool = True  # False: the structural stage skipped (a member too large for its fp32 port)
    local: bool = False  # the local (layer-alone) verdicts too: the distributional gate's sharp scope


def prompt_of(n: int, seed: int = 0, vocab: int = 512) -> tuple:
    gen = torch.Generator().manual_seed(1000 + seed * 7 + n)
    return tuple(int(t) for t in torch.randint(3, vocab, (n,), generator=gen))


def _config(shape: Shape) -> dict:
    from harness.inputs.tiny import TINY_CONFIG, TINY_FAMILY

    path = TINY_FAMILY[shape.variant] if shape.variant else TINY_CONFIG
    config = json.loads(Path(path).read_text())
    config.pop("architectures", None)
    config.pop("transformers_version", None)
    text = config.get("text_config", config)
    for key, value in shape.edits:
        text[key] = list(value) if isinstance(value, tuple) else value
    if "layer_types" in dict(shape.edits) and "num_hidden_layers" not in dict(shape.edits):
        text["num_hidden_layers"] = len(text["layer_types"])
    return config


@functools.lru_cache(maxsize=None)
def checkpoint(shape: Shape):
    """The shape's checkpoint, written once per process."""
    import transformers

    from harness.inputs.checkpoint import Checkpoint
    from harness.inputs.tiny import TINY_CLASSES, randomize_for_margins

    config = _config(shape)
    config_cls, model_cls = TINY_CLASSES[config.get("model_type", "gemma4_unified")]
    torch.manual_seed(shape.seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))
    if shape.init == "builder":
        randomize_for_margins(model, shape.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            for part, factor in shape.shrink:
                if part in name:
                    param.mul_(factor)
    out = _ROOT / f"{shape.name}-{shape.init}-{shape.seed}"
    model.save_pretrained(out)
    return Checkpoint.open(out)


@functools.lru_cache(maxsize=None)
def references(shape: Shape, prompts: tuple, new_tokens: int):
    from harness.parity.local import intra_op_threads_for
    from harness.reference.run import run_reference

    ckpt = checkpoint(shape)
    with intra_op_threads_for(ckpt.spec):
        return run_reference(ckpt.path, [list(p) for p in prompts], new_tokens)


def run_check(shape: Shape, run: Run, local: bool = False):
    """`check` (both stages; the local verdicts when `local`) of the bf16 port at the run's settings."""
    from harness.backends import build_engine
    from harness.base.settings import RunSettings
    from harness.parity.check import check_port

    ckpt = checkpoint(shape)
    refs = references(shape, run.prompts, run.new_tokens)
    settings = RunSettings(tp=run.tp, buckets=run.buckets, kv_len=run.kv_len, sliding_cache=run.sliding_cache)
    engine = build_engine(ckpt, settings, capture=True)
    return check_port(ckpt, engine, refs["float32"], refs["bfloat16"], local=local or run.local,
                      fp32_engine="auto" if run.fp32_stage else None)


# The healthy port issue 26 names: 6 layers, full layers with 2 KV heads, hidden 64 (default init).
ISSUE_SHAPE = Shape("issue26", "default", (("layer_types", ("sliding_attention",) * 5 + ("full_attention",)),
                                           ("num_global_key_value_heads", 2)))
