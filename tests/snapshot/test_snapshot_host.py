"""Host-step snapshots (docs/snapshot.md): a check failure no layer point shows, replayed through the
port's own host code on the recorded inputs (harness/snapshot/host.py). Here: one host fault end to
end, bad host-step snapshots refused, a clean one replaying to 0, a raise inside the device call
refused. Every other fault caught at no layer point (the embedding lookup, the reported tokens, the
softcap faults, the head's logits, the step that raised), planted and removed, is in the slow
lane's catalog test (tests/snapshot/test_snapshot_catalog.py)."""

from __future__ import annotations

import pytest

from harness.base.errors import OptionError
from harness.base.settings import RunSettings
from tests.faults.catalog import BY_NAME, TINY, engine_options
from tests.snapshot.support import planned_and_written, run_repro, snapshot_flow

SETTINGS = RunSettings(**engine_options(TINY))


def test_a_host_probability_fault_snapshots_replays_and_its_repro_exits_1(tiny0_ckpt, tiny0_reference, tmp_path):
    """host-probabilities-uncapped (the host serves softmax of the raw logits): the snapshot is the
    host step (the device's worst raw logits row -> the served distribution), replayed through
    Engine.probabilities to the check's own ratio with the fault planted and agreeing without it;
    the repro (harness unimportable) exits 1, its plain reading agreeing; the plan is what was written."""
    flow = snapshot_flow(BY_NAME["host-probabilities-uncapped"], tiny0_ckpt, tiny0_reference, SETTINGS,
                         tmp_path / "snap", tmp_path / "repro", fp32=False)
    target = flow.manifest["target"]
    assert target["host"] == "probabilities" and target["failing"] and target["graph_tag"] == "host_probabilities"
    failing = next(p for p in flow.result.bf16.probabilities if not p.passed)
    planted, clean = flow.replays[("cpu", "whole", True)], flow.replays[("cpu", "whole", False)]
    assert planted.reproduces and f"ratio {failing.ratio:.3g}" in planted.failure, planted.describe()
    assert not clean.reproduces, clean.describe()
    planned, written = planned_and_written(tmp_path / "snap", flow.manifest)
    assert abs(planned - written) <= 0.1 * written, (planned, written)
    done = run_repro(tmp_path / "repro", tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "plain reading: agrees" in done.stdout and "port's recorded probabilities: FAILS" in done.stdout


@pytest.fixture(scope="module")
def embed_snapshot(tmp_path_factory, tiny0_ckpt, tiny0_reference):
    """A clean embed host-step snapshot of prompt 1's rows, recorded from the references alone (the
    port's rows are the bf16 reference's: what a clean lookup gives)."""
    import torch

    from harness.snapshot.host import embedding_row_ids
    from harness.snapshot.target import Target
    from harness.snapshot.write import write_snapshot

    settings = RunSettings(buckets=(64, 256), kv_len=288)
    prompt = tiny0_reference["bfloat16"][1].prompt
    ids = torch.tensor(prompt, dtype=torch.long)
    row_ids = embedding_row_ids(tiny0_ckpt.spec, ids)
    ref = tiny0_reference["bfloat16"][1].captures["embeddings"]
    tensors = {"host.ids": ids, "host.row_ids": row_ids, "host.rows": tiny0_ckpt.embed_weight(torch.bfloat16)[row_ids],
               "host.port": ref.clone(), "host.ref": ref.clone()}
    target = Target(stage="bf16", point="embeddings", layer=-1, ratio=0.0, failing=True, prompt=1, position=0,
                    start=0, length=len(prompt), bucket=64, host="embed")
    out = tmp_path_factory.mktemp("host") / "s"
    write_snapshot(out, tiny0_ckpt, settings, target, tensors, source="test", say=lambda line: None)
    return out


def _respoil(path, change) -> None:
    """Rewrite the tensors through `change` and reseal everything a forger who knows the format would."""
    import json

    from safetensors.torch import load_file, save_file

    from harness.inputs.checkpoint import sha256_file
    from harness.inputs.sealed import tensor_digest
    from harness.snapshot.fields import SNAPSHOT

    tensors = change(load_file(str(path / SNAPSHOT.tensors)))
    save_file(tensors, str(path / SNAPSHOT.tensors))
    manifest = json.loads((path / SNAPSHOT.manifest).read_text())
    manifest["tensors"] = {n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                               "sha256": tensor_digest(t)} for n, t in tensors.items()}
    manifest["tensors_sha256"] = sha256_file(path / SNAPSHOT.tensors)
    manifest[SNAPSHOT.seal_key] = SNAPSHOT.seal(manifest, manifest["tensors_sha256"])
    (path / SNAPSHOT.manifest).write_text(json.dumps(manifest))


