"""`check` judges the served build too (issue 20): the perf build bench times runs free greedy
decode and is judged against the reference (flips classified like any flip) and the parity
build's own tokens; a fault only in the perf build fails `check` naming the served build."""

from __future__ import annotations

import json
import math

import pytest
import torch

from harness.base.settings import RunSettings
from harness.judge.compare import BF16, FP32
from harness.parity.served import SKIPPED_NOTE, check_served_build, judge_served
from harness.reference.run import ReferenceResult
from tests.parity import served_faults
from harness.judge.stage_result import Ties
from harness.parity.batched import BatchStage

CPU = RunSettings(backend="cpu", buckets=(64, 256), kv_len=256)
SHORT_PROMPTS = [[2, 17, 93, 41, 250, 8, 77], [2] + list(range(30, 53))]  # two default-sized prompts


def test_cpu_served_build_runs_says_it_is_the_same_code_and_passes(tiny0_ckpt, tiny0_reference):
    ref32, ref16 = tiny0_reference["float32"], tiny0_reference["bfloat16"]
    result = check_served_build(tiny0_ckpt, ref32, ref16, None, settings=CPU)
    assert result.ran and result.same_code and not result.last_row_only
    assert "same code as the parity build" in result.describe()
    assert result.passed, result.failures()
    assert [p.tokens for p in result.prompts] == [r.generated for r in ref32]  # SEQ_MATCH on the tiny model
    # every step of every prompt judged (the prefix stays the reference's), within the envelope
    assert result.step_logits.passed and len(result.row_labels) == sum(len(r.generated) for r in ref32)
    payload = result.to_json()
    assert payload["built_by"].startswith("harness.perf.bench.perf_engine") and payload["failures"] == []


def test_cpu_perf_only_fault_fails_naming_the_served_build(tiny0_ckpt, tiny0_reference, monkeypatch):
    served_faults.cpu_perf_engine_off_by_one(monkeypatch)
    ref32, ref16 = tiny0_reference["float32"], tiny0_reference["bfloat16"]
    parity_tokens = type("P", (), {"prompts": [type("O", (), {"device_tokens": r.generated})() for r in ref32],
                                   "calibration": None})()
    result = check_served_build(tiny0_ckpt, ref32, ref16, parity_tokens, settings=CPU)
    assert not result.passed
    failures = result.failures()
    assert {f["stage"] for f in failures} == {"served"}
    assert failures[0]["point"] == "served build step logits" and failures[0]["where"].startswith("prompt 0 step 0")
    tokens = [f for f in failures if f["point"] == "served build token"]
    assert tokens and "the served build differs from the judged build at prompt" in tokens[0]["where"]


def _ref(prompt, generated, step_logits) -> ReferenceResult:
    capped = torch.tanh(step_logits / 30.0) * 30.0
    return ReferenceResult(prompt, "float32", {"step_capped_logits": capped}, generated, step_logits)


def _run(tokens, step_logits):
    return type("Run", (), {"tokens": tokens, "step_logits": step_logits})()


def test_a_near_tie_flip_is_accounted_and_reported_as_a_build_difference():
    """The served build takes the runner-up where the reference's margin is inside the band: a
    near tie (passes), and a difference from the parity build, reported as such."""
    ref_rows = torch.tensor([[5.0, 4.99, 0.0, -1.0], [0.0, 0.0, 6.0, 1.0]])
    ref = _ref([1, 2], [0, 2], ref_rows)
    served = ref_rows.clone()
    served[0, 1] = 5.01  # runner-up by 0.01: inside a band of 0.05
    prompts, point, labels = judge_served([_run([1, 2], served)], [ref], [ref], [[0, 2]], Ties(BF16, 0.05))
    assert prompts[0].departure.kind == "near_tie" and prompts[0].accounted
    assert prompts[0].differs_from_parity_at == 0 and labels == ["prompt 0 step 0 (position 1)"]


