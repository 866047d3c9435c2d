"""Ragged prompt sets as a property (issue 37): whatever the lengths (1 token to past the largest
bucket; all in one bucket, all in different buckets, fewer prompts than slots, a finished
sequence's slot reused), the batch size (1-4) and whether the run speculates, the one decode loop
serves every prompt of the batch as it serves the prompt alone: in fp32 the same tokens (and
accepted drafts), and the same logits and capture points (each row masked by its own positions,
its own KV slot). The default lane runs a few derandomized examples at TP 1; the slow lane more, at
TP 1 and 2, and the check command itself on the ragged sets that crashed it (every stage runs)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from harness.base.settings import RunSettings
from harness.port.decode import generate, greedy, speculative
from tests.unit.test_speculate import random_pair  # noqa: F401  (the fixture: the tiny 12B and a random assistant)

BUCKETS, KV_LEN, K = (8, 16), 48, 2
CASES = {  # the shapes the issue names, each an explicit example
    "all in one bucket": ([1, 5, 8, 3], 4),
    "all in different buckets": ([5, 12, 24], 3),
    "fewer prompts than slots": ([7], 4),
    "slot reuse": ([20, 3, 9, 1, 14], 2),
}


def case(name: str, spec: bool) -> dict:
    lengths, batch = CASES[name]
    return {"lengths": lengths, "batch": batch, "spec": spec}


ragged = st.lists(st.integers(1, 24), min_size=1, max_size=5)  # 24: past the largest bucket (chunked)


@pytest.fixture(scope="module")
def engines(tiny0_ckpt, request):
    """(build for `batch` slots at `tp`, with or without speculation) -> (engine, drafter), cached;
    the random assistant (random_pair) is built only when a run speculates."""
    from harness.backends import build_drafter, build_engine

    @functools.lru_cache(maxsize=None)
    def build(batch: int, tp: int, spec: bool):
        engine = build_engine(tiny0_ckpt, RunSettings(tp=tp, dtype="float32", buckets=BUCKETS, kv_len=KV_LEN,
                                                      batch=batch, speculate=K if spec else 0), capture=True)
        return engine, (build_drafter(engine, request.getfixturevalue("random_pair")[1]) if spec else None)
    return build


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + sum(lengths))
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal to fp32 rounding: a batch's calls have other shapes than one prompt's (rows padded to
    the batch bucket, a chunk in the bucket the longest row needs), so fp32 sums may round
    differently: measured up to 4e-6 of the tensor's largest magnitude on the tiny model. A
    batching fault (another slot's keys, a pad key seen) moves values by a large part of it."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    worst, scale = float((got - want).abs().max()) if got.numel() else 0.0, float(want.abs().max()) if want.numel() else 0.0
    assert worst <= 2e-5 * scale + 1e-6, f"{what}: differs by {worst:.3g} (scale {scale:.3g})"


def assert_batch_equals_alone(engines, lengths: list[int], batch: int, spec: bool, tp: int = 1, new: int = 3) -> None:
    prompts = prompts_of(lengths)
    engine, drafter = engines(batch, tp, spec)
    step = speculative(drafter, K) if spec else greedy()
    runs = generate(engine, prompts, new, step, capture=True)
    one, one_drafter = engines(1, tp, spec)
    for k, (prompt, run) in enumerate(zip(prompts, runs)):
        alone = generate(one, [prompt], new, speculative(one_drafter, K) if spec else greedy(), capture=True)[0]
        what = f"prompt {k} ({len(prompt)} tokens) of {lengths} at batch {batch}{' speculating' if spec else ''}"
        assert run.tokens == alone.tokens, what
        assert (run.accepted, run.drafted) == (alone.accepted, alone.drafted), what
        close(run.step_logits, alone.step_logits, what)
        close(run.prefill.logits, alone.prefill.logits, what)
        assert run.prefill.captures.keys() == alone.prefill.captures.keys(), what
        for name, value in alone.prefill.captures.items():
            close(run.prefill.captures[name], value, f"{what}: {name}")
        for name, value in alone.step_captures.items():
            close(run.step_captures[name], value, f"{what}: decode {name}")


# default lane: two examples without drafts (speculation in a batch, slot reuse included, is
# tests/unit/test_speculate.py's test_speculation_in_a_batch_equals_each_sequence_alone there)
@settings(max_examples=1, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=ragged, batch=st.integers(2, 4), spec=st.just(False))
@example(**case("all in one bucket", False))
def test_a_ragged_batch_serves_each_prompt_as_alone(engines, lengths, batch, spec):
    assert_batch_equals_alone(engines, lengths, batch, spec)


@pytest.mark.slow  # default-lane sibling: test_a_ragged_batch_serves_each_prompt_as_alone (two examples, TP 1)
@pytest.mark.parametrize("tp", [1, 2])
@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=ragged, batch=st.integers(1, 4), spec=st.booleans())
@example(**case("all in one bucket", True))
@example(**case("slot reuse", True))
@example(**case("all in different buckets", False))
@example(**case("all in different buckets", True))
@example(**case("fewer prompts than slots", True))
@example(**case("slot reuse", False))
def test_ragged_batches_serve_each_prompt_as_alone_at_tp(engines, tp, lengths, batch, spec):
    assert_batch_equals_alone(engines, lengths, batch, spec, tp=tp)


@pytest.mark.slow  # default-lane sibling: tests/parity/test_batch_local.py (the crash's cause, one layer alone)
@pytest.mark.parametrize("lengths, batch", [([5, 9, 14, 20], 4), ([1, 5], 2)])
def test_check_batch_runs_every_stage_on_prompts_in_the_first_bucket(lengths, batch, tmp_path, capsys):
    """The issue's reproduction: `check --batch N` on prompts that all fit the first bucket passes,
    every stage run (fp32, bf16 with its local verdicts, the served build)."""
    from harness.cli import main

    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(prompts_of(lengths)))
    out = tmp_path / "c.json"
    rc = main(["check", "--model", "tiny", "--batch", str(batch), "--prompts", str(prompts), "--json", str(out)])
    payload = json.loads(out.read_text())
    assert rc == 0 and payload["passed"], capsys.readouterr().out[-2000:]
    assert payload["port_error"] is None and payload["local_layers"] and payload["extra_stages"]["served"]["ran"]
