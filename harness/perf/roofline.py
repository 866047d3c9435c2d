"""Roofline floors per device graph: the least time the hardware could take for one call.

For each graph (prefill at a bucket, one decode step) three costs come from the spec and the TP
plan (harness.port.sharding), summed over the ranks of the chip:
  * bytes read from device memory: every rank's weights once, plus the whole KV cache the static
    graph attends over (both K and V, every layer) and the slots it writes;
  * FLOPs: 2 per weight per token for every projection and the lm_head, and the two attention
    matmuls over the compiled KV length;
  * bytes over the host link: the host-side embeddings in, the last real position's raw logits out
    (a perf build returns only the row greedy decode needs).
Each floor is cost / rate; the graph's floor is the largest (the resource that binds), and its
efficiency is floor / measured median. Activations are left out: at these token counts they stay
on chip and are a small fraction of the weight bytes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from harness.base.errors import HarnessInputError
from harness.base.settings import DEFAULT_KV_LEN, PUBLISHED_BUCKET
from harness.inputs.spec import ModelSpec, dtype_bytes
from harness.port.sharding import plan_layer, plan_model

GiB = 2**30
# Per Inferentia2 chip. Source: AWS Neuron documentation, "Inferentia2 Architecture" and "Amazon EC2
# Inf2 Architecture" (awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/
# inferentia2.html, inf2-arch.html): two NeuronCore-v2, 190 FP16/BF16 TFLOPS, 47.5 FP32 TFLOPS,
# 32 GiB of HBM (two HBM2e stacks); bandwidth 820 GB/s, decimal, as the NKI architecture guide
# ("Trainium/Inferentia2 Architecture Guide for NKI") writes it. Some pages say "820 GiB/s"; the
# guide's GB/s is the figure the stacks give and the one that does not overstate the chip.
CHIP = {"cores": 2, "hbm_bytes": 32 * GiB, "hbm_bytes_per_s": 820e9,
        "flops_per_s": {"bf16": 190e12, "fp32": 47.5e12}}
# The host link is not in that documentation: 32e9 B/s per direction is an assumption (the nominal
# rate of a PCIe Gen4 x16 link), so the host floor is an estimate, marked as such in every output.
HOST_LINK_BYTES_PER_S = 32e9
CHIP_SOURCE = ("AWS Neuron docs, Inferentia2 Architecture / Amazon EC2 Inf2 Architecture (per chip: 2 "
               "NeuronCore-v2, 190 BF16 TFLOPS, 47.5 FP32 TFLOPS, 32 GiB HBM) and the NKI architecture guide "
               "(820 GB/s HBM); a TP group gets its cores' share (one core: half a chip); host link 32 GB/s "
               "assumed (PCIe Gen4 x16), not published")
# Inferentia2 chips per instance type (same source, the Inf2 instance table).
INSTANCE_CHIPS = {"inf2.xlarge": 1, "inf2.8xlarge": 1, "inf2.24xlarge": 6, "inf2.48xlarge": 12}
DEFAULT_INSTANCE = "inf2.8xlarge"
# The published port's first-token prefill of the real 12B at TP=2 (docs/design.md#performance-facts).
PUBLISHED_PREFILL_MS, PUBLISHED_PREFILL_BUCKET = 101.0, PUBLISHED_BUCKET
# `--instance-rates`: the keys a file of one's own figures must give (per chip, like CHIP).
RATE_KEYS = ("cores", "hbm_bytes", "hbm_bytes_per_s", "bf16_flops_per_s", "fp32_flops_per_s", "chips")


@dataclass(frozen=True)
class Rates:
    """What the floors divide by: memory bytes/s, FLOP/s, host-link bytes/s (None: no link)."""

    name: str
    memory_bytes_per_s: float
    flops_per_s: float
    host_link_bytes_per_s: float | None
    source: str

    def to_dict(self) -> dict:
        return asdict(self)


def instance_rates(instance: str, tp: int, dtype: str = "bf16", chip: dict | None = None) -> Rates:
    """The figures of the `tp` NeuronCores a TP group uses on `instance`: each core's share of its
    chip's HBM bandwidth and compute (tp=1 on inf2: half a chip). `chip`: figures given with
    --instance-rates for an instance type not in the table (see `load_instance_rates`)."""
    if chip is None:
        if instance not in INSTANCE_CHIPS:
            raise HarnessInputError(f"unknown instance type {instance!r}: its rates are not in the table (known: "
                                    f"{', '.join(INSTANCE_CHIPS)}); give them with --instance-rates FILE")
        chip = {**CHIP, "chips": INSTANCE_CHIPS[instance], "source": CHIP_SOURCE,
                "host_link_bytes_per_s": HOST_LINK_BYTES_PER_S}
    chips = math.ceil(tp / chip["cores"])
    if chips > chip["chips"]:
        raise HarnessInputError(f"tp={tp} needs {chips} Inferentia2 chips; {instance} has {chip['chips']}")
    share = tp / chip["cores"]  # chips' worth of bandwidth and compute the group's cores get
    peak = chip["flops_per_s"]["bf16" if dtype in ("bf16", "bfloat16") else "fp32"]
    name = f"{instance} ({tp} NeuronCore{'s' * (tp > 1)} of {chips} chip{'s' * (chips > 1)})"
    return Rates(name, share * chip["hbm_bytes_per_s"], share * peak, chips * chip["host_link_bytes_per_s"],
                 chip["source"])


def load_instance_rates(path) -> dict:
    """The per-chip figures of an instance type not in the table, from a JSON file with RATE_KEYS
    (and optionally host_link_bytes_per_s): refused, naming the key, when incomplete or not numbers."""
    import json
    from pathlib import Path

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:160]
        raise HarnessInputError(f"--instance-rates {path}: cannot read it as JSON ({reason})") from None
    if not isinstance(data, dict):
        raise HarnessInputError(f"--instance-rates {path}: expected a JSON object with {', '.join(RATE_KEYS)}")
    link = data.get("host_link_bytes_per_s", HOST_LINK_BYTES_PER_S)
    bad = [k for k, value in [*((k, data.get(k)) for k in RATE_KEYS), ("host_link_bytes_per_s", link)]
           if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0
           or (k in ("cores", "chips") and (value != int(value) or value > 4096))]
    if bad:
        raise HarnessInputError(f"--instance-rates {path}: {', '.join(bad)} missing or not a finite positive number "
                                f"(cores and chips whole numbers; give every one of {', '.join(RATE_KEYS)}, per chip)")
    return {"cores": int(data["cores"]), "chips": int(data["chips"]), "hbm_bytes": data["hbm_bytes"],
            "hbm_bytes_per_s": data["hbm_bytes_per_s"],
            "flops_per_s": {"bf16": data["bf16_flops_per_s"], "fp32": data["fp32_flops_per_s"]},
            "host_link_bytes_per_s": link,
            "source": f"--instance-rates {path}"}


def hbm_fit(spec: ModelSpec, tp: int, dtype: str, kv_len: int, chip: dict | None = None,
            sliding_cache: str = "linear", quantize: str | None = None) -> dict:
    """Whether every rank's weights (int8 under `quantize`: core_fit.rank_bytes) and KV cache fit
    the HBM of the cores that hold them: the TP group's cores' share of the chips' HBM (tp=2 on
    inf2: one chip's 32 GiB). Activations, the runtime's scratchpad and the compiled code need room
    too: a fit with little headroom may still fail to load (core_fit.core_bytes counts them)."""
    from harness.port.core_fit import rank_bytes

    chip = chip or CHIP
    memory = rank_bytes(spec, tp, dtype, kv_len, sliding_cache=sliding_cache, quantize=quantize)
    needed = tp * memory["total"]
    capacity = tp * chip["hbm_bytes"] / chip["cores"]
    return {"weights_bytes": tp * memory["weights"], "kv_bytes": tp * memory["kv_cache"], "needed_bytes": needed,
            "capacity_bytes": capacity, "fits": needed <= capacity, "kv_len": kv_len, "sliding_cache": sliding_cache,
            "quantize": quantize}


def render_hbm_fit(fit: dict) -> str:
    """One line: weights + KV against the HBM they must fit."""
    verdict = "fits" if fit["fits"] else "DOES NOT FIT"
    weights = f"{fit['quantize']} weights" if fit.get("quantize") else "weights"
    return (f"HBM: {weights} {fit['weights_bytes'] / GiB:.2f} GiB + KV cache {fit['kv_bytes'] / GiB:.2f} GiB "
            f"(kv-len {fit['kv_len']}, {fit.get('sliding_cache', 'linear')} sliding cache) = {fit['needed_bytes'] / GiB:.2f} GiB of {fit['capacity_bytes'] / GiB:.0f} GiB: "
            f"{verdict}")


def measured_rates(bandwidth: dict, matmul: dict) -> Rates:
    """This machine's measured figures (the CPU backend: the host is the device, no link)."""
    return Rates("this machine (measured)", bandwidth["bytes_per_s"], matmul["flops_per_s"], None,
                 f"measured: {bandwidth['method']}; {matmul['method']}")


