"""A bit-exact snapshot (harness/snapshot/bits.py, docs/snapshot.md): a check whose first failure is
its bit-exact layer stage snapshots the port's layer alone at TP 1 in bf16 on one prompt's rows;
its replay and its standalone repro judge it bit for bit, on the tiny 12B at TP 1. The whole catalog
(this fault included): tests/snapshot/test_snapshot_catalog.py (slow)."""

from __future__ import annotations

import json

import pytest

from harness.base.errors import OptionError
from harness.base.settings import RunSettings
from tests.faults.catalog import BY_NAME, TINY, engine_options
from harness.snapshot.read import SnapshotError
from tests.snapshot.support import planned_and_written, run_repro, snapshot_flow

SETTINGS = RunSettings(**dict(engine_options(TINY), tp=1))


def test_a_bit_exact_failure_replays_and_its_repro_exits_1_and_a_clean_port_agrees(tiny0_ckpt, tiny0_reference,
                                                                                     tmp_path):
    """rmsnorm-no-fp32-upcast: every point within the envelope, but layer 0 alone departs bit for bit
    at its attention residual. The snapshot holds that layer's call (prompt, rows, input, transformers'
    bf16 outputs, the limit); replayed with the fault planted it reproduces, with it removed it agrees;
    the repro (harness unimportable) exits 1, and the same target's repro of the clean port, the
    control, exits 0. (Its first two prompts only: the check's cost is the prompts' rows.) A bit-exact
    snapshot replays on cpu at TP 1 only (others refused, exit 2), and one whose input rows disagree
    with its call, resealed, is refused on read."""
    from harness.judge.bitwise import DEPARTURE_LIMIT
    from harness.snapshot.read import read_snapshot
    from harness.snapshot.replay import check_mode
    from harness.snapshot.repro import write_bits_repro
    from harness.snapshot.target import Target

    fault = BY_NAME["rmsnorm-no-fp32-upcast"]
    references = {dtype: runs[:2] for dtype, runs in tiny0_reference.items()}  # two short prompts: cheap
    flow = snapshot_flow(fault, tiny0_ckpt, references, SETTINGS, tmp_path / "snap", tmp_path / "repro",
                         fp32=False, local=True)
    target = flow.manifest["target"]
    assert (target["stage"], target["point"], target["layer"]) == ("bitwise_layers", "layers.0.attn_residual", 0)
    assert target["ratio"] > DEPARTURE_LIMIT and flow.manifest["departure_limit"] == DEPARTURE_LIMIT
    assert flow.manifest["settings"]["tp"] == 1 and flow.manifest["settings"]["dtype"] == "bfloat16"
    planted, clean = flow.replays[("cpu", "whole", True)], flow.replays[("cpu", "whole", False)]
    assert planted.reproduces and "REPRODUCES: layers.0.attn_residual" in planted.describe()
    assert not clean.reproduces and all(p.differing == 0 for p in clean.points), clean.describe()
    planned, written = planned_and_written(tmp_path / "snap", flow.manifest)
    assert abs(planned - written) <= 0.1 * written, (planned, written)
    assert flow.repro_refused is None, flow.repro_refused
    done = run_repro(tmp_path / "repro", tmp_path)
    assert done.returncode == 1 and "attn_residual" in done.stdout and "FAILS" in done.stdout, done.stdout + done.stderr
    control = Target(**{k: v for k, v in target.items() if k != "graph_tag"})
    write_bits_repro(tiny0_ckpt, SETTINGS, control, flow.result.bf16.observation, tmp_path / "control", say=lambda _: None,
                     prompt=target["prompt"])
    done = run_repro(tmp_path / "control", tmp_path)
    assert done.returncode == 0 and "agrees" in done.stdout, done.stdout + done.stderr
    snap = read_snapshot(tmp_path / "snap")
    for backend, tp in (("xla", 1), ("cpu", 2)):
        with pytest.raises(OptionError, match="on cpu at TP 1"):
            check_mode(snap, backend, "whole", tp)
    _resealed_short_input(tmp_path / "snap")
    with pytest.raises(SnapshotError, match="bits.input has"):
        read_snapshot(tmp_path / "snap")


def _resealed_short_input(path) -> None:
    """bits.input one row short, every digest, shape and seal rewritten (a forger who knows the format):
    refused by the rows check on read."""
    from safetensors.torch import load_file

    from harness.snapshot.fields import SNAPSHOT
    from tests.snapshot.test_bad_snapshots import reseal

    tensors = load_file(str(path / SNAPSHOT.tensors))
    tensors["bits.input"] = tensors["bits.input"][:-1].contiguous()
    manifest = json.loads((path / SNAPSHOT.manifest).read_text())
    manifest["tensors"]["bits.input"]["shape"] = list(tensors["bits.input"].shape)
    (path / SNAPSHOT.manifest).write_text(json.dumps(manifest))
    reseal(path, tensors, digests=True)
