"""A bench result's timings as named sample lists, block by block (the headline metrics, the batch,
speculative and at-length blocks, the latency vocabulary): what compare, history and the budgets
read, and where validation finds each block's lists."""

from __future__ import annotations

def metric_samples(result: dict) -> dict[str, list[float]]:
    """Every compared metric: prefill at the headline bucket, at other buckets, decode per token."""
    samples = {"prefill_ms": result["metrics"]["prefill_ms"]}
    for bucket, values in sorted(result.get("prefill_ms_by_bucket", {}).items(), key=lambda kv: int(kv[0])):
        if int(bucket) != int(result["prefill_bucket"]):
            samples[f"prefill_ms[{bucket}]"] = values
    samples["decode_ms_per_token"] = result["metrics"]["decode_ms_per_token"]
    samples.update(length_samples(result))
    samples.update(batch_samples(result))
    samples.update(speculative_samples(result))
    return samples


def batch_samples(result: dict) -> dict[str, list[float]]:
    """`prefill_ms@b{B}` (every prompt's prefill) and `step_ms@b{B}` (one decode step of all B rows)
    per batch size of `bench --batch`; empty for a result benched without batches."""
    samples = {}
    for row in (result.get("batch") or {}).get("rows", []):
        samples[f"prefill_ms@b{row['batch']}"] = row["prefill_samples_ms"]
        if row.get("step_samples_ms"):
            samples[f"step_ms@b{row['batch']}"] = row["step_samples_ms"]
    return samples


def batch_lists(result: dict) -> dict[str, object]:
    """The sample lists of the batch block by their place in the file (for validation)."""
    block = result.get("batch")
    if block is None:
        return {}
    rows = block.get("rows") if isinstance(block, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("batch"), int) for r in rows):
        return {"batch.rows": None}
    lists = {f"batch.rows[{r['batch']}].prefill_samples_ms": r.get("prefill_samples_ms") for r in rows}
    lists.update({f"batch.rows[{r['batch']}].step_samples_ms": r["step_samples_ms"] for r in rows
                  if r.get("step_samples_ms", []) != []})  # none: bench --new-tokens 1 (no step)
    return lists


def speculative_samples(result: dict) -> dict[str, list[float]]:
    """`speculative_ms_per_token[k=K]`, one sample per run, for a result benched with --speculate K
    (harness/perf/speculative.py); empty otherwise. Accepted drafts per verify is reported, not
    compared (it is not a time)."""
    block = result.get("speculative")
    if not isinstance(block, dict) or not isinstance(block.get("samples"), list):
        return {}
    return {f"speculative_ms_per_token[k={block.get('k')}]": [s["speculative_ms_per_token"] for s in block["samples"]]}


def length_samples(result: dict) -> dict[str, list[float]]:
    """`ttft_ms@L` and `tpot_ms@L` per length; empty for a result benched without lengths."""
    samples = {}
    for row in (result.get("at_length") or {}).get("lengths", []):
        samples[f"ttft_ms@{row['length']}"] = row["ttft_ms"]
        samples[f"tpot_ms@{row['length']}"] = row["tpot_ms"]
    return samples


def length_lists(result: dict) -> dict[str, object]:
    """The sample lists of the at_length block by their place in the file (for validation)."""
    block = result.get("at_length")
    if block is None:
        return {}
    rows = block.get("lengths") if isinstance(block, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("length"), int) for r in rows):
        return {"at_length.lengths": None}
    return {f"at_length.lengths[{r['length']}].{key}": r.get(key) for r in rows for key in ("ttft_ms", "tpot_ms")}


def latency_samples(result: dict) -> dict[str, list[float]]:
    """TTFT at the headline bucket (and others), TPOT (every decode step), end-to-end; empty for
    results written before these were recorded."""
    latency = result.get("latency") or {}
    samples = {}
    ttft = latency.get("ttft_ms_by_bucket") or {}
    headline = str(result["prefill_bucket"])
    if headline in ttft:
        samples["ttft_ms"] = ttft[headline]
    for bucket, values in sorted(ttft.items(), key=lambda kv: int(kv[0])):
        if bucket != headline:
            samples[f"ttft_ms[{bucket}]"] = values
    steps = [ms for run in result.get("decode_steps_ms") or [] for ms in run]
    if steps and latency:
        samples["tpot_ms"] = steps
    if latency.get("e2e_ms"):
        samples["e2e_ms"] = latency["e2e_ms"]
    return samples


def budget_samples(result: dict) -> dict[str, list[float]]:
    """What a budget may name: the compared metrics and the latency vocabulary."""
    return {**metric_samples(result), **latency_samples(result)}

