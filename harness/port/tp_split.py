"""Which of a model's sizes a TP degree cannot split, all named at once (the rule per size is
docs/design.md#the-port's: heads split whole; KV heads shard or replicate)."""

from __future__ import annotations

from harness.inputs.spec import ModelSpec


def split_problems(spec: ModelSpec, tp: int) -> list[str]:
    """Every size of the model that tp ranks cannot split, in a fixed order: the model's sizes, then
    the query heads, the KV heads and the head grouping, each distinct count once with its layers."""
    sizes = [("intermediate_size", spec.intermediate_size), ("vocab_size", spec.vocab_size)]
    wide = sorted({layer.intermediate_size for layer in spec.layers if layer.intermediate_size})
    sizes += [("double-wide intermediate_size (KV-shared layers)", size) for size in wide]
    if spec.moe is not None:
        sizes.append(("moe_intermediate_size", spec.moe.intermediate_size))
    problems = [f"{name}={size}" for name, size in sizes if size % tp]
    def layers_with(key) -> dict:
        found: dict = {}
        for layer in spec.layers:
            found.setdefault(key(layer), []).append(layer.index)
        return found

    def where(layers: list[int]) -> str:
        return f"layer{'s' if len(layers) > 1 else ''} {_ranges(layers)}"

    problems += [f"{q} query heads ({where(layers)})" for q, layers in layers_with(lambda l: l.q_heads).items() if q % tp]
    problems += [f"{kv} KV heads ({where(layers)}; KV heads shard only when kv_heads % tp == 0 and replicate "
                 "only when tp % kv_heads == 0)" for kv, layers in layers_with(lambda l: l.kv_heads).items()
                 if kv % tp and tp % kv]
    problems += [f"{q} query heads are not a multiple of {kv} KV heads ({where(layers)})"
                 for (q, kv), layers in layers_with(lambda l: (l.q_heads, l.kv_heads)).items() if q % kv]
    return problems


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
