"""The device graphs, defined once for every backend that lowers them (Neuron, XLA on CPU).

What a compiled backend traces: `TracedDecoder` (the per-rank `RankDecoder` with a forward of two
tensors in, a tensor or a tuple out), the graph plan (one prefill graph per bucket and the decode
graph, s=1), the example inputs each graph is traced with, the KV cache buffers that become state
aliased between calls, the constant buffers that must reach the device, and how outputs unpack.
The Neuron backend (ModelBuilder) and the XLA backend (torch-xla on the CPU PJRT device) both
import these, so the XLA lane lowers exactly what inf2 would trace. This module imports no SDK:
only `backends/neuron*.py` know Neuron, only `backends/xla*.py` know torch_xla.
"""

from __future__ import annotations

import torch
from torch import nn

from harness.base.errors import HarnessInputError
from harness.port.blocks import FamilyRankDecoder
from harness.port.device_plan import kv_buckets  # noqa: F401  (re-exported: the KV buckets, capped)
from harness.port.kv_slots import call_seq_ids, check_positions
from harness.port.kv_cache import KVCache
from harness.port.model import RankDecoder, RankLinears

# Positions enter the graph as int32, as NxD's own examples feed indices (int64 is emulated on
# Neuron); TracedDecoder widens them to int64 inside the graph, where index_copy needs them.
POSITION_DTYPE = torch.int32
DECODE_TAG = "decode"
PREFILL_TAG = "prefill_{}"
# Speculative decoding's verify graph (settings.speculate = k > 0): the same traced forward as a
# prefill chunk, k+1 positions, every row's logits; the engine pads a short round to k+1 rows
# (padded rows at position -1) so every verify runs this one graph, and the backends pick it by
# the `verify` flag of forward, never by length (a prefill bucket of k+1 positions stays its own).
VERIFY_TAG = "verify_{}"


class GraphBuildError(RuntimeError):
    """Tracing, compiling or running a device graph failed (not bad input: the compiler or the
    model code)."""


# Capture points the host takes itself: the graph's own input is never returned as a graph output
# (no NxD example returns an input under input/output aliasing); backends add it back on the host.
HOST_CAPTURES = ("embeddings",)


def release_traced(module: nn.Module) -> None:
    """Forget the tensors a call hands between layers through the modules (each cache's last read,
    which a KV-shared layer reads, and the call's seq_ids; the family's per-layer inputs): a traced
    module keeps none past its forward, so no tensor of one trace outlives it (or leaks into the
    next bucket's trace)."""
    for sub in module.modules():
        if isinstance(sub, KVCache):
            sub.last_read = sub.seq_ids = None
        if getattr(sub, "_per_layer_inputs", None) is not None:
            sub._per_layer_inputs = None


class TracedDecoder(RankDecoder):
    """RankDecoder with the forward NxD traces: tensors in, a tensor or a tuple out.

    ModelBuilder accepts only parameters without defaults (or defaulting to None), so the build
    kind is fixed at construction:
    - a parity build (`with_captures`) returns (logits [1, s, vocab], *captures) in `capture_names`
      order, recorded while tracing, without the HOST_CAPTURES;
    - a perf build with `last_row_only` takes `last_index` ([1], the last real position) and returns
      only that row's logits [1, 1, vocab]: what greedy decode needs, with lm_head and its vocab
      all-gather run on one row instead of the whole bucket;
    - otherwise all logits [1, s, vocab].
    Positions and last_index arrive as int32 and are widened here.

    The verify graph of a perf build is traced without `last_index` (example_inputs, is_verify_tag):
    it returns (logits [1, k+1, vocab], final_norm [1, k+1, hidden]): every row's logits (greedy
    acceptance reads all k+1) and the final-norm states, one of which feeds the next draft round.
    """

    def __init__(self, spec, tp: int, max_len: int, dtype: torch.dtype, linears: RankLinears,
                 with_captures: bool = False, last_row_only: bool = False, sliding_cache: str = "linear",
                 slots: int = 1):
        super().__init__(spec, tp=tp, max_len=max_len, dtype=dtype, linears=linears, sliding_cache=sliding_cache,
                         slots=slots)
        if with_captures and last_row_only:
            raise ValueError("a parity build (captures) returns every row; last_row_only is for perf builds")
        self.with_captures, self.last_row_only = with_captures, last_row_only
        self.capture_names: list[str] = []

    def forward(self, inputs_embeds, positions, last_index=None):
        try:
            return self.traced_forward(inputs_embeds, positions, last_index)
        finally:
            release_traced(self)

    def traced_forward(self, inputs_embeds, positions, last_index=None):
        positions = positions.to(torch.long)
        if self.with_captures:
            logits, captures = super().forward(inputs_embeds, positions, capture=True)
            captures = {k: v for k, v in captures.items() if k not in HOST_CAPTURES}
            self.capture_names = list(captures)
            return (logits, *captures.values())
        if not self.last_row_only:
            return super().forward(inputs_embeds, positions)
        hidden = self.final_hidden(inputs_embeds, positions)
        if last_index is None:  # a perf build's verify graph (docstring)
            return self.lm_head(hidden), hidden
        return self.lm_head(hidden.index_select(1, last_index.to(torch.long).reshape(1)))


