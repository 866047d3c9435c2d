"""--kv-len against the memory that must hold its KV cache: one inf2 chip's HBM beside the weights
and the graphs (the memory plan, harness/plan/memory.py), and this host's memory when the cache is
allocated here (the cpu and xla backends). Each refusal is bad input with the numbers and the
longest KV length that fits.
"""

from __future__ import annotations

import os

from harness.base.errors import HarnessInputError
from harness.plan.memory import instance_memory_plan, refuse_unfit_kv_len
from harness.port.sharding import kv_cache_bytes


def refuse_kv_over_host(spec, kv_len: int, sliding_cache: str) -> None:
    """The KV cache's least size (one copy, bf16) against this host's memory: a KV length no
    allocation can satisfy is refused with the numbers, not left to fail in the allocator."""
    cost = kv_cache_bytes(spec, 1, "bfloat16", sliding_cache)
    per_token, fixed = cost["per_token"], cost.get("ring", 0)
    try:
        host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    if per_token and per_token * kv_len + fixed > host:
        longest = max((host - fixed) // per_token, 0)
        raise HarnessInputError(
            f"--kv-len {kv_len}: the KV cache alone needs at least {per_token} B/token x {kv_len}"
            f"{f' + {fixed} B of rings' if fixed else ''} = {(per_token * kv_len + fixed) / 2**30:.1f} GiB, "
            f"more than this host's {host / 2**30:.1f} GiB of memory; use --kv-len {longest} or less "
            "(the default is 256)")


def refuse_kv_over_chip(spec, tp: int, dtype: str, kv_len: int, sliding_cache: str = "linear") -> None:
    """--kv-len must fit one inf2 chip next to the weights (the memory plan)."""
    refuse_unfit_kv_len(instance_memory_plan(spec, tp, dtype, kv_len), sliding_cache)


__all__ = ["refuse_kv_over_chip", "refuse_kv_over_host"]
