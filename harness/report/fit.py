"""What `info --batch` prints: the batch fit's table (harness/plan/batch_fit.py computes its rows)."""

from __future__ import annotations

from harness.perf.roofline import GiB


def render_fit_table(rows: list[dict]) -> str:
    lines = ["batch fit (the device fit: weights + batch x KV slot + every batch bucket's graphs, against HBM):",
             f"  {'kv_len':>8} {'batch':>5} {'KV/seq GiB':>10} {'KV GiB':>8} {'graphs GiB':>10} {'total GiB':>9} "
             f"{'of GiB':>6}  fit"]
    for r in rows:
        lines.append(f"  {r['kv_len']:>8} {r['batch']:>5} {r['kv_bytes_per_sequence'] / GiB:>10.3f} "
                     f"{r['kv_bytes'] / GiB:>8.2f} {r['graphs_bytes'] / GiB:>10.2f} {r['needed_bytes'] / GiB:>9.2f} "
                     f"{r['capacity_bytes'] / GiB:>6.0f}  "
                     f"{'yes' if r['fits'] else 'NO'} (at most {r['max_batch']})")
    return "\n".join(lines) + "\n"
