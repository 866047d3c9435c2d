"""The judged pass of `gemma-parity quality`: the port, teacher-forced over every window of the
golden, against the fp32 reference's statistics, side by side with the bf16 reference's own.

Each window runs through the port's buckets: the first min(window, largest bucket) tokens as one
prefill (every row's logits), the rest as teacher-forced decode steps on the device KV cache. The
served probabilities are the host's (engine.probabilities: softcap, then softmax), as a user gets
them. On a compiled backend the port runs its parity build here (it returns every row; the perf
build returns only the last row and is judged by `check`'s served-build stage).
"""

from __future__ import annotations

import torch

from harness.base.progress import status
from harness.inputs.prompts import kv_positions_used
from harness.quality.golden import golden_bytes, read_golden_parts
from harness.quality.stats import QUALITY_FACTOR, position_metrics, summarize, verdict

WORST = 10
CONTEXT = 16  # tokens of context shown before a worst position


def check_window_fits(window: int, buckets, kv_len: int) -> None:
    from harness.base.errors import OptionError

    if kv_positions_used(window - 1, 1) > kv_len:  # the window but its last token, prefilled or fed
        raise OptionError(f"--window {window}: the port needs {window - 1} KV positions but --kv-len is {kv_len}; "
                          f"raise --kv-len or use --window {kv_len + 1} or less")
    del buckets  # any window fits: the part past the largest bucket runs as decode steps


def port_window_logits(engine, window: list[int]) -> torch.Tensor:
    """Raw logits [window - 1, vocab] at every position but the last, teacher-forced (the one
    window pass, harness.quality.moe.port_window)."""
    from harness.quality.moe import port_window

    return port_window(engine, window)[0]


def _port_engine(checkpoint, settings):
    from harness.backends import build_engine

    # capture=True: on a compiled backend the parity build, which returns every row's logits; on
    # MoE models everywhere (the port's routing is read from its captures, harness/quality/moe.py)
    moe = checkpoint.spec.moe is not None
    return build_engine(checkpoint, settings, capture=moe or settings.backend != "cpu")