def lm_head_params_per_rank(spec: ModelSpec, tp: int) -> int:
    return spec.vocab_size * spec.hidden_size // tp


def matmul_params_per_rank(spec: ModelSpec, tp: int) -> int:
    """Weights of every decoder-layer projection one rank multiplies by, per token (lm_head apart:
    the perf build runs it on the last real position only)."""
    total = 0
    for layer, plan in zip(spec.layers, plan_model(spec, tp)):
        h, d = spec.hidden_size, layer.head_dim
        kv_mats = 0 if layer.kv_source is not None else (1 if layer.k_eq_v else 2)  # KV-shared: none
        total += 2 * h * plan.q_heads_per_rank * d + kv_mats * h * plan.kv_heads_per_rank * d
        total += 3 * h * spec.mlp_size(layer) // tp + 2 * h * spec.per_layer_input_size
        if spec.moe is not None:  # the router, and the k experts a token uses (1/tp of each)
            total += spec.moe.num_experts * h + 3 * spec.moe.top_k * spec.moe.intermediate_size * h // tp
    return total


def experts_read(spec: ModelSpec, tokens: int) -> float:
    """Experts a call reads per MoE layer: a decode token reads its top-k; `tokens` tokens routed
    uniformly read E (1 - (1 - k/E)^tokens) distinct experts in expectation (at most all E)."""
    e, k = spec.moe.num_experts, spec.moe.top_k
    return e * (1 - (1 - k / e) ** tokens)


