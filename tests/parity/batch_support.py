"""Runs of an engine of several KV slots recorded row by row, for the exact isolation tests (no tolerances)."""

from __future__ import annotations

import torch

from harness.backends import build_engine
from harness.base.settings import RunSettings
from harness.port.engine import Engine


def batch_engine(ckpt, batch: int, backend: str = "cpu", **settings) -> Engine:
    options = {"buckets": (16, 64), "kv_len": 128, **settings}
    return build_engine(ckpt, RunSettings(backend=backend, batch=batch, **options), capture=True)


def random_prompts(vocab: int, lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run_rows(be: Engine, prompts, slots, steps: int, fresh: bool = True, capture: bool = True) -> list[dict]:
    """Prefill `prompts` into `slots` in one batch, then `steps` greedy decode steps of all of them
    together: per row its prefill logits and captures (none without `capture`: a perf build),
    each step's logits and captures, and its KV slot read back (every position written)."""
    if fresh:
        be.backend.reset()
    pres = be.prefill_rows(prompts, slots, capture=capture)
    rows = [{"prefill": p.logits, "captures": p.captures, "steps": [], "step_caps": []} for p in pres]
    tokens = [int(p.logits[-1].argmax()) for p in pres]
    for step in range(steps):
        out = be.decode_rows(tokens, [len(p) + step for p in prompts], slots, capture=capture)
        for row, s in zip(rows, out):
            row["steps"].append(s.logits)
            row["step_caps"].append(s.captures)
        tokens = [int(s.logits.argmax()) for s in out]
    for row, prompt, slot in zip(rows, prompts, slots):
        row["kv"] = be.read_cache(len(prompt) + steps, slot)
    return rows


def assert_same_row(a: dict, b: dict, what: str = "") -> None:
    """Bit for bit: logits, every capture point, every decode step, the KV slot."""
    assert torch.equal(a["prefill"], b["prefill"]), f"{what}: prefill logits differ"
    assert a["captures"].keys() == b["captures"].keys()
    for name in a["captures"]:
        assert torch.equal(a["captures"][name], b["captures"][name]), f"{what}: capture {name} differs"
    for i, (x, y) in enumerate(zip(a["steps"], b["steps"], strict=True)):
        assert torch.equal(x, y), f"{what}: decode step {i} logits differ"
        for name in a["step_caps"][i]:
            assert torch.equal(a["step_caps"][i][name], b["step_caps"][i][name]), f"{what}: step {i} {name} differs"
    for layer, (x, y) in enumerate(zip(a["kv"], b["kv"], strict=True)):
        if x is not None:
            assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]), f"{what}: KV of layer {layer} differs"
