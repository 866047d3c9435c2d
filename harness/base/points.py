"""The names of the capture points, one type for all of them.

A point is where the port's value is compared with the reference's: the embeddings, each decoder
layer's attention residual, MLP residual and output, its KV cache (keys, values), the final norm,
the raw logits and the host's probabilities, in prefill or at the teacher-forced decode steps. The
names are the strings goldens and JSON results carry ("layers.3.attn_residual", "decode.kv.2.v",
"decode_logits"); `Point.parse` reads them back, so no other module builds or splits them.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYER_PARTS = ("attn_residual", "mlp_residual", "output")
# The Gemma-4 family's extra layer points (harness/port/blocks.py; captured, parsed, named by part).
FAMILY_PARTS = {"router_logits": "moe router", "expert_weights": "moe router", "per_layer_input": "per-layer input"}
KV_PARTS = ("k", "v")
# Points that are not per layer; logits and probabilities of decode are "decode_<kind>".
EDGE_KINDS = ("embeddings", "final_norm", "logits", "probabilities")


@dataclass(frozen=True)
class Point:
    kind: str  # embeddings | layer | kv | final_norm | logits | probabilities
    layer: int | None = None
    part: str | None = None  # layer: one of LAYER_PARTS; kv: "k" or "v"
    decode: bool = False  # a teacher-forced decode step (kv: the cache after the steps)

    @property
    def name(self) -> str:
        if self.kind == "layer":
            base = f"layers.{self.layer}.{self.part}"
        elif self.kind == "kv":
            base = f"kv.{self.layer}.{self.part}"
        else:
            base = self.kind
        if not self.decode:
            return base
        return f"decode_{base}" if self.kind in ("logits", "probabilities") else f"decode.{base}"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, name: str) -> "Point":
        decode = name.startswith(("decode.", "decode_"))
        base = name[len("decode."):] if decode else name
        parts = base.split(".")
        if parts[0] in ("layers", "kv") and len(parts) == 3:
            kind = "layer" if parts[0] == "layers" else "kv"
            if parts[2] not in (LAYER_PARTS + tuple(FAMILY_PARTS) if kind == "layer" else KV_PARTS):
                raise ValueError(f"unknown capture point {name!r}")
            return cls(kind, int(parts[1]), parts[2], decode)
        if base in EDGE_KINDS:
            return cls(base, decode=decode)
        raise ValueError(f"unknown capture point {name!r}")

    @property
    def in_layer(self) -> bool:
        return self.kind in ("layer", "kv")

    @property
    def component(self) -> str | None:
        """Which part of its layer a failure here names: the KV cache is written inside the
        attention, so it and the attention residual are "attention"; the MLP residual and the scaled
        output are "mlp" (when the attention residual of the same layer was fine)."""
        if self.kind == "kv" or self.part == "attn_residual":
            return "attention"
        if self.part in FAMILY_PARTS:
            return FAMILY_PARTS[self.part]
        return "mlp" if self.kind == "layer" else None

    @property
    def rows(self) -> str:
        """The row layout of the point (points with one layout share row labels): prefill positions,
        decode steps after the first ("decode"), every decode step ("steps") or cache slots after
        each step ("decode_kv")."""
        if not self.decode:
            return "prefill"
        if self.kind == "kv":
            return "decode_kv"
        return "steps" if self.kind in ("logits", "probabilities") else "decode"


def layer_parts(spec) -> tuple[str, ...]:
    """The judged parts of each layer of `spec`, in run order: the 12B's three (attention residual,
    MLP residual, scaled output), with the router's logits and its chosen experts' weights before
    the MLP residual on MoE models, and the gated per-layer input before the output with PLE. (In
    bf16 a near-tied router choice flips legitimately: the bf16 stage teacher-forces routing,
    harness/judge/routing.py.)"""
    if spec is None:
        return LAYER_PARTS
    router = ("router_logits", "expert_weights") if getattr(spec, "moe", None) is not None else ()
    ple = ("per_layer_input",) if getattr(spec, "per_layer_input_size", None) else ()
    return ("attn_residual",) + router + ("mlp_residual",) + ple + ("output",)


def layer_points(index: int, decode: bool = False, spec=None) -> list[str]:
    """The judged points of one layer, in run order: the three residual-stream points, plus the
    family's own points when `spec` is given (a 12B spec gives the same three)."""
    return [Point("layer", index, part, decode).name for part in layer_parts(spec)]


def kv_points(index: int, decode: bool = False) -> list[str]:
    return [Point("kv", index, part, decode).name for part in KV_PARTS]


def prefill_order(spec) -> list[str]:
    """The prefill residual-stream points in run order (no cache, no logits)."""
    return ["embeddings"] + [n for layer in spec.layers for n in layer_points(layer.index, spec=spec)] + ["final_norm"]


def first_component(points) -> str | None:
    """The component a layer's failing points name (objects with .name and .passed): attention when
    any attention point fails, else the part of the first failing point in run order (mlp, or the
    family's moe router / per-layer input); None when all pass or no attention point was read out
    (a truncate read-out of the output alone cannot tell)."""
    parsed = [(Point.parse(p.name), p.passed) for p in points]
    if all(ok for _, ok in parsed) or not any(pt.component == "attention" for pt, _ in parsed):
        return None
    if not all(ok for pt, ok in parsed if pt.component == "attention"):
        return "attention"
    return next(pt.component for pt, ok in parsed if not ok)


def locate(row: int, lengths: list[int]) -> tuple[int, int]:
    """A row of rows stacked over prompts of `lengths` -> (prompt, row within it)."""
    for k, n in enumerate(lengths):
        if row < n:
            return k, row
        row -= n
    raise IndexError(f"row beyond the {sum(lengths)} stacked rows")