class TracedFamilyDecoder(TracedDecoder, FamilyRankDecoder):
    """TracedDecoder over the gemma4 family's per-rank decoder (model_blocks)."""


class TracedBatchDecoder(TracedDecoder):
    """A batched build (a KV cache of `slots` sequences, harness/port/kv_slots.py): forward(inputs_embeds
    [b, s, hidden], positions [b, s], seq_ids [b], each row's KV slot, as NxD Inference passes them)
    -> what TracedDecoder returns, for every row: a parity build every row's logits and captures; a
    perf build (`last_row_only`) also takes `last_index` [b], each row's last real position, and
    returns only those rows' logits [b, 1, vocab] (lm_head on one row per sequence, as NxD Inference's
    context encoding gathers the last real row before lm_head); its verify graph, no `last_index`."""

    def forward(self, inputs_embeds, positions, seq_ids, last_index=None):
        try:
            return self.traced_batch_forward(inputs_embeds, positions, seq_ids, last_index)
        finally:
            release_traced(self)

    def traced_batch_forward(self, inputs_embeds, positions, seq_ids, last_index=None):
        positions, seq_ids = positions.to(torch.long), seq_ids.to(torch.long)
        if self.last_row_only:
            self.set_seq_ids(seq_ids)
            hidden = self.final_hidden(inputs_embeds, positions)
            if last_index is None:  # its verify graph: every row's logits and final-norm states
                return self.lm_head(hidden), hidden
            rows = last_index.to(torch.long).reshape(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
            return self.lm_head(hidden.gather(1, rows))
        if not self.with_captures:
            return super(TracedDecoder, self).forward(inputs_embeds, positions, seq_ids=seq_ids)
        logits, captures = super(TracedDecoder, self).forward(inputs_embeds, positions, capture=True, seq_ids=seq_ids)
        captures = {k: v for k, v in captures.items() if k not in HOST_CAPTURES}
        self.capture_names = list(captures)
        return (logits, *captures.values())


class TracedFamilyBatchDecoder(TracedBatchDecoder, FamilyRankDecoder):
    """TracedBatchDecoder over the gemma4 family's per-rank decoder."""


def traced_class(spec, batched: bool = False) -> type:
    """The traced module class for a spec: the 12B's decoder or the family's (batched: taking seq_ids)."""
    if batched:
        return TracedFamilyBatchDecoder if spec.uses_family_blocks else TracedBatchDecoder
    return TracedFamilyDecoder if spec.uses_family_blocks else TracedDecoder


def input_width(spec) -> int:
    """The width of the device's one input: the hidden size, plus each layer's per-layer row where
    the model has per-layer inputs (model_blocks: the host appends them)."""
    return spec.hidden_size + spec.num_layers * spec.per_layer_input_size


def kv_buffer_names(module: nn.Module) -> list[str]:
    """Names of the KV cache buffers (the device state aliased between calls)."""
    return [f"{name}.{buf}" for name, sub in module.named_modules() if isinstance(sub, KVCache)
            for buf in ("k", "v")]


def constant_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers outside the state dict that are not KV cache: values from the model code, not the
    checkpoint, that would have to reach the device. The port has none (rope frequencies are
    computed in the graph); the Neuron backend refuses any."""
    persistent = set(module.state_dict().keys())
    kv = set(kv_buffer_names(module))
    return {name: buf.detach().clone().contiguous() for name, buf in module.named_buffers()
            if name not in persistent and name not in kv}


def graph_plan(buckets, max_len: int, speculate: int = 0) -> dict[str, int]:
    """Graph tag -> sequence length: one prefill graph per bucket and the decode graph (s=1), and
    with `speculate` = k > 0 the verify graph of k+1 positions (VERIFY_TAG)."""
    try:
        sizes = sorted({int(b) for b in buckets})
    except (TypeError, ValueError) as exc:
        raise HarnessInputError(f"buckets {buckets!r}: give positive integers, e.g. (16, 64)") from exc
    if not sizes or sizes[0] < 1:
        raise HarnessInputError(f"buckets {buckets!r}: give at least one positive bucket size")
    if sizes[-1] > max_len:
        raise HarnessInputError(f"bucket {sizes[-1]} exceeds the KV length {max_len}; buckets must fit the cache")
    plan = {PREFILL_TAG.format(b): b for b in sizes if b != 1}  # a bucket of 1 is the decode graph
    plan[DECODE_TAG] = 1
    if speculate:
        if speculate + 1 > max_len:
            raise HarnessInputError(f"--speculate {speculate}: a verify of {speculate + 1} positions exceeds the KV "
                                    f"length {max_len}")
        plan[VERIFY_TAG.format(speculate + 1)] = speculate + 1
    return plan


def is_verify_tag(tag: str) -> bool:
    """A verify graph's tag (graph_plan), also with a KV-bucket or batch suffix."""
    return tag.startswith(VERIFY_TAG.split("{")[0])


def kv_read_length(positions: torch.Tensor, kv_lengths) -> int:
    """The KV bucket a call reads: the smallest that holds, in every row, its first position plus
    its real rows."""
    check_positions(positions, max(kv_lengths))  # refused here, before any backend's device call
    needed = int((positions[:, 0] + (positions >= 0).sum(dim=1)).max())
    return min(size for size in kv_lengths if size >= needed)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes graphs are compiled for (NxD Inference's batch buckets): powers of two below the
    KV slots `max_batch`, and `max_batch` itself. A call runs the smallest that holds its rows."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (max_batch,)


def batch_tag(tag: str, batch: int) -> str:
    """The tag of graph `tag` at batch bucket `batch` in a build of several KV slots (NxD Inference
    compiles its context-encoding and token-generation graphs per batch size the same way)."""
    return f"{tag}_bs{int(batch)}"


def batch_example_inputs(length: int, hidden: int, dtype: torch.dtype, batch: int, last_row: bool = False) -> tuple:
    """(inputs_embeds [b, s, hidden], positions [b, s], seq_ids [b]) a batched graph (TracedBatchDecoder)
    of `batch` rows and `length` positions is traced with: row r in slot r; with `last_row` (a
    batched perf build) also last_index [b], each row's last position."""
    embeds, positions = example_inputs(length, hidden, dtype)
    inputs = (embeds.expand(batch, -1, -1).contiguous(), positions.expand(batch, -1).contiguous(),
              torch.arange(batch, dtype=POSITION_DTYPE))
    return (*inputs, torch.full((batch,), length - 1, dtype=POSITION_DTYPE)) if last_row else inputs


def kv_graph_plan(buckets, max_len: int, speculate: int = 0) -> list[tuple[str, int, int]]:
    """(tag, sequence length, KV bucket) of every graph a build with KV buckets holds: each prefill
    bucket (and the verify graph) at each KV bucket that holds it, and decode at every KV bucket."""
    plan = graph_plan(buckets, max_len, speculate)
    return [(tag, length, kv) for tag, length in plan.items() for kv in kv_buckets(buckets, max_len) if kv >= length]
    # (device_plan.graph_shapes counts the same graphs for the fit, from the same kv_buckets)


def tag_for_length(length: int, graphs: dict[str, int], verify: bool = False) -> str:
    """The graph a call of `length` positions runs: the verify graph for a verify call, else the
    prefill bucket (or decode) of that length."""
    for tag, size in graphs.items():
        if size == length and is_verify_tag(tag) == verify:
            return tag
    if verify:
        have = sorted(s for t, s in graphs.items() if is_verify_tag(t))
        raise HarnessInputError(f"no verify graph takes {length} positions: this build has verify graphs {have} "
                                "(k+1 positions for --speculate k); build it with the run's --speculate "
                                "(RunSettings.speculate)")
    compiled = sorted(s for t, s in graphs.items() if s != 1 and not is_verify_tag(t))
    raise HarnessInputError(f"no compiled graph takes {length} positions: this build has prefill buckets "
                            f"{compiled} and decode (1). Pad the prompt to a bucket (the engine does) "
                            "or build the backend with that bucket.")


def example_inputs(length: int, hidden: int, dtype: torch.dtype, last_row: bool = False) -> tuple:
    """(inputs_embeds, positions) a graph of `length` positions is traced with, plus `last_index`
    for a perf build that returns only the last real row (`last_row`; not for a verify graph,
    which returns every row: pass last_row=perf build and not is_verify_tag(tag))."""
    inputs = (torch.zeros(1, length, hidden, dtype=dtype), torch.arange(length, dtype=POSITION_DTYPE)[None])
    return (*inputs, torch.tensor([length - 1], dtype=POSITION_DTYPE)) if last_row else inputs


def unpack_outputs(out, capture_names: list[str] | None, inputs_embeds: torch.Tensor | None = None):
    """(logits, captures) from what the compiled graph returns (a tensor, or a tuple with captures).
    A parity build's captures start with the HOST_CAPTURES, taken from `inputs_embeds` (what the
    graph was fed), in the order RankDecoder captures them."""
    if capture_names is None:
        logits = out if isinstance(out, torch.Tensor) else out[0]
        return logits, {}
    out = list(out)
    if len(out) != len(capture_names) + 1:
        raise GraphBuildError(f"the parity graph returned {len(out)} outputs, expected logits + "
                               f"{len(capture_names)} captures")
    if inputs_embeds is None:
        raise GraphBuildError("unpack_outputs needs the graph's inputs_embeds: the embeddings capture is "
                              "taken on the host, not returned by the graph")
    return out[0], {"embeddings": inputs_embeds, **dict(zip(capture_names, out[1:]))}


def graph_inputs(spec, graphs: dict[str, int], inputs_embeds: torch.Tensor, positions: torch.Tensor,
                 dtype: torch.dtype, capture: bool, parity_build: bool, last_row_only: bool,
                 last: int | None, verify: bool = False) -> tuple[str, list[torch.Tensor]]:
    """(tag, inputs) of the graph a compiled backend runs for one call, as the device is fed:
    inputs_embeds in the build's dtype, int32 positions, and on a perf build `last_index` (not for
    a verify call: the verify graph returns every row). The call is checked against the build
    first (captures only from a parity build; shapes)."""
    if capture and not parity_build:
        raise HarnessInputError("this is a perf build (no capture outputs in its graphs); build the "
                                "backend with capture=True for a parity build to capture activations")
    hidden = input_width(spec)
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[0] != 1 or inputs_embeds.shape[2] != hidden:
        raise HarnessInputError(f"inputs_embeds of shape {tuple(inputs_embeds.shape)}: expected [1, s, {hidden}]")
    length = inputs_embeds.shape[1]
    if tuple(positions.shape) != (1, length):
        raise HarnessInputError(f"positions of shape {tuple(positions.shape)}: expected [1, {length}]")
    tag = tag_for_length(length, graphs, verify)
    last_row_only = last_row_only and not verify
    if last_row_only and last is None and length > 1:
        raise HarnessInputError("this perf build returns only the last real position's logits: pass last= "
                                "(the engine does), or build with capture=True for every row")
    inputs = [inputs_embeds.to(dtype).contiguous(), positions.to(POSITION_DTYPE).contiguous()]
    if last_row_only:
        inputs.append(torch.tensor([length - 1 if last is None else int(last)], dtype=POSITION_DTYPE))
    return tag, inputs


def batch_graph_inputs(spec, graphs: dict[str, int], inputs_embeds: torch.Tensor, positions: torch.Tensor,
                       seq_ids: torch.Tensor | None, dtype: torch.dtype, slots: int,
                       last_row_only: bool = False, verify: bool = False) -> list[torch.Tensor]:
    """The inputs of a batched build's graph for one call: inputs_embeds [b, s, hidden] in the build's
    dtype, int32 positions [b, s] and seq_ids [b] (row r in slot r when None), and on a perf build
    (`last_row_only`) last_index [b], each row's last real position (0 for a padding-only row), not to a `verify` graph.
    Shapes checked, and seq_ids too: one distinct slot in [0, slots) per row (the device would clamp
    or drop an out-of-range index without a word); more rows than slots is left to the backend's
    batch-bucket check, which names the buckets."""
    hidden = input_width(spec)
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[2] != hidden:
        raise HarnessInputError(f"inputs_embeds of shape {tuple(inputs_embeds.shape)}: expected [b, s, {hidden}]")
    rows, length = inputs_embeds.shape[:2]
    if tuple(positions.shape) != (rows, length):
        raise HarnessInputError(f"positions of shape {tuple(positions.shape)}: expected [{rows}, {length}]")
    tag_for_length(length, graphs, verify)
    seq_ids = call_seq_ids(seq_ids, rows, slots)
    inputs = [inputs_embeds.to(dtype).contiguous(), positions.to(POSITION_DTYPE).contiguous(),
              seq_ids.to(POSITION_DTYPE).contiguous()]
    if last_row_only and not verify:
        inputs.append(((positions >= 0).sum(dim=1) - 1).clamp(min=0).to(POSITION_DTYPE))
    return inputs


def graph_result(out, capture_names: list[str] | None, inputs_embeds: torch.Tensor, capture: bool,
                 last_row_only: bool, last: int | None, verify: bool = False):
    """What a backend's forward returns from the graph's outputs: (logits (only row `last` when
    asked), captures (empty unless `capture`)). A verify call on a perf build returns every row's
    logits and {"final_norm": [1, k+1, hidden]} (TracedDecoder), what the speculative loop needs."""
    if verify and capture_names is None and last_row_only:
        logits, hidden = out
        return logits, {"final_norm": hidden}
    logits, captures = unpack_outputs(out, capture_names, inputs_embeds=inputs_embeds)
    if last is not None and not last_row_only:
        logits = logits[:, last:last + 1]
    return logits, (captures if capture else {})
