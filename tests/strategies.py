"""Hypothesis strategies in the port's vocabulary: attention head layouts under TP, logit vectors."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

TP_DEGREES = (1, 2, 3, 4, 6, 8)
HEAD_DIMS = (2, 4, 8)  # even: rotate-half pairs lane i with lane i + D/2
VOCAB_SIZE = 262144  # the 12B's vocabulary: argmax/softcap properties must hold at full width
BF16_MAX = float(torch.finfo(torch.bfloat16).max)


@st.composite
def head_layouts(draw, max_group: int = 4):
    """(q_heads, kv_heads, tp, head_dim) that the port can shard.

    Query heads split across ranks (q_heads % tp == 0) and group evenly onto KV heads
    (q_heads % kv_heads == 0); KV heads either shard (kv_heads % tp == 0) or are replicated
    (tp % kv_heads == 0). Replication needs each rank's query heads inside one KV group, so the
    group size is then a multiple of tp / kv_heads.
    """
    tp = draw(st.sampled_from(TP_DEGREES))
    if draw(st.booleans()):  # kv heads shard
        kv_heads = tp * draw(st.integers(1, 2))
        group = draw(st.integers(1, max_group))
    else:  # kv heads replicate: kv_heads divides tp
        kv_heads = draw(st.sampled_from([k for k in range(1, tp + 1) if tp % k == 0]))
        group = (tp // kv_heads) * draw(st.integers(1, 2))
    return kv_heads * group, kv_heads, tp, draw(st.sampled_from(HEAD_DIMS))


def any_head_counts():
    """(q_heads, kv_heads, tp) with no validity constraint, tp possibly zero or negative."""
    return st.tuples(st.integers(1, 48), st.integers(1, 16), st.integers(-2, 16))


def finite_logits(dtype: torch.dtype):
    """One finite logit representable in `dtype`, huge magnitudes included (up to dtype max)."""
    if dtype == torch.bfloat16:
        # fp32 values beyond bf16's max would round to inf when cast.
        return st.floats(-BF16_MAX, BF16_MAX, width=32)
    return st.floats(allow_nan=False, allow_infinity=False, width=32)


@st.composite
def logit_vectors(draw, dtype: torch.dtype, max_size: int = 64) -> list[float]:
    """Short logit vectors whose entries often repeat (ties) and may saturate the cap."""
    pool = draw(st.lists(finite_logits(dtype), min_size=1, max_size=4))
    entry = st.sampled_from(pool) | finite_logits(dtype)
    return draw(st.lists(entry, min_size=1, max_size=max_size))


@st.composite
def vocab_logits(draw, dtype: torch.dtype) -> torch.Tensor:
    """A vocabulary-wide [262144] logit row: a drawn background value with a few drawn values
    (ties and huge ones likely) at drawn token ids. Built with numpy fills to stay fast."""
    pool = draw(st.lists(finite_logits(dtype), min_size=1, max_size=3))
    row = np.full(VOCAB_SIZE, draw(finite_logits(dtype)), dtype=np.float32)
    token_ids = st.integers(0, VOCAB_SIZE - 1)
    for token, value in draw(st.lists(st.tuples(token_ids, st.sampled_from(pool)), max_size=8)):
        row[token] = value
    return torch.from_numpy(row).to(dtype)


# Logits a real model produces: the 12B's raw logits stay within about +-100 (the softcap of 30
# exists to tame the tail), far below fp32's saturation point (~270.3) and near bf16's (~104).
REALISTIC_LOGIT = 100.0


def realistic_logit():
    return st.floats(-REALISTIC_LOGIT, REALISTIC_LOGIT, width=32)


@st.composite
def realistic_logit_rows(draw, min_size: int = 2, max_size: int = 64) -> list[float]:
    """Logit rows in the realistic range, ties and near ties likely (repeated or adjacent values)."""
    pool = draw(st.lists(realistic_logit(), min_size=1, max_size=4))
    entry = st.sampled_from(pool) | realistic_logit()
    return draw(st.lists(entry, min_size=min_size, max_size=max_size))


def saturating_logit(threshold: float, high: float = float(torch.finfo(torch.float32).max)):
    """One logit at or beyond the point where the softcap saturates (either sign)."""
    magnitude = st.floats(threshold, high, width=32)
    return st.tuples(magnitude, st.booleans()).map(lambda t: t[0] if t[1] else -t[0])
