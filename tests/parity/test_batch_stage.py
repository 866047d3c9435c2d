"""The default `check` (no --batch) exercises a batch (issue 29): after the batch-1 stages, its prompts
as one ragged batch through a batched parity build (harness/parity/batched.py, the batch stage), each
sequence judged against the reference of its prompt alone. Every batch fault
(tests/faults/batch_faults.py) fails the default check there, naming the sequence; `--batch 1` runs
batch 1 only and says so; a healthy port passes on the tiny 12B and every family variant.

Default lane: the stage itself on batch_faults' four prompts (the reused-slot fault, which needs the
longest-first admission, and a clean run's notes), and the command's wiring without model work. The
CLI checks with each fault and on each variant are whole checks: the slow lane."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from harness.base.settings import RunSettings
from harness.cli import main
from harness.judge.results import ParityStage
from harness.judge.stage import near_tie_calibration
from harness.parity.batched import BatchStage, admission_order, run_batch_stage, stage_slots
from harness.parity.observation import StageReferences
from tests.faults.batch_faults import BATCH_BUCKETS, BATCH_CATALOG, BATCH_KV_LEN, batch_reference

# The default prompts (7, 24, 40, 64, 240 ids) are admitted longest first into 4 slots: 240, 64, 40
# and 24 share the first calls, then the 7-id prompt (prompt 0) starts in the slot the 240-id one left.
# The sequences each fault can break there (a row of a call of several rows, or the reused slot).
SHARED_CALLS = {1, 2, 3, 4}
DEFAULT_CHECK_SEQUENCES = {
    "batch-pad-keys-visible": {1, 2, 3, 4},  # every row of the first call has padded keys
    "batch-one-row-positions": {1, 2, 3},  # the 240-id row's positions given to the shorter rows
    "batch-window-from-longest": {1, 2, 3},
    "batch-kv-write-neighbour-slot": {0, 1, 2, 3, 4},
    "batch-decode-slot0-length": {1, 2, 3},  # decoded beside the 240-id row in slot 0
    "batch-reused-slot-stale-keys": {0},  # the only sequence started in a reused slot
    "batch-ple-row-of-other-sequence": SHARED_CALLS,
    "batch-routing-row-of-other-sequence": SHARED_CALLS,
}


def _after_bf16_stage(refs: dict) -> ParityStage:
    """What the batch stage reads of a finished check: the references its bf16 stage observed (here
    the references themselves: the tiny 12B follows no port path), the near-tie band, no fp32 stage."""
    ref32, ref16 = refs["float32"], refs["bfloat16"]
    observed = SimpleNamespace(references=StageReferences(ref32, ref16), followed=True, forcing=[], pinned=[])
    return ParityStage(backend="cpu", tp=2, dtype="bfloat16", calibration=near_tie_calibration(ref32, ref16),
                       observation=observed)


def _batch_stage(tiny0_ckpt) -> BatchStage:
    settings = RunSettings(buckets=BATCH_BUCKETS, kv_len=BATCH_KV_LEN)
    return run_batch_stage(_after_bf16_stage(batch_reference()), tiny0_ckpt, settings)


def test_admission_is_longest_first_into_one_slot_fewer_than_the_prompts():
    assert admission_order([[1] * 7, [1] * 24, [1] * 40, [1] * 64, [1] * 240]) == [4, 3, 2, 1, 0]
    assert admission_order([[1], [2], [3, 4]]) == [2, 0, 1]  # ties keep the prompts' order
    assert [stage_slots(n) for n in (2, 3, 5, 9)] == [2, 2, 4, 4]


def test_a_reused_slot_fault_fails_the_batch_stage_naming_its_sequence(tiny0_ckpt, monkeypatch):
    """The 7-id prompt starts in the slot the 64-id one left: masking decode by the slot's length
    shows it the old keys. The stage fails there, one entry per sequence under `prompts`."""
    fault = next(f for f in BATCH_CATALOG if f.name == "batch-reused-slot-stale-keys")
    fault.inject(monkeypatch)
    stage = _batch_stage(tiny0_ckpt)
    assert stage.ran and stage.slots == 3 and stage.order == [0, 1, 2, 3]
    failures = stage.failures()
    assert not stage.passed and failures[0]["stage"] == "batch", failures[:2]
    assert {f["where"].split()[1] for f in failures if f["where"].startswith("prompt ")} == {"3"}, failures[:4]
    payload = stage.to_json()
    assert payload["passed"] is False and len(payload["prompts"]) == 4 and payload["admission_order"] == [0, 1, 2, 3]
    assert "batch stage: the 4 prompts as one ragged batch of 3 KV slots" in stage.describe()


class _Reached(Exception):
    pass


def _check_args(tmp_path, monkeypatch, *extra: str) -> tuple:
    """`check` parsed, validated and run up to the model work: its settings and extra checks."""
    from harness.cli import build_parser
    from harness.parity import check as parity

    def stand_in(ckpt, ckpt_dir, settings, **kw):
        raise _Reached(settings, kw["stages"])

    monkeypatch.setattr(parity, "run_parity_check", stand_in)
    args = build_parser().parse_args(["check", "--model", "tiny", "--json", str(tmp_path / "c.json"), *extra])
    args.validate(args)
    with pytest.raises(_Reached) as reached:
        args.func(args)
    return reached.value.args


def test_the_default_check_adds_the_batch_stage_and_batch_1_says_it_ran_none(tmp_path, monkeypatch, capsys):
    settings, extra = _check_args(tmp_path, monkeypatch)
    assert settings.batch == 1 and len(extra) == 2  # the batch stage, the served build
    one, extra_one = _check_args(tmp_path, monkeypatch, "--batch", "1")
    assert one.batch == 1 and len(extra_one) == 2
    bf16 = ParityStage(backend="cpu", tp=2, dtype="bfloat16")
    skipped = extra_one[0].run(checkpoint=None, fp32=None, bf16=bf16)  # --batch 1: no model work, a stage that says why it did not run
    assert skipped.stage == "batch" and not skipped.ran and skipped.passed
    assert "--batch 1" in skipped.describe() and skipped.to_json()["ran"] is False
    four, extra_four = _check_args(tmp_path, monkeypatch, "--batch", "4")
    assert four.batch == 4 and len(extra_four) == 1  # the stages themselves run the batch


def _default_check(tmp_path, model: str = "tiny") -> tuple[int, dict]:
    out = tmp_path / "check.json"
    rc = main(["check", "--model", model, "--json", str(out)])
    return rc, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("fault", BATCH_CATALOG, ids=lambda f: f.name)
def test_every_batch_fault_fails_the_default_check_naming_the_sequence(fault, tmp_path, monkeypatch, capsys):
    """No --batch: the batch-1 stages pass (a batch fault needs a batch), the batch stage fails, and
    its first failure names a sequence the fault can break."""
    fault.inject(monkeypatch)
    rc, payload = _default_check(tmp_path, f"tiny-{fault.variant}" if fault.variant else "tiny")
    printed = capsys.readouterr().out
    assert rc == 1 and payload["failed_stages"] == ["batch"], printed[-3000:]
    first = payload["first_failure"]
    assert first["stage"] == "batch" and first["where"].startswith("prompt "), first
    assert int(first["where"].split()[1]) in DEFAULT_CHECK_SEQUENCES[fault.name], first
    assert "PARITY FAIL (stage batch)" in printed


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "tiny-e2b", "tiny-e4b", "tiny-31b", "tiny-26b-a4b"])
def test_a_healthy_port_passes_the_default_check_with_its_batch_stage(model, tmp_path, capsys):
    rc, payload = _default_check(tmp_path, model)
    assert rc == 0, capsys.readouterr().out[-3000:]
    batch = payload["extra_stages"]["batch"]
    assert batch["ran"] and batch["passed"] and batch["slots"] == 4 and batch["admission_order"] == [4, 3, 2, 1, 0]
    assert len(batch["prompts"]) == len(payload["prompts"]) == 5
    # no reference run again: on cpu a row of the batch is batch 1's bit for bit, so the bf16 stage's
    # routing and per-layer input pins (E2B/E4B) hold for the batch as they are
    assert batch["references_rerun"] == [], batch["stage_notes"]
    assert any("per-layer input pins" in n for n in batch["notes"]) == (model in ("tiny-e2b", "tiny-e4b")), batch["notes"]


def test_the_batch_stage_keeps_the_bf16_stages_pins_and_re_pins_only_a_value_it_does_not_share():
    """forced_path.seed_pins: pins the references already hold stay (no reference runs again) where
    this run's value is the same; a differing value is taken from this run and reported."""
    import torch

    from harness.parity.forced_path import seed_pins
    from harness.reference.forcing import Forced

    prefill = torch.arange(12.0).reshape(3, 4)  # per_layer_input of layer 1: 3 prefill rows, 1 decode step
    step = torch.full((1, 4), 7.0)
    run = SimpleNamespace(forced=SimpleNamespace(prefill=SimpleNamespace(captures={"layers.1.per_layer_input": prefill}),
                                                 step_captures={"layers.1.per_layer_input": step}))
    shared = [{1: {0: prefill[0].clone(), 3: step[0].clone()}}]
    forcing = [Forced()]
    assert seed_pins(forcing, shared, [run]) == [] and torch.equal(forcing[0].inputs[1][3], step[0])
    other = [{1: {2: prefill[2] + 1e-6}}]  # another run's value, one rounding away
    forcing = [Forced()]
    assert seed_pins(forcing, other, [run]) == ["layer 1 prompt 0 position 2"]
    assert torch.equal(forcing[0].inputs[1][2], prefill[2])
    assert seed_pins([Forced()], None, [run]) == []


def test_a_family_decoders_reset_forgets_the_kv_read_length():
    """The local verdicts run a layer alone after reset_cache (harness/parity/local.py). The family's
    decoder kept the last call's KV bucket there, so after a run whose last call read 16 slots a
    64-token layer run lost its keys past 16 (seen as every attention layer failing alone in
    `check --batch 4 --model tiny-31b` once the prompts were admitted longest first); the 12B's forgot it."""
    from harness.backends import make_backend
    from harness.inputs.checkpoint import Checkpoint
    from harness.inputs.tiny import TINY_FAMILY, tiny_checkpoint

    backend = make_backend(Checkpoint.open(tiny_checkpoint(0, TINY_FAMILY["31b"])), RunSettings(tp=1, buckets=(16,),
                                                                                                 kv_len=64))
    module = backend.ranks[0]
    module.set_kv_read(16)
    module.reset_cache()
    caches = [layer.self_attn.cache for layer in module.layers if getattr(layer.self_attn, "cache", None) is not None]
    assert caches and all(cache.read_len is None for cache in caches)
