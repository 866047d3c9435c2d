"""Which graphs a compiled build holds and which one a call runs: the tags (prefill per bucket,
decode, verify; per KV bucket and batch bucket) with their sequence lengths, and the graph and KV
bucket a call of given length and positions takes. The traced module itself and how a call is fed
are harness/port/graphs.py's, which re-exports these for the backends."""

from __future__ import annotations

import torch

from harness.base.errors import HarnessInputError
from harness.port.device_plan import kv_buckets
from harness.port.kv_slots import check_positions

DECODE_TAG = "decode"
PREFILL_TAG = "prefill_{}"
# Speculative decoding's verify graph (settings.speculate = k > 0): the same traced forward as a
# prefill chunk, k+1 positions, every row's logits; the engine pads a short round to k+1 rows
# (padded rows at position -1) so every verify runs this one graph, and the backends pick it by
# the `verify` flag of forward, never by length (a prefill bucket of k+1 positions stays its own).
VERIFY_TAG = "verify_{}"


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
