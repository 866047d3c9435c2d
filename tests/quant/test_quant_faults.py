"""The faults of a quantized port (tests/faults/quant_catalog.py), each injected into the int8 port
and judged by the structural check against the quantized model: each fails the fp32 structural
stage first at its point; the one reordering exact in real arithmetic passes."""

from __future__ import annotations

import pytest
import torch

from harness.backends import build_engine
from harness.base.settings import RunSettings
from harness.parity.check import check_port
from tests.faults.quant_catalog import BY_NAME, QUANT_FAULTS
from tests.quant.conftest import QUICK

DEFAULT_LANE = ("zero-point",)  # about 3 CPU-seconds a fault; the rest in the slow lane


def _check(fault, monkeypatch, ckpt, refs):
    fault.inject(monkeypatch)
    engine = build_engine(ckpt, RunSettings(tp=fault.tp, quantize="int8", **QUICK))
    return check_port(ckpt, engine, refs["float32"], refs["bfloat16"], local=False)


@pytest.mark.parametrize("fault", [pytest.param(f, id=f.name, marks=() if f.name in DEFAULT_LANE else pytest.mark.slow)
                                   for f in QUANT_FAULTS if f.equivalent is None])
def test_quant_fault_fails_the_structural_stage_at_its_point(fault, monkeypatch, int8_ckpt, int8_reference):
    result = _check(fault, monkeypatch, int8_ckpt, int8_reference)
    assert not result.passed and not result.fp32.passed
    failing = [p.name for p in result.fp32.all_points() if result.fp32.point_failed(p)]
    assert failing and failing[0] == fault.first_point, failing[:4]


@pytest.mark.slow  # default-lane sibling: test_quant_fault_fails_the_structural_stage_at_its_point[zero-point]
def test_exact_reordering_passes_but_changes_the_numbers(monkeypatch, int8_ckpt, int8_reference):
    """Scaling after the matmul is exact in real arithmetic for per-output-channel scales: the judge
    passes it, though it did change the port's rounding (so the injection ran)."""
    fault = BY_NAME["dequantize-after-matmul"]
    clean = build_engine(int8_ckpt, RunSettings(tp=1, quantize="int8", **QUICK))
    embeds = torch.randn(1, 7, int8_ckpt.spec.hidden_size).to(torch.bfloat16)
    positions = torch.arange(7)[None]
    before = clean.backend.forward(embeds, positions)[0]
    result = _check(fault, monkeypatch, int8_ckpt, int8_reference)
    assert result.passed, fault.equivalent
    after = build_engine(int8_ckpt, RunSettings(tp=1, quantize="int8", **QUICK)).backend.forward(embeds, positions)[0]
    assert not torch.equal(before, after)


def test_catalog_names_every_fault_of_the_issue():
    assert {f.name for f in QUANT_FAULTS} == {"scales-of-other-rank", "transposed-scales", "channel-axis-swapped",
                                              "zero-point", "dequantize-after-matmul", "lm-head-quantized",
                                              "truncating-rounding"}
    assert all(f.first_point is None for f in QUANT_FAULTS if f.equivalent)


def _family_cases():
    """Every fault the check must fail, each on one family variant in turn, so each variant gets
    at least one (the tiny 12B takes every fault in the test above)."""
    from tests.family.shared import VARIANTS

    faults = [f for f in QUANT_FAULTS if f.equivalent is None]
    return [pytest.param(f"tiny-{VARIANTS[i % len(VARIANTS)]}", f, id=f"{VARIANTS[i % len(VARIANTS)]}-{f.name}")
            for i, f in enumerate(faults)]


@pytest.mark.slow  # ~3 CPU-seconds a case beside the variant's golden; default-lane sibling: the zero-point case above
@pytest.mark.parametrize("model, fault", _family_cases())
def test_quant_fault_fails_check_on_the_family_at_its_point(model, fault, monkeypatch, int8_golden, tmp_path):
    """The same faults through `check --quantize int8` on the family's variants (MoE, per-layer
    inputs, KV sharing): the fp32 stage fails first, at the fault's point."""
    from tests.quant.matrix import check_int8

    golden = int8_golden(model)
    fault.inject(monkeypatch)
    rc, payload = check_int8(model, "cpu", fault.tp, golden, tmp_path / "check.json")
    assert rc == 1 and not payload["passed"] and not payload["stages"]["fp32"]["passed"]
    first = payload["first_failure"]
    assert (first["stage"], first["point"]) == ("fp32", fault.first_point), first


@pytest.mark.slow  # two checks through the double (~10 CPU-seconds); default-lane sibling: the zero-point case above
@pytest.mark.parametrize("name", ["zero-point", "scales-of-other-rank"])
def test_quant_fault_fails_check_through_the_double_at_its_point(name, monkeypatch, int8_golden, tmp_path, nxd):
    """The neuron backend's projections are the same QuantizedProjections (harness/backends/neuron_layers.py):
    a fault in them fails `check --backend neuron --quantize int8` at the same point, in the fp32
    stage (which runs on the host: harness/parity/observe.py fp32_settings) and in the bf16 stage the
    double ran."""
    from tests.quant.matrix import check_int8

    fault, golden = BY_NAME[name], int8_golden("tiny")
    fault.inject(monkeypatch)
    rc, payload = check_int8("tiny", "neuron", 2, golden, tmp_path / "check.json")
    assert rc == 1 and payload["provenance"]["settings"]["run"]["backend"] == "neuron"
    first = payload["first_failure"]
    assert (first["stage"], first["point"]) == ("fp32", fault.first_point), first
    on_device = payload["stages"]["bf16"]
    assert not on_device["passed"] and on_device["failures"][0]["point"] == fault.first_point, on_device["failures"][:3]
