"""Teacher-forcing the reference along another run's path, beyond its tokens: forward hooks on
transformers' own modules that make MoE routers choose given experts and PLE layers take given
gated per-layer inputs at given positions. Where bf16 legitimately decides a discrete or
ill-conditioned step differently (a near-tied router choice; the direction of a gated per-layer
input near zero, which the layer's post-norm scales up to full size), the references are computed
again on the port's choices so every point compares along the same path (harness/judge/routing.py
judges the choices; harness/parity/observe.py decides what to force).

Like harness/reference/run.py this imports nothing of the port (tests/unit/test_layering.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def chosen_experts(weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """[rows, experts] weights, zero off the chosen ones -> [rows, top_k] chosen ids, ascending."""
    return weights.abs().topk(top_k, dim=-1).indices.sort(dim=-1).values


def rows_by_position(captures: dict, name: str) -> torch.Tensor | None:
    """A layer point's rows at every position a run computed: the prefill rows, then each decode
    step's (`decode.<name>`), or None when the run has no such point."""
    rows = captures.get(name)
    if rows is None:
        return None
    steps = captures.get("decode." + name)
    return rows.float() if steps is None else torch.cat([rows.float(), steps.float()])


def follow_routes(captures: dict, top_k: int) -> "Forced":
    """The one routing-forcing rule: a run's routes read from its captures, for a reference run to
    follow: per MoE layer, the experts it chose ([positions, top_k] ids, ascending) from its
    `layers.<i>.expert_weights` point (the chosen experts' weights, zero elsewhere), the prefill
    rows then each decode step's (`decode.layers.<i>.expert_weights`). observe (the references
    along the port's path, harness/parity/forced_path.py), the local verdicts (a layer alone) and
    quality (harness/quality/moe.py) force with it, as the reference's own fp32 run forces its
    float64 and bf16 runs (`routes_of`)."""
    return Forced(routes={int(name.split(".")[1]): chosen_experts(rows_by_position(captures, name), top_k)
                          for name in captures if name.startswith("layers.") and name.endswith(".expert_weights")})


def routes_of(result, top_k: int) -> dict[int, torch.Tensor]:
    """{layer: [positions, top_k] expert ids, ascending} a reference run chose (follow_routes)."""
    return follow_routes(result.captures, top_k).routes


@dataclass
class Forced:
    """What one prompt's reference run is forced to: per MoE layer its experts at every position
    ([positions, top_k]), per PLE layer the gated per-layer input at some positions."""

    routes: dict[int, torch.Tensor] = field(default_factory=dict)
    inputs: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.routes) or any(self.inputs.values())

    def hooks(self, layers: dict) -> list:
        """The forward hooks on {index: decoder layer}, to be removed after the run."""
        return force_routing(layers, self.routes) + force_inputs(layers, self.inputs)


def _counter():
    return [0]


def force_routing(layers: dict, routes: dict[int, torch.Tensor]) -> list:
    """Forward hooks that make each MoE layer's router choose `routes[index]` (one row per position,
    in the order the positions are computed). Rows where transformers' own choice is the same set
    keep its output untouched (bit for bit); elsewhere the forced experts get transformers' weights
    for them: their fp32 probabilities, renormalised over the k, times the per-expert scale."""
    handles = []
    for i, layer in layers.items():
        if getattr(layer, "router", None) is None or i not in routes:
            continue

        def hook(module, args, out, wanted=routes[i], done=_counter()):
            probs, weights, chosen = out
            n = probs.shape[0]
            if done[0] + n > wanted.shape[0]:
                raise ValueError(f"forced routing holds {wanted.shape[0]} positions; the run computes more")
            want = wanted[done[0]:done[0] + n].to(chosen.device)
            done[0] += n
            same = (chosen.sort(dim=-1).values == want).all(-1, keepdim=True)
            picked = probs.gather(-1, want)
            picked, order = picked.sort(dim=-1, descending=True)  # topk's order
            want = want.gather(-1, order)
            forced = picked / picked.sum(dim=-1, keepdim=True) * module.per_expert_scale[want]
            return probs, torch.where(same, weights, forced.to(weights.dtype)), torch.where(same, chosen, want)

        handles.append(layer.router.register_forward_hook(hook, prepend=True))  # before any recorder
    return handles


def force_inputs(layers: dict, inputs: dict[int, dict[int, torch.Tensor]]) -> list:
    """Forward pre-hooks on each PLE layer's `per_layer_projection`: at the positions of
    `inputs[index]` its input (the gated per-layer input) is the given row; elsewhere untouched."""
    handles = []
    for i, layer in layers.items():
        if getattr(layer, "per_layer_projection", None) is None or not inputs.get(i):
            continue

        def hook(module, args, rows=inputs[i], done=_counter()):
            x = args[0]
            start, n = done[0], x.shape[-2]
            done[0] += n
            here = [(p - start, t) for p, t in rows.items() if start <= p < start + n]
            if not here:
                return None
            x = x.clone()
            for row, value in here:
                x[..., row, :] = value.to(x.dtype)
            return (x, *args[1:])

        handles.append(layer.per_layer_projection.register_forward_pre_hook(hook, prepend=True))
    return handles
