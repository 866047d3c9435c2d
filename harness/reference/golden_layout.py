"""What a golden's tensor file must hold, tensor by tensor: every name, shape and dtype the reference
writes (harness/reference/run.py lists the capture points), derived from the manifest (prompts, new
tokens) and the spec (widths, per-layer KV heads and head dims), and the recorded greedy tokens
against the logits that chose them.

A golden is sealed by an unkeyed hash (anyone can recompute it), so these checks are what stands
between an edited, truncated or foreign golden and a parity verdict: an unexpected, missing,
reshaped or integer tensor, or a token that is not the argmax of its own step, is bad input (exit
2), never a verdict about the port.
"""

from __future__ import annotations

import torch

from harness.base.errors import GoldenError
from harness.base.points import layer_parts

# Groups a golden may lack (a streamed golden decodes nothing; an older writer kept fewer points),
# but never hold in part.
OPTIONAL_GROUPS = ("capped_logits", "step_capped_logits", "decode", "kv")


def inconsistent(path, what: str) -> GoldenError:
    return GoldenError(f"{path}: inconsistent golden: {what}; it was not written whole by `gemma-parity "
                       "reference`: regenerate it")


def hidden_points(num_layers: int, spec=None) -> dict[str, int | None]:
    """Capture name -> width of the per-position points: the embeddings, the final norm and each
    layer's parts as harness.base.points lays them out for `spec` (the family's router and per-layer
    input points included; width None: unknown without a spec)."""
    hidden = spec.hidden_size if spec is not None else None
    widths = {"router_logits": spec.moe.num_experts, "expert_weights": spec.moe.num_experts} if getattr(
        spec, "moe", None) is not None else {}
    if getattr(spec, "per_layer_input_size", 0):
        widths["per_layer_input"] = spec.per_layer_input_size
    points = {"embeddings": hidden, "final_norm": hidden}
    for i in range(num_layers):
        points.update({f"layers.{i}.{part}": widths.get(part, hidden) for part in layer_parts(spec)})
    return points


def expected_layout(n: int, new_tokens: int, num_layers: int, spec) -> dict[str, dict[str, tuple]]:
    """Group -> {capture name: (rows, width)} of one prompt of `n` tokens (width None: unknown
    without a spec). Rows: prompt positions, decode steps, or cache positions. A KV-shared layer
    writes no cache: it has no kv points."""
    vocab = spec.vocab_size if spec is not None else None
    steps = max(new_tokens - 1, 0)  # decode steps the model runs after prefill
    points = hidden_points(num_layers, spec)
    groups = {
        "required": {**{name: (n, width) for name, width in points.items()}, "logits": (n, vocab),
                     "step_logits": (new_tokens, vocab)},
        "capped_logits": {"capped_logits": (n, vocab)},
        "step_capped_logits": {"step_capped_logits": (new_tokens, vocab)} if new_tokens else {},
        "decode": ({f"decode.{name}": (steps, width) for name, width in points.items()}
                   | {"decode.logits": (steps, vocab)}) if steps else {},
        "kv": {},
    }
    for i in range(num_layers):
        layer = spec.layers[i] if spec is not None else None
        if layer is not None and getattr(layer, "kv_source", None) is not None:
            continue
        width = layer.kv_heads * layer.head_dim if layer is not None else None
        for side in "kv":
            groups["kv"][f"kv.{i}.{side}"] = (n + steps, width)
    return groups


def check_prompt_tensors(path, tensors: dict, prefix: str, n: int, new_tokens: int, num_layers: int,
                         spec) -> tuple[set[str], frozenset[str]]:
    """The tensors of one dtype's prompt: every required one, optional groups whole or absent,
    each float32 of the expected shape. Returns the keys it accounted for and the optional
    groups it holds (every prompt of every dtype must hold the same: the judge pairs them)."""
    seen, groups = set(), set()
    for group, names in expected_layout(n, new_tokens, num_layers, spec).items():
        present = [name for name in names if prefix + name in tensors]
        if group != "required" and not present:
            continue
        groups.add(group)
        missing = [name for name in names if prefix + name not in tensors]
        if missing:
            raise inconsistent(path, f"tensor {prefix}{missing[0]} is missing")
        for name, (rows, width) in names.items():
            _check_tensor(path, prefix + name, tensors[prefix + name], rows, width)
            seen.add(prefix + name)
    return seen, frozenset(groups)


def check_same_groups(path, held: dict[str, frozenset[str]]) -> None:
    """Every prompt of every dtype holds the same optional capture groups."""
    items = sorted(held.items())
    first, groups = items[0]
    for other, theirs in items[1:]:
        if theirs != groups:
            group = sorted(groups ^ theirs)[0]
            raise inconsistent(path, f"{first} and {other} differ: only one of them holds the {group} captures")


def _check_tensor(path, key: str, t: torch.Tensor, rows: int, width: int | None) -> None:
    if t.dtype != torch.float32:
        raise inconsistent(path, f"tensor {key} is {str(t.dtype).replace('torch.', '')}, but a golden stores "
                                 "float32 (an integer or other tensor is not a reference)")
    width = t.shape[-1] if width is None and t.dim() == 2 else width
    if t.dim() != 2 or tuple(t.shape) != (rows, width):
        raise inconsistent(path, f"tensor {key} has shape {tuple(t.shape)}, expected ({rows}, {width})")


def check_no_stray_tensors(path, tensors: dict, accounted: set[str]) -> None:
    stray = sorted(set(tensors) - accounted)
    if stray:
        more = f" and {len(stray) - 1} more" if len(stray) > 1 else ""
        raise inconsistent(path, f"tensor {stray[0]}{more} is not one the reference writes for these prompts "
                                 "and this model")


def check_tokens(path, tensors: dict, prefix: str, generated: list[int], where: str) -> None:
    """Each recorded greedy token is the argmax of the logits that chose it (transformers picks
    from the capped logits; ties allowed): an edited token list is caught here, not blamed on the
    port as a token mismatch."""
    capped = tensors.get(prefix + "step_capped_logits")
    if capped is None or not generated:
        return
    for step, token in enumerate(generated):
        row = capped[step]
        if bool(row[token] < row.max()):
            raise inconsistent(path, f"{where}[{step}] = {token} is not the argmax of its step's logits "
                                     f"(token {int(row.argmax())} is)")