def _other_rows(t):
    t["host.rows"] = t["host.rows"].clone()
    t["host.rows"][0] += 1
    return t


HOST_CASES = {"rows-of-another-checkpoint": (_other_rows, "not the checkpoint's rows"),
              "a-tensor-dropped": (lambda t: {k: v for k, v in t.items() if k != "host.ref"}, "lacks host.ref"),
              "layer-weights-added": (lambda t: dict(t, **{"weights.r0.x": torch_ones()}), "holds layer weights")}


def torch_ones():
    import torch

    return torch.ones(2)


@pytest.mark.parametrize("case", list(HOST_CASES))
def test_a_bad_host_snapshot_exits_2_before_any_work(case, embed_snapshot, tmp_path, monkeypatch, capsys):
    """Resealed host-step snapshots (rows not the checkpoint's, a needed tensor dropped, layer
    weights added) exit 2 naming the problem, before the host step runs; `--layer` on a host step too."""
    import shutil

    from harness.cli import main
    from harness.snapshot import host_replay

    spoil, fragment = HOST_CASES[case]
    path = shutil.copytree(embed_snapshot, tmp_path / "copy")
    _respoil(path, spoil)

    def no_work(*args, **kwargs):
        raise AssertionError("the host step ran on a bad snapshot")

    monkeypatch.setattr(host_replay, "replay_host", no_work)
    assert main(["replay", str(path)]) == 2
    assert fragment in capsys.readouterr().err


def test_the_clean_host_snapshot_replays_to_0_and_layer_is_refused(embed_snapshot, capsys):
    """Control for the cases above: the clean embed snapshot (its plan within 10% of what was written)
    replays to 0 on cpu and xla (host code: the same on every backend, nothing built); --layer is
    refused (exit 2)."""
    from harness.cli import main

    import json

    manifest = json.loads((embed_snapshot / "snapshot.json").read_text())
    planned, written = planned_and_written(embed_snapshot, manifest)
    assert abs(planned - written) <= 0.1 * written, (planned, written)
    assert main(["replay", str(embed_snapshot), "--backend", "cpu,xla"]) == 0
    out = capsys.readouterr().out
    assert out.count("agrees: all 24 rows bit-exact") == 2, out
    assert main(["replay", str(embed_snapshot), "--layer", "0"]) == 2
    assert "no layer is behind it" in capsys.readouterr().err


def test_a_raise_inside_the_device_call_is_refused(tiny0_ckpt, tiny0_reference, monkeypatch):
    """An exception raised inside backend.forward (the device call, here the cpu backend's decode
    past position 31) is no host step: recording it is refused (exit 2), naming the exception."""
    from types import SimpleNamespace

    from harness.backends import cpu
    from harness.snapshot.host_raises import find_raise

    original = cpu.CpuBackend.forward

    def forward(self, inputs_embeds, positions, *args, **kwargs):
        if positions.shape[1] == 1 and int(positions[0, 0]) >= 32:
            raise RuntimeError("device fault past 32")
        return original(self, inputs_embeds, positions, *args, **kwargs)

    monkeypatch.setattr(cpu.CpuBackend, "forward", forward)
    refs = SimpleNamespace(fp32=tiny0_reference["float32"][:3])
    with pytest.raises(OptionError, match="raises inside its device call \\(RuntimeError: device fault past 32"):
        find_raise(tiny0_ckpt, SETTINGS.but(tp=1), refs)
