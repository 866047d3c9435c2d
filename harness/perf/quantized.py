"""What `--quantize int8` saves on the device: bytes per rank, the HBM fit and the decode floor of
the quantized build beside the unquantized one, the scales counted (docs/quantization.md#bytes-and-floors).

Only the scheme's projections change (harness/inputs/quantize.py): each per-rank [rows, cols]
weight goes from `dtype` bytes an element to one byte plus four bytes of scale per row; the
lm_head, norms, router, experts and KV cache are the unquantized build's.
"""

from __future__ import annotations

from harness.inputs.spec import ModelSpec
from harness.port.core_fit import core_bytes, weight_savings
from harness.perf.roofline import CHIP, Rates, floors, graph_costs
from harness.port.sharding import bytes_per_rank

GiB = 2 ** 30


def quantized_comparison(spec: ModelSpec, tp: int, dtype: str, kv_len: int, rates: Rates,
                         chip: dict | None = None, sliding_cache: str = "linear") -> dict:
    """The unquantized and int8 builds side by side: weights, KV and total bytes per rank, whether
    one rank's NeuronCore holds its served build (core_fit.core_bytes: graphs and the runtime's
    reserve too), and the decode step's floor on `rates`."""
    chip = chip or CHIP
    saved = weight_savings(spec, tp, dtype)
    delta = saved["unquantized_bytes"] - saved["codes_bytes"] - saved["scale_bytes"]  # per rank
    capacity = chip["hbm_bytes"] / chip["cores"]  # a rank is one NeuronCore
    base = bytes_per_rank(spec, tp, dtype, kv_len, sliding_cache)
    decode = graph_costs(spec, tp, dtype, 1, kv_len)
    rows = {}
    for name, minus in (("unquantized", 0), ("int8", delta)):
        weights = base["weights"] - minus
        floor = floors({**decode, "weight_bytes": decode["weight_bytes"] - tp * minus}, rates)
        core = core_bytes(spec, tp, dtype, kv_len, sliding_cache, perf=True, quantize=None if minus == 0 else "int8")
        rows[name] = {"weights_bytes_per_rank": weights, "kv_bytes_per_rank": base["kv_cache"],
                      "total_bytes_per_rank": weights + base["kv_cache"], "core_bytes": core["total"],
                      "fits": core["total"] <= capacity,
                      "decode_floor_ms": floor["floor_ms"], "decode_bound": floor["bound"],
                      "decode_memory_ms": floor["memory_ms"]}
    return {"dtype": dtype, "tp": tp, "kv_len": kv_len, "rates": rates.name, "capacity_bytes": capacity,
            "scale_bytes_per_rank": saved["scale_bytes"], **rows,
            "weights_ratio": rows["int8"]["weights_bytes_per_rank"] / rows["unquantized"]["weights_bytes_per_rank"],
            "floor_ratio": rows["int8"]["decode_floor_ms"] / rows["unquantized"]["decode_floor_ms"]}


def render_quantized_comparison(c: dict) -> str:
    lines = [f"--quantize int8 beside {c['dtype']} (tp {c['tp']}, kv-len {c['kv_len']}, {c['rates']}):"]
    for name in ("unquantized", "int8"):
        r = c[name]
        lines.append(f"  {name:<11} weights {r['weights_bytes_per_rank'] / GiB:8.3f} GiB/rank + KV "
                     f"{r['kv_bytes_per_rank'] / GiB:.3f} GiB = {r['total_bytes_per_rank'] / GiB:.3f} GiB/rank; served build "
                     f"{r['core_bytes'] / GiB:.2f} GiB per core ({'fits' if r['fits'] else 'DOES NOT FIT'} a "
                     f"{c['capacity_bytes'] / GiB:.0f} GiB NeuronCore); decode floor "
                     f"{r['decode_floor_ms']:.2f} ms ({r['decode_bound']}-bound)")
    lines.append(f"  int8 weights are {c['weights_ratio']:.3f}x the unquantized ones and the decode floor "
                 f"{c['floor_ratio']:.3f}x, the fp32 scales counted ({c['scale_bytes_per_rank'] / 2**20:.2f} MiB per "
                 "rank); lm_head, norms, router, experts and the KV cache stay as they are")
    return "\n".join(lines)


def beside_unquantized(checkpoint, settings, result: dict, **bench_options) -> dict:
    """`bench --quantize int8`: the unquantized build timed in the same run, as `settings` say but
    unquantized, with both decode floors on the rates the bench used (its "unquantized" block)."""
    from harness.perf.bench import bench_rates, run_bench

    plain = run_bench(checkpoint, settings.but(quantize=None), **bench_options)
    rates, _ = bench_rates(result["backend"], result["tp"], result["dtype"])
    floors_beside = quantized_comparison(checkpoint.spec, settings.tp, settings.dtype, settings.kv_len, rates)
    return {"latency_summary": plain["latency_summary"], "roofline": plain["roofline"], "floors": floors_beside,
            "same_tokens": plain["outputs"] == result["outputs"]}


def render_beside(result: dict) -> str:
    """One line per build: TTFT and TPOT medians with the decode floor of each."""
    beside, quantize = result["unquantized"], result.get("quantize", "int8")
    lines = [f"--quantize {quantize} beside the unquantized build ({result['dtype']}, same run, same settings):"]
    for name, summary, floor in ((quantize, result["latency_summary"], beside["floors"]["int8"]),
                                 ("unquantized", beside["latency_summary"], beside["floors"]["unquantized"])):
        lines.append(f"  {name:<11} TTFT p50 {summary['ttft_ms']['p50']:.2f} ms, TPOT p50 {summary['tpot_ms']['p50']:.2f} "
                     f"ms (decode floor {floor['decode_floor_ms']:.3f} ms)")
    lines.append(f"  TPOT ratio {result['latency_summary']['tpot_ms']['p50'] / beside['latency_summary']['tpot_ms']['p50']:.3f}"
                 f" (floor ratio {beside['floors']['floor_ratio']:.3f}); greedy tokens "
                 f"{'the same' if beside['same_tokens'] else 'differ (int8 changes the numbers)'}")
    return "\n".join(lines) + "\n"
