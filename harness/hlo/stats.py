"""Per-graph statistics of a model's device graphs at its real widths, without its weights.

For every graph of the plan (one prefill graph per bucket, the decode graph) at one rank of TP=tp,
three pieces are lowered by torch-xla on CPU from harness/port/graphs.py with uninitialised weights:
the ends (no decoder layer: final norm, the vocabulary-parallel lm_head and its all-gather), one
sliding layer plus the ends, one full layer plus the ends. A layer's figures are its piece minus the
ends; a graph's totals are ends + (sliding layers) x sliding + (full layers) x full. Every figure
is read from the lowered HLO (harness/hlo/contracts.graph_stats says how), and each piece is
also checked against the graph contracts. `gemma-parity graphs` prints the table.
"""

from __future__ import annotations

import dataclasses

import torch

from harness.base.progress import status
from harness.base.settings import RunSettings
from harness.hlo.contracts import GraphSignature, GraphStats, check_graph, graph_stats
from harness.hlo.expectation import expectation_for
from harness.port.graphs import graph_plan

PIECES = ("ends", "sliding_attention", "full_attention")
SUMMED = ("dot_flops", "weight_bytes", "constant_bytes", "state_bytes")
METHOD = {
    "dot_flops": "sum over the HLO's dot ops of 2 x output elements x contracted size (matmuls only; "
                 "elementwise, softmax and norms not counted)",
    "weight_bytes": "bytes of the entry parameters that are checkpoint weights of this rank (each read once per call)",
    "constant_bytes": "bytes of model-code buffers fed as parameters (none: rope is computed in the graph)",
    "state_bytes": "bytes of the KV-cache parameters (aliased to outputs: stay on the device)",
    "returned_bytes": "bytes of the graph's outputs not aliased to state: copied to the host per call (raw logits)",
    "ops": "entry-computation instructions by opcode, as lowered (before XLA optimisation); scaled pieces "
           "over-count what the whole graph shares between layers (one attention mask per window type, "
           "literals): on the tiny model by 7% (tests/xla/test_graph_stats.py); FLOPs, bytes and collectives "
           "scale exactly",
    "collectives": "all-reduce / all-gather instructions in the rank's graph",
    "scaling": "layer = (one-layer piece) - (ends); graph = ends + n_sliding x sliding + n_full x full",
}


def piece_spec(spec, piece: str):
    """The spec with no decoder layer ('ends') or with one layer of the given type as layer 0."""
    if piece == "ends":
        return dataclasses.replace(spec, layers=())
    layer = next(layer for layer in spec.layers if layer.type == piece)
    return dataclasses.replace(spec, layers=(dataclasses.replace(layer, index=0),))


def _lower_piece(spec, tp: int, max_len: int, graphs: dict[str, int], dtype) -> dict[str, tuple]:
    """Lower every graph of the plan for one piece: tag -> (GraphStats, violations)."""
    from harness.backends.xla_env import xla_runtime
    from harness.backends.xla_lower import build_graph_module, graph_tensors, lower_graph

    device = xla_runtime().device  # a missing torch-xla is reported before anything is allocated
    with torch.device("meta"):
        module = build_graph_module(spec, tp, max_len, dtype)
    module.to_empty(device="cpu")  # uninitialised weights: the graph's shapes, not its numbers
    tensors, roles = graph_tensors(module)
    tensors = {name: t.to(device) for name, t in tensors.items()}  # once for every graph of the piece
    out = {}
    for tag, length in graphs.items():
        lowered = lower_graph(module, tensors, roles, tag, length)
        sig = GraphSignature(lowered.params, lowered.outputs, lowered.host_transfers)
        violations = check_graph(lowered.hlo, sig, expectation_for(spec, tp, max_len, length, dtype))
        out[tag] = (graph_stats(lowered.hlo, sig), [str(v) for v in violations])
    return out


def _combine(pieces: dict[str, GraphStats], counts: dict[str, int]) -> dict:
    ends = pieces["ends"]
    total = {k: getattr(ends, k) for k in SUMMED}
    ops, collectives = dict(ends.ops), dict(ends.collectives)
    for piece, n in counts.items():
        stats = pieces[piece]
        for k in SUMMED:
            total[k] += n * (getattr(stats, k) - getattr(ends, k))
        for table, mine, base in ((ops, stats.ops, ends.ops), (collectives, stats.collectives, ends.collectives)):
            for op in set(mine) | set(base):
                table[op] = table.get(op, 0) + n * (mine.get(op, 0) - base.get(op, 0))
    total["returned_bytes"] = ends.returned_bytes  # logits only, whatever the depth
    total["ops_total"] = sum(ops.values())
    total["collectives"] = {k: v for k, v in sorted(collectives.items()) if v}
    return total


def model_graph_stats(spec, settings: RunSettings, progress: bool = False) -> dict:
    """Statistics of every graph of the plan for `spec` at the settings' TP degree (one rank), buckets,
    KV length and dtype, machine-readable."""
    tp, max_len, dtype = settings.tp, settings.kv_len, settings.torch_dtype
    graphs = graph_plan(settings.buckets, max_len)
    counts = {piece: sum(1 for layer in spec.layers if layer.type == piece) for piece in PIECES[1:]}
    per_piece = {}
    say = status("graphs", progress)
    for piece in PIECES:
        if piece != "ends" and not counts[piece]:
            continue
        say(f"lowering {piece} at tp={tp} for {sorted(graphs)}")
        per_piece[piece] = _lower_piece(piece_spec(spec, piece), tp, max_len, graphs, dtype)
    result = {"spec_hash": spec.spec_hash(), "source": spec.source, "tp": tp, "rank": 0, "kv_len": max_len,
              "dtype": str(dtype).removeprefix("torch."), "layers": counts, "method": METHOD, "graphs": {}}
    for tag, length in graphs.items():
        stats = {piece: per_piece[piece][tag][0] for piece in per_piece}
        result["graphs"][tag] = {
            "length": length,
            "total": _combine(stats, {p: n for p, n in counts.items() if n}),
            "pieces": {p: dataclasses.asdict(s) for p, s in stats.items()},
            "contract_violations": {p: per_piece[p][tag][1] for p in per_piece if per_piece[p][tag][1]},
        }
    return result
