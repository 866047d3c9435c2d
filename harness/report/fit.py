"""What `info --batch` prints: the batch fit's table (harness/plan/batch_fit.py computes its rows)."""

from __future__ import annotations

from harness.perf.roofline import GiB


def render_fit_table(rows: list[dict]) -> str:
    """Per NeuronCore (a rank's core; the TP group's KV and graphs are tp x a core's): weights as they
    load, the batch's KV, every batch bucket's graphs and the runtime's reserve against a core."""
    int8 = " (int8 weights)" if rows and rows[0].get("quantize") else ""
    lines = [f"batch fit per NeuronCore{int8} (weights + batch x KV slot + every batch bucket's graphs + the runtime's "
             "reserve, against one core's HBM):",
             f"  {'kv_len':>8} {'batch':>5} {'KV/seq GiB':>10} {'KV GiB':>8} {'graphs GiB':>10} {'reserve':>7} "
             f"{'core GiB':>8} {'of GiB':>6}  fit"]
    for r in rows:
        tp = max(round(r["capacity_bytes"] / r["core_capacity_bytes"]), 1)
        lines.append(f"  {r['kv_len']:>8} {r['batch']:>5} {r['kv_bytes_per_sequence'] / tp / GiB:>10.3f} "
                     f"{r['kv_bytes'] / tp / GiB:>8.2f} {r['graphs_bytes'] / tp / GiB:>10.2f} "
                     f"{r['reserve_bytes'] / tp / GiB:>7.2f} {r['core_bytes'] / GiB:>8.2f} "
                     f"{r['core_capacity_bytes'] / GiB:>6.0f}  "
                     f"{'yes' if r['fits'] else 'NO'} (at most {r['max_batch']})")
    return "\n".join(lines) + "\n"