def unread_expert_bytes(spec: ModelSpec, tp: int, dtype: str, tokens: int) -> float:
    """Bytes of the experts a call does not read (summed over ranks), to take off the weight bytes:
    the floor counts the experts actually read, not all of them."""
    if spec.moe is None:
        return 0.0
    per_expert = 3 * spec.moe.intermediate_size * spec.hidden_size * dtype_bytes(dtype)  # over all ranks
    return spec.num_layers * (spec.moe.num_experts - experts_read(spec, tokens)) * per_expert


def graph_costs(spec: ModelSpec, tp: int, dtype: str, tokens: int, kv_len: int, quantize: str | None = None) -> dict:
    """Bytes and FLOPs of one call of the graph that runs `tokens` tokens against a KV cache of
    `kv_len` slots, summed over the `tp` ranks (the weights int8 under `quantize`: core_fit.rank_bytes)."""
    from harness.port.core_fit import rank_bytes

    nbytes = dtype_bytes(dtype)
    memory = rank_bytes(spec, tp, dtype, kv_len, quantize=quantize)
    kv_write = sum(2 * plan_layer(layer, tp).kv_heads_per_rank * tokens * layer.head_dim * nbytes
                   for layer in spec.layers if layer.kv_source is None)
    attention = sum(2 * 2 * plan_layer(layer, tp).q_heads_per_rank * layer.head_dim * tokens * kv_len
                    for layer in spec.layers)
    return {
        "tokens": tokens, "kv_len": kv_len,
        "weight_bytes": tp * memory["weights"] - unread_expert_bytes(spec, tp, dtype, tokens),
        "kv_bytes": tp * (memory["kv_cache"] + kv_write),
        # the perf build (what is timed) runs lm_head on the last real row and returns that row only
        "flops": tp * (2 * tokens * matmul_params_per_rank(spec, tp) + 2 * lm_head_params_per_rank(spec, tp)
                       + attention),
        # E2B/E4B: each token's per-layer table row rides in with its embedding
        "host_bytes": tokens * (spec.hidden_size + spec.num_layers * spec.per_layer_input_size) * nbytes
                      + spec.vocab_size * nbytes,
    }


