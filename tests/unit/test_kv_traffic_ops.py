"""The KV-traffic contract (harness/hlo/kv_traffic.py) on hand-written HLO: a reshape or bitcast of
the cache hands the same bytes on, but a `copy` or `convert` of it materialises the whole buffer
(a copy of every row, or every row in another dtype), so it counts as reading the whole cache, and
one on the way to the aliased output as rewriting it whole."""

from __future__ import annotations

import pytest

from harness.hlo.kv_traffic import KvBound, kv_traffic, measure
from harness.hlo.ir import parse_hlo

CACHE = "bf16[1,1,8,2]{3,2,1,0}"
ROW = "bf16[1,1,1,2]{3,2,1,0}"


def module(read_op: str, out_op: str | None = None) -> str:
    """A graph writing one row into the cache (aliased) and reading one row through `read_op`."""
    out_type = "f32[1,1,8,2]{3,2,1,0}" if read_op == "convert" else CACHE
    tail = "%upd" if out_op is None else "%w"
    return f"""HloModule t, input_output_alias={{ {{1}}: (1, {{}}, may-alias) }}, entry_computation_layout={{({ROW}, {CACHE})->({ROW}, {CACHE})}}

ENTRY %main (p0: bf16[1,1,1,2], p1: bf16[1,1,8,2]) -> (bf16[1,1,1,2], bf16[1,1,8,2]) {{
  %p0 = {ROW} parameter(0)
  %p1 = {CACHE} parameter(1)
  %c0 = s32[] constant(0)
  %v = {out_type} {read_op}({CACHE} %p1)
  %row = {ROW.replace('bf16', 'f32') if read_op == 'convert' else ROW} slice({out_type} %v), slice={{[0:1], [0:1], [0:1], [0:2]}}
  %upd = {CACHE} dynamic-update-slice({CACHE} %p1, {ROW} %p0, s32[] %c0, s32[] %c0, s32[] %c0, s32[] %c0)
  {'' if out_op is None else f'%w = {CACHE} {out_op}({CACHE} %upd)'}
  ROOT %out = ({ROW}, {CACHE}) tuple({ROW} %row, {CACHE} {tail})
}}
"""


@pytest.mark.parametrize("op, whole", [("reshape", False), ("bitcast", False), ("copy", True), ("convert", True)])
def test_a_copy_or_convert_of_the_cache_reads_it_whole(op, whole):
    got = measure(parse_hlo(module(op)), "p1", "upd")
    assert got.read == (32 if whole else 4) and got.write == 4  # 8 rows x 2 values x 2 bytes; one row


def test_a_copy_on_the_way_to_the_output_rewrites_the_cache_whole():
    text = module("reshape", out_op="copy")
    got = measure(parse_hlo(text), "p1", "w")
    assert got.write >= 32 and got.whole_writes
    bound = {"cache.k": KvBound(read=8, write=4)}
    violations = kv_traffic(text, [("input", "x"), ("state", "cache.k")], bound)
    assert any("rewritten whole by copy" in v for v in violations), violations
