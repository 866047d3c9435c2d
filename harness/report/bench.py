"""What `bench` prints beside its summary: the per-batch table (with each batch's speculative
acceptance) and the speculative block (harness/perf/batch.py and harness/perf/speculative.py
measure them)."""

from __future__ import annotations


def render_batch_bench(rows: list[dict]) -> str:
    lines = ["per batch size (decode step of all rows; prefill of all prompts):",
             f"  {'batch':>5} {'prefill ms':>10} {'step ms':>8} {'tok/s':>8} {'floor ms':>9} {'tok/s floor':>11} "
             f"{'eff':>6} bound"]
    for r in rows:
        lines.append(f"  {r['batch']:>5} {r['prefill_ms']:>10.1f} {r['step_ms'] or 0:>8.2f} {r['tokens_per_s'] or 0:>8.1f} "
                     f"{r['step_floor_ms']:>9.3f} {r['tokens_per_s_floor']:>11.1f} {r['efficiency'] or 0:>6.3f} {r['bound']}")
    for r in (r for r in rows if "speculative" in r):
        s = r["speculative"]
        lines.append(f"  batch {r['batch']}, speculative (k={s['k']}): {s['accepted_per_verify']:.2f} accepted drafts per "
                     f"verify ({s['verifies']} verifies; per sequence {', '.join(f'{a:.2f}' for a in s['per_sequence'])}), "
                     f"{s['ms_per_token']:.2f} ms per token, tokens {'equal' if s['tokens_equal'] else 'DIFFER from'} "
                     "plain greedy")
    return "\n".join(lines) + "\n"


def render_speculative(block: dict) -> str:
    return (f"speculative (k={block['k']}): {block['accepted_per_verify']:.2f} accepted drafts per verify; "
            f"{block['speculative_ms_per_token']:.2f} ms/token vs plain {block['plain_ms_per_token']:.2f} "
            f"(speed-up {block['measured_speedup']:.2f}x measured here, {block['modeled_speedup_inf2']:.2f}x modeled "
            f"on inf2's HBM roofline); verify {block['verify_over_decode']:.2f}x and draft step "
            f"{block['draft_over_decode']:.2f}x a decode step\n")