def floors(costs: dict, rates: Rates) -> dict:
    """Each cost over its rate, in ms, and the binding one."""
    out = {"memory_ms": (costs["weight_bytes"] + costs["kv_bytes"]) / rates.memory_bytes_per_s * 1e3,
           "compute_ms": costs["flops"] / rates.flops_per_s * 1e3,
           "host_ms": (costs["host_bytes"] / rates.host_link_bytes_per_s * 1e3
                       if rates.host_link_bytes_per_s else None)}
    bound = max((k for k in out if out[k] is not None), key=lambda k: out[k])
    out.update(floor_ms=out[bound], bound=bound[:-len("_ms")])
    return out


def graph_floors(spec: ModelSpec, tp: int, dtype: str, buckets, kv_len: int, rates: Rates,
                 quantize: str | None = None) -> list[dict]:
    """One row per graph: prefill at each bucket, then one decode step."""
    graphs = [(f"prefill[{b}]", b) for b in sorted(buckets)] + [("decode", 1)]
    rows = []
    for name, tokens in graphs:
        costs = graph_costs(spec, tp, dtype, tokens, kv_len, quantize=quantize)
        rows.append({"graph": name, **costs, **floors(costs, rates)})
    return rows


def with_efficiency(rows: list[dict], measured_ms: dict[str, float]) -> list[dict]:
    """Add the measured median and floor / measured to each row that was measured."""
    out = []
    for row in rows:
        ms = measured_ms.get(row["graph"])
        out.append({**row, "measured_ms": ms,
                    "efficiency": row["floor_ms"] / ms if ms else None})
    return out


def roofline_block(spec: ModelSpec, tp: int, dtype: str, buckets, kv_len: int, rates: Rates,
             measured_ms: dict[str, float] | None = None, quantize: str | None = None) -> dict:
    """The roofline block of a bench result (and of `info --perf`)."""
    rows = graph_floors(spec, tp, dtype, buckets, kv_len, rates=rates, quantize=quantize)
    return {"rates": rates.to_dict(), "tp": tp, "dtype": dtype,
            "graphs": with_efficiency(rows, measured_ms or {})}


INSTANCE_RATES_ENV = "GEMMA_PARITY_INSTANCE_RATES"  # bench: a JSON file of per-chip figures (load_instance_rates)


def neuron_instance_rates(instance: str | None, tp: int, dtype: str, environ=None) -> Rates:
    """The rates a Neuron bench is judged by: the table's for the detected `instance` (inf2.8xlarge
    when the type cannot be read), or the figures of $GEMMA_PARITY_INSTANCE_RATES. An instance type
    not in the table without that file is refused: its figures are unknown."""
    import os

    path = (os.environ if environ is None else environ).get(INSTANCE_RATES_ENV)
    if path:
        return instance_rates(instance or "this instance", tp, dtype, load_instance_rates(path))
    if instance is not None and instance not in INSTANCE_CHIPS:
        raise HarnessInputError(f"instance type {instance!r} is not in the rate table ({', '.join(INSTANCE_CHIPS)}): "
                                f"set {INSTANCE_RATES_ENV} to a JSON file of its per-chip figures "
                                f"({', '.join(RATE_KEYS)})")
    return instance_rates(instance or DEFAULT_INSTANCE, tp, dtype)


def info_floors(spec: ModelSpec, tp: int, dtype: str = "bf16", kv_len: int = DEFAULT_KV_LEN,
                buckets=(PUBLISHED_BUCKET,), instance: str = DEFAULT_INSTANCE, chip: dict | None = None,
                sliding_cache: str = "linear", quantize: str | None = None) -> dict:
    """`gemma-parity info --perf`: the instance's floors and HBM fit, nothing run or measured, beside
    the published port's prefill (docs/design.md#performance-facts: about 101 ms at bucket 64)."""
    out = roofline_block(spec, tp, dtype, buckets, kv_len, rates=instance_rates(instance, tp, dtype, chip),
                         quantize=quantize)
    if not spec.is_family:  # the published figure is the 12B's
        out["published_ms"] = {f"prefill[{PUBLISHED_PREFILL_BUCKET}]": PUBLISHED_PREFILL_MS}
    out["hbm"] = hbm_fit(spec, tp, dtype, kv_len, chip=chip, sliding_cache=sliding_cache, quantize=quantize)
    return out