def test_a_wide_flip_is_a_divergence_and_fails():
    ref_rows = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    ref = _ref([1], [0], ref_rows)
    served = torch.tensor([[0.0, 6.0, 0.0, -1.0]])
    prompts, point, _ = judge_served([_run([1], served)], [ref], [ref], None, Ties(BF16, 0.05))
    assert prompts[0].departure.kind == "divergence" and not prompts[0].accounted
    assert prompts[0].differs_from_parity_at is None  # no parity tokens given


def test_a_flip_among_saturated_capped_maxima_is_a_saturation_tie():
    ref_rows = torch.tensor([[900.0, 899.0, 0.0]])  # capped at 30: both tanh to exactly 30.0 in fp32
    ref = _ref([1], [0], ref_rows)
    served = torch.tensor([[899.0, 900.0, 0.0]])
    prompts, _, _ = judge_served([_run([1], served)], [ref], [ref], [[0]], Ties(FP32, 0.0))
    assert prompts[0].departure.kind == "saturation_tie" and prompts[0].accounted
    assert "softcap saturates" in prompts[0].departure.evidence


def test_a_tie_on_a_model_without_softcap_does_not_blame_the_softcap():
    """No softcap: the capped logits are the raw ones, so the only tie is an exact one; the
    explanation says so and never mentions a softcap (issue 45)."""
    rows = torch.tensor([[5.0, 5.0, 0.0]])
    ref = ReferenceResult([1], "float32", {"step_capped_logits": rows.clone()}, [0], rows)
    prompts, _, _ = judge_served([_run([1], torch.tensor([[4.0, 6.0, 0.0]]))], [ref], [ref], [[0]], Ties(FP32, 0.0))
    departure = prompts[0].departure
    assert departure.kind == "saturation_tie" and prompts[0].accounted
    assert "softcap" not in departure.evidence and "exactly" in departure.evidence


def test_skip_says_so():
    result = check_served_build(None, [], [], None, skip=True)
    assert not result.ran and result.passed and result.notes == [SKIPPED_NOTE]
    assert "--skip-served-build" in result.describe() and result.to_json()["ran"] is False


@pytest.mark.slow  # the default lane's sibling: test_cpu_perf_only_fault_fails_naming_the_served_build
def test_check_cli_fails_on_a_perf_only_fault_and_skip_served_build_says_so(tmp_path, monkeypatch, capsys):
    """Through the command: exit 1, the failed stage is "served" and the first failure names it;
    with --skip-served-build the same run passes and the result says the served build was skipped."""
    from harness.cli import main

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(SHORT_PROMPTS))
    served_faults.cpu_perf_engine_off_by_one(monkeypatch)
    common = ["check", "--model", "tiny", "--prompts", str(prompts), "--new-tokens", "3", "--skip-fp32-stage",
              "--buckets", "64"]
    out = tmp_path / "fail.json"
    assert main(common + ["--json", str(out)]) == 1
    printed = capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert payload["failed_stages"] == ["served"] and payload["first_failure"]["stage"] == "served"
    assert "served build (cpu, all rows): FAIL" in printed and "PARITY FAIL (stage served)" in printed
    assert payload["stages"]["bf16"]["passed"]  # the parity build itself is healthy
    skipped = tmp_path / "skip.json"
    assert main(common + ["--skip-served-build", "--json", str(skipped)]) == 0
    payload = json.loads(skipped.read_text())
    assert payload["extra_stages"]["served"]["ran"] is False and payload["extra_stages"]["served"]["notes"] == [SKIPPED_NOTE]
    assert "--skip-served-build" in capsys.readouterr().out


def test_nonfinite_served_logits_fail(tiny0_ckpt, tiny0_reference, monkeypatch):
    """A served build whose logits are NaN fails the envelope (never a silent pass)."""
    from harness.perf import bench

    original = bench.perf_engine

    def nan_engine(*args, **kwargs):
        engine = original(*args, **kwargs)
        forward = engine.backend.forward
        def nan_forward(*a, **kw):
            logits, captures = forward(*a, **kw)
            return logits * math.nan, captures

        engine.backend.forward = nan_forward
        return engine

    monkeypatch.setattr(bench, "perf_engine", nan_engine)
    ref32, ref16 = tiny0_reference["float32"][:1], tiny0_reference["bfloat16"][:1]
    result = check_served_build(tiny0_ckpt, ref32, ref16, None, settings=CPU)
    assert not result.passed and not result.step_logits.finite