def _collect(engine, golden_dir, settings, progress, checkpoint=None) -> tuple[dict[str, list], list]:
    """Per-position columns over every window, and (MoE) the routing decisions."""
    from harness.quality.moe import moe_part_columns

    say = status("quality port", progress, total=settings.windows // settings.windows_per_part + settings.shards)
    cols: dict[str, list] = {}
    decisions: list = []
    for part, g in read_golden_parts(golden_dir, settings, engine.spec.vocab_size):
        say(f"windows {part.start}-{part.stop - 1} of {settings.windows}")
        if checkpoint is not None and checkpoint.spec.moe is not None:  # references along the port's routing
            part_cols, part_decisions = moe_part_columns(checkpoint, engine, g["tokens"].long(), settings.topk)
            decisions += part_decisions
            for name, ts in part_cols.items():
                cols.setdefault(name, []).extend(ts)
            cols.setdefault("window", []).extend(torch.full((settings.window - 1,), w) for w in part)
            cols.setdefault("tokens", []).extend(t for t in g["tokens"].long())
            continue
        for k, w in enumerate(part):
            tokens = g["tokens"][k].long()
            logits = port_window_logits(engine, tokens.tolist())
            row = {name: g[name][k] for name in ("topk_ids", "topk_logprobs", "tail_logprob", "target_logprob")}
            m = position_metrics(row, engine.probabilities(logits).double().clamp_min(1e-300).log(), tokens[1:])
            m["port_top1_id"] = logits.argmax(-1)
            for name in ("bf16_kl", "bf16_dp", "bf16_top1", "bf16_nll", "target_logprob"):
                m[name] = g[name][k]
            m["ref_top1_id"] = g["topk_ids"][k][:, 0]
            m["window"] = torch.full((len(tokens) - 1,), w)
            for name, t in m.items():
                cols.setdefault(name, []).append(t)
            cols.setdefault("tokens", []).append(tokens)
    say.close()
    return cols, decisions


def _worst(cols: dict, window: int, n: int) -> list[dict]:
    cat = {name: torch.cat(cols[name]) for name in ("kl", "window", "ref_top1_id", "port_top1_id", "bf16_kl", "dp")}
    out = []
    for i in cat["kl"].argsort(descending=True)[:n].tolist():
        k, p = divmod(i, window - 1)  # k: the k-th window judged; p: the position in it
        seq, w = cols["tokens"][k].tolist(), int(cat["window"][i])
        out.append({"window": w, "position": p, "corpus_offset": w * window + p,
                    "context": seq[max(0, p + 1 - CONTEXT):p + 1], "target": seq[p + 1],
                    "reference_top1": int(cat["ref_top1_id"][i]), "port_top1": int(cat["port_top1_id"][i]),
                    "kl": float(cat["kl"][i]), "bf16_kl": float(cat["bf16_kl"][i]), "dp": float(cat["dp"][i]),
                    "prompt": seq[:p + 1]})
    return out


def judge_corpus(checkpoint, golden_dir, settings, run=None, *, progress: bool = False,
                 factor: float = QUALITY_FACTOR, engine=None) -> dict:
    """The port over the golden's windows: its statistics and the bf16 reference's against fp32,
    the verdict, the worst positions (with the prompt that reproduces each) and the KL values."""
    from harness.base.settings import RunSettings

    run = run or RunSettings()
    engine = engine or _port_engine(checkpoint, run)
    cols, decisions = _collect(engine, golden_dir, settings, progress, checkpoint)
    cat = {name: torch.cat(ts) for name, ts in cols.items() if name != "tokens"}
    ref_nll = -cat["target_logprob"].double()
    port = summarize(cat["kl"], cat["dp"], cat["top1"], cat["nll"], ref_nll)
    bf16 = summarize(cat["bf16_kl"], cat["bf16_dp"], cat["bf16_top1"].bool(), cat["bf16_nll"], ref_nll)
    judged = verdict(port, bf16, factor)
    routing = None
    if checkpoint.spec.moe is not None:
        from harness.quality.moe import judge_moe_routing

        routing = judge_moe_routing(decisions, checkpoint.spec.moe.top_k)
    size = golden_bytes(golden_dir)
    return {"passed": judged["passed"] and (routing is None or routing.passed), "backend": run.backend,
            "tp": run.tp, "dtype": run.dtype, "routing": routing.to_json() if routing is not None else None,
            "settings": {k: v for k, v in settings.to_json().items() if k != "weights"},
            "golden": {"path": str(golden_dir), "bytes": size, "positions": port["positions"],
                       "bytes_per_position": size / max(port["positions"], 1)},
            "port": port, "bf16_reference": bf16, "verdict": judged,
            "worst_positions": _worst(cols, settings.window, WORST),
            "kl_values": {"port": cat["kl"].float(), "bf16_reference": cat["bf16_kl"].float()},
            "notes": ["KL is taken on the fp32 reference's top-k support plus one tail bucket (a lower bound of "
                      "the full-vocabulary KL); delta-p is p_port(next token) - p_fp32(next token)"]
            + forcing_notes(checkpoint.spec)}


def forcing_notes(spec) -> list[str]:
    """What the window pass forces the references to, and why it does not take check's per-layer
    input pins (said in the output)."""
    notes = []
    if spec.moe is not None:
        notes.append("routing: the fp32 and bf16 references are computed again along the port's experts (the one "
                     "routing-forcing rule, harness.reference.forcing.follow_routes), as check's bf16 stage does")
    if spec.per_layer_input_size:
        notes.append("per-layer-input pins not taken: the window pass judges the port against the golden's stored "
                     "statistics of the reference's own path, and the pin rule (harness/parity/forced_path.py add_pins) "
                     "reads the references' gated per-layer inputs and MLP residuals, which the golden does not "
                     "keep; a gated per-layer input without a direction at bf16 precision therefore counts in the "
                     "port's statistics here, where check would pin it")
    return notes
