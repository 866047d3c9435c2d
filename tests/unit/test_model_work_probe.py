"""The probe that replaces wall-clock limits in the bad-input suites (tests/model_work.py) sees
model work when there is some: a command that computes a reference reads weights, loads a
transformers model and runs module forwards, and the probe counts each; outside it, nothing is
counted and the patched methods are restored."""

from __future__ import annotations

import json

import torch

from harness.cli import main
from harness.inputs.checkpoint import Checkpoint
from tests.model_work import ModelWork


def test_the_probe_counts_a_reference_run(tmp_path, tiny0_dir):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([[5, 6, 7]]))
    with ModelWork() as work:
        code = main(["reference", "--checkpoint", str(tiny0_dir), "--prompts", str(prompts), "--new-tokens", "1",
                     "--out", str(tmp_path / "golden")])
    assert code == 0
    done = work.done()
    assert done.get("transformers models loaded", 0) >= 2  # the fp32 and the bf16 reference
    assert done.get("module forwards", 0) > 0 and done.get("weight tensors read", 0) > 0
    assert work.done(allow=("module forwards", "weight tensors read", "transformers models loaded")) == {}


def test_the_probe_restores_what_it_patched(tiny0_ckpt):
    get, call = Checkpoint.get, torch.nn.Module.__call__
    with ModelWork() as work:
        assert Checkpoint.get is not get
        tiny0_ckpt.get(next(iter(tiny0_ckpt.expected_shapes())))
    assert Checkpoint.get is get and torch.nn.Module.__call__ is call
    torch.nn.Linear(2, 2)(torch.ones(2))
    assert work.done() == {"weight tensors read": 1}