def test_the_parity_build_is_released_before_an_extra_stage_builds_its_own(tiny0_ckpt, monkeypatch):
    """A device holds one build at a time: two builds of the 12B do not fit one inf2 chip's HBM, so
    `run_parity_check` drops its parity engine before the served build (an extra stage) is made."""
    import gc
    import weakref

    from harness.parity import check as parity

    from harness.judge.stage_result import Stage

    built = []
    real_build = parity.build_port
    monkeypatch.setattr(parity, "build_port", lambda *a, **k: built.append(real_build(*a, **k)) or built[-1])
    seen = []

    def extra(checkpoint):
        gc.collect()
        seen.append(refs[0]() is None)
        return BatchStage(ran=False, notes=["a stand-in stage"])

    refs = []

    def bf16(run, checkpoint, engine, references, fp32=None):  # a stand-in bf16 stage on the parity build
        refs.append(weakref.ref(engine))
        built.clear()
        return parity.ParityStage("cpu", 1, "bfloat16")

    monkeypatch.setattr(parity, "parity_stages", lambda *a, **k: (
        Stage("bf16", bf16, ("run", "checkpoint", "engine", "references"), after=("fp32",)),))
    parity.run_parity_check(tiny0_ckpt, tiny0_ckpt.path, CPU, prompts=[[2, 17, 93]], new_tokens=1,
                            fp32_stage=False, stages=(Stage("batch", extra),))
    assert seen == [True], "the parity engine was still alive when the extra stage ran"


def test_check_batch_serves_the_prompts_as_a_batch_on_the_perf_build(tiny0_ckpt, tiny0_reference, monkeypatch):
    """`check --batch 2`'s served stage: the perf build serves the prompts as the sequences of a batch
    (the 7-id prompt in the slot the 40-id one left) and passes; a fault only a batch shows (a row's
    padded keys visible in a call of several rows) fails it naming a sequence of the shared call."""
    from tests.faults.batch_faults import pad_keys_visible

    ref32, ref16 = tiny0_reference["float32"][:3], tiny0_reference["bfloat16"][:3]  # 7, 24 and 40 ids
    batched = CPU.but(batch=2)
    result = check_served_build(tiny0_ckpt, ref32, ref16, None, settings=batched)
    assert result.passed and result.batch == 2, result.failures()
    assert [p.tokens for p in result.prompts] == [r.generated for r in ref32]
    assert any("a batch of 2 sequences" in n for n in result.notes) and result.to_json()["batch"] == 2
    assert "a batch of 2 sequences): PASS" in result.describe()
    pad_keys_visible(monkeypatch)
    broken = check_served_build(tiny0_ckpt, ref32, ref16, None, settings=batched)
    assert not broken.passed and broken.failures()[0]["where"].split()[:2] in (["prompt", "1"], ["prompt", "2"])


def test_a_backend_without_a_batched_perf_build_serves_one_prompt_at_a_time_and_says_so(tiny0_ckpt, tiny0_reference,
                                                                                         monkeypatch):
    """The guard is the backend's own refusal (as xla refused before it had a batched perf build), not
    its name: the served stage then runs the batch-1 perf build one prompt at a time and notes why."""
    from harness.base.errors import HarnessInputError
    from harness.perf import bench

    original = bench.perf_engine

    def no_batched_perf_build(checkpoint, settings):
        if settings.batch > 1:
            raise HarnessInputError(f"--batch {settings.batch}: no batched perf build here")
        return original(checkpoint, settings)

    monkeypatch.setattr(bench, "perf_engine", no_batched_perf_build)
    ref32, ref16 = tiny0_reference["float32"][:2], tiny0_reference["bfloat16"][:2]
    result = check_served_build(tiny0_ckpt, ref32, ref16, None, settings=CPU.but(batch=2))
    assert result.passed and result.batch == 1, result.failures()
    assert any(n.startswith("--batch 2: the perf build served one prompt at a time (--batch 2: no batched")
               for n in result.notes), result.notes
