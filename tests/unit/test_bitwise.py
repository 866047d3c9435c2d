"""The bit-exact layer stage (harness/judge/bitwise.py, harness/parity/layer_bits.py): the tiny 12B's
port alone at TP 1 reproduces transformers' bf16 layers bit for bit; a rounding earlier than the model
fails where it starts, one later is flagged as over-precision there; the verdict on synthetic points.
The cheap default-lane siblings of tests/faults/test_precision_faults.py (slow) and of the census's
measurement (`python -m tests.census.bitwise`)."""

from __future__ import annotations

import pytest
import torch

from harness.judge.bitwise import DEPARTURE_LIMIT, BitwiseStage, point_bits
from harness.parity.layer_bits import bitwise_layers
from tests.faults.precision import gelu_in_bf16_steps, mlp_activation_fp32


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


def test_point_bits_counts_departures_and_reads_their_direction():
    g = torch.Generator().manual_seed(0)
    ref32 = torch.randn(40, 64, generator=g)
    ref16 = _bf16(ref32 + 0.01 * torch.randn(40, 64, generator=g))
    same = point_bits("layers.0.attn_residual", ref16.clone(), ref16, ref32)
    assert same.differing == 0 and not same.departs and same.departing_r is None
    closer = point_bits("layers.0.attn_residual", _bf16(ref32), ref16, ref32)  # the port rounds later: nearer fp32
    assert closer.departs and closer.departing_r < 1
    farther = point_bits("layers.0.attn_residual", _bf16(ref16 + 2 * (ref16 - ref32)), ref16, ref32)
    assert farther.departs and farther.departing_r > 1 and farther.max_ulps >= 1
    kept_fp32 = point_bits("layers.0.attn_residual", ref16 + 1e-4 * ref16.abs(), ref16, ref32)
    assert kept_fp32.fraction > 0.9  # a value bf16 cannot hold departs, whatever its rounding


def test_stage_fails_an_earlier_rounding_and_flags_a_later_one_where_each_starts():
    g = torch.Generator().manual_seed(1)
    ref32 = torch.randn(40, 64, generator=g)
    ref16 = _bf16(ref32 + 0.01 * torch.randn(40, 64, generator=g))
    exact = point_bits("layers.0.attn_residual", ref16, ref16, ref32)
    late = point_bits("layers.0.mlp_residual", _bf16(ref32), ref16, ref32)
    early = point_bits("layers.1.attn_residual", _bf16(ref16 + 2 * (ref16 - ref32)), ref16, ref32)
    carried = point_bits("layers.1.mlp_residual", _bf16(ref32), ref16, ref32)  # after the start: not judged again
    stage = BitwiseStage(points=[exact, late, early, carried])
    assert [(p.name, later) for p, later in stage.starts()] == [("layers.0.mlp_residual", True),
                                                                 ("layers.1.attn_residual", False)]
    assert not stage.passed and stage.failures()[0]["point"] == "layers.1.attn_residual"
    assert [o.point for o in stage.over_precision] == ["layers.0.mlp_residual"]
    assert "over-precision" in stage.describe() and stage.to_json()["failures"]
    # a few elements off (a tie broken the other way) is no departure
    few = ref16.clone()
    few.view(-1)[: int(DEPARTURE_LIMIT * few.numel())] += 1.0
    assert BitwiseStage(points=[point_bits("layers.0.output", few, ref16, ref32)]).passed


@pytest.fixture(scope="module")
def tiny_golden(tiny0_reference):
    return tiny0_reference["float32"][:2]  # two prompts bound the cost


class _Engine:
    """What the stage reads of an engine: its settings (a bf16 port; it builds its own TP 1 port)."""

    from harness.base.settings import RunSettings

    settings = RunSettings(tp=2)


@pytest.mark.parametrize("inject, start, later", [(None, None, None),
                                                  (gelu_in_bf16_steps, "layers.0.mlp_residual", False),
                                                  (mlp_activation_fp32, "layers.0.mlp_residual", True)],
                         ids=["healthy", "gelu-bf16-steps", "mlp-activation-fp32"])
def test_tiny_port_is_bit_exact_alone_and_a_rounding_moved_departs(monkeypatch, tiny0_ckpt, tiny_golden, inject,
                                                                   start, later):
    if inject is not None:
        inject(monkeypatch)
    stage = bitwise_layers(tiny0_ckpt, _Engine(), tiny_golden)
    assert len(stage.points) == 3 * tiny0_ckpt.spec.num_layers and not stage.skipped
    if inject is None:
        assert all(p.differing == 0 for p in stage.points) and stage.passed, stage.describe()
        return
    first, first_later = stage.starts()[0]
    assert (first.name, first_later) == (start, later), stage.describe()
    assert first.fraction > 10 * DEPARTURE_LIMIT and stage.passed == later


def test_an_exception_inside_the_layers_alone_is_the_stages_failure(monkeypatch, tiny0_ckpt):
    """The stage as the parity run executes it: an exception raised by the port's layers alone is
    this stage's named failure (its JSON says where), not a crash of the check; no local verdicts: no stage."""
    from types import SimpleNamespace

    from harness.parity import layer_bits

    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(layer_bits, "bitwise_layers", broken)
    stage = layer_bits.bitwise_layers_stage()
    bf16 = SimpleNamespace(port_error=None, local=[object()], observation=SimpleNamespace(ref32=[]), reference_layers=None)
    out = stage.run(checkpoint=tiny0_ckpt, engine=None, bf16=bf16).seal()
    assert not out.passed and out.ran and "planted" in str(out.to_json()["error"])
    assert [g.name for g in out.all_gates()] == ["error"] and "FAIL" in out.describe()
    assert stage.run(checkpoint=tiny0_ckpt, engine=None, bf16=SimpleNamespace(port_error=None, local=None)) is None


def test_the_bitwise_stage_reads_the_local_verdicts_reference_runs_and_releases_them(tiny0_ckpt, monkeypatch):
    """transformers' layers as the local verdicts ran them reach bitwise_layers (their kept runs on the
    same inputs are not run again), and are released after the stage."""
    from types import SimpleNamespace

    from harness.parity import layer_bits

    seen, released = [], []
    kept = SimpleNamespace(release=lambda: released.append(True))
    monkeypatch.setattr(layer_bits, "bitwise_layers", lambda ckpt, engine, refs, reference=None: seen.append(reference)
                        or layer_bits.BitwiseStage())
    bf16 = SimpleNamespace(port_error=None, local=[], observation=SimpleNamespace(ref32=[]), reference_layers=kept)
    layer_bits.bitwise_layers_stage().run(checkpoint=tiny0_ckpt, engine=None, bf16=bf16)
    assert seen == [kept] and released == [True]
