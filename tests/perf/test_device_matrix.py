"""benchmarks/device_matrix.py end to end on CPU through the NxD contract double: the tiny model,
the baseline and one variant, two runs. Each variant is built with its options (checked on the
compiled model), judged by check and by perf compare against the baseline, and the Markdown table
holds one row per variant, the listed-not-yet-available ones included."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from harness.backends import neuron_env

from tests.nxd_double import installed


def _matrix_module():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "device_matrix.py"
    spec = importlib.util.spec_from_file_location("device_matrix", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("device_matrix", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def double(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA_PARITY_NEURON_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    monkeypatch.setenv("GEMMA_PARITY_INSTANCE_TYPE", "inf2.8xlarge")
    # under xdist the core assignment counts the host's cores: an inf2.48xlarge's worth here
    monkeypatch.setattr(neuron_env, "neuron_core_count", lambda: 16)
    with installed(monkeypatch):
        yield


@pytest.mark.slow  # about 11 CPU-seconds: a bench per variant through the double
def test_the_matrix_runs_every_variant_and_writes_one_table(double, tmp_path, monkeypatch, tiny0_ckpt):
    matrix = _matrix_module()
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([list(range(3, 10)), list(range(20, 32))]))
    sinks = []  # the backends each variant built, in variant order
    real = matrix.recording

    def recording(built):
        sinks.append(built)
        return real(built)

    monkeypatch.setattr(matrix, "recording", recording)
    out, js = tmp_path / "matrix.md", tmp_path / "matrix.json"
    rc = matrix.main(["--model", "tiny", "--variants", "reduce-bf16,device-argmax", "--prompts",
                      str(prompts), "--buckets", "16", "--kv-len", "32", "--new-tokens", "3", "--runs", "2",
                      "--warmup", "0", "--out", str(out), "--json", str(js)])
    assert rc == 0
    text = out.read_text().splitlines()
    rows = {line.split("|")[1].strip(): line for line in text[2:]}
    assert list(rows) == ["baseline", "reduce-bf16", "device-argmax"]
    for name in ("baseline", "reduce-bf16"):
        cells = [c.strip() for c in rows[name].split("|")[1:-1]]
        assert cells[8] == "PASS" and float(cells[2]) > 0 and float(cells[3]) > 0
        assert cells[4].endswith("(too few runs)") or "x (" in cells[4]
        assert cells[6].endswith("%") and cells[7].endswith("%")
    assert "not yet available" in rows["device-argmax"]
    # each variant's backends were built with its options: two neuron builds (parity, perf) per variant
    baseline, bf16 = ([be for be in sink if be.name == "neuron"] for sink in sinks)
    assert {be.reduce_dtype for be in baseline} == {torch.float32} and {be.capture for be in baseline} == {True, False}
    assert {be.reduce_dtype for be in bf16} == {torch.bfloat16} and {be.capture for be in bf16} == {True, False}
    saved = json.loads(js.read_text())
    assert [v["variant"] for v in saved["variants"]] == list(rows)
    assert sys.modules.get("harness.backends").make_backend.__name__ == "make_backend"  # put back


def test_unknown_variants_are_refused(double, tmp_path, capsys):
    matrix = _matrix_module()
    assert matrix.main(["--model", "tiny", "--variants", "faster", "--out", str(tmp_path / "m.md")]) == 2
    assert "unknown ['faster']" in capsys.readouterr().err and not (tmp_path / "m.md").exists()


def test_every_variant_is_a_valid_set_of_backend_options():
    """Each variant's options convert through the neuron backend's declared OPTIONS; the per-graph
    flags variant gives the decode graphs their own flags and leaves compiler_args alone."""
    from harness.backends import backend_options

    matrix = _matrix_module()
    for variant in matrix.variants():
        backend_options("neuron", variant.options)
    decode = next(v for v in matrix.variants() if v.name == "decode-dge")
    assert set(decode.options) == {"decode_compiler_args"} and "vector_dynamic_offsets" in decode.options[
        "decode_compiler_args"]
