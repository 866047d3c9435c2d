"""The hostile inputs the last round left open, each refused with exit 2 before any model work, with
no traceback and nothing written; and the data-safety window of `reference --overwrite`: an
interrupt before its commit point leaves the previous golden whole (exit 130), one at or after it
lets the run finish (exit 0, saying so), so a golden is never left replaced by an "interrupted" run."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from harness.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
CONFIG_12B = ROOT / "fixtures" / "configs" / "gemma-4-12b-it.json"
CORPUS = ROOT / "fixtures" / "corpus" / "tiny-20k.json"


def _run(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = cli([str(a) for a in argv])
    except SystemExit as exc:  # argparse's refusal of a value (exit 2, its usage line)
        code = exc.code
    out = capsys.readouterr()
    assert "Traceback" not in out.err and "internal error" not in out.err, out.err
    return code, out.out, out.err


# ---- doctor: a neuron-ls that is not neuron-ls, a dtype no command runs --------------------------

@pytest.mark.parametrize("listing, why", [
    ("'[' * 100_000 + ']' * 100_000", "nested too deeply"),
    ("'[{\"nc_count\": 1e999, \"neuron_device\": 0}]'", "cannot convert float infinity"),
])
def test_doctor_reads_a_hostile_neuron_ls_as_a_failed_check(listing, why, tmp_path, monkeypatch, capsys):
    tool = tmp_path / "neuron-ls"
    tool.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write({listing})\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    code, out, _ = _run(capsys, "doctor")
    assert code == 2
    assert f"FAIL neuron-ls: unreadable --json-output ({why}" in out
    assert "FAIL cores in use: neuron-ls gave no readable listing" in out


def test_doctor_refuses_a_dtype_no_command_runs(capsys):
    code, _, err = _run(capsys, "doctor", "--dtype", "fp16")
    assert code == 2 and "--dtype 'fp16'" in err and "bf16" in err


# ---- bisect on a host without the Neuron SDK ---------------------------------------------------

def test_bisect_refuses_the_neuron_backend_before_building_anything(tmp_path, monkeypatch, capsys):
    from harness.backends import backend_unavailable
    from harness.cli import validate as v

    if backend_unavailable("neuron") is None:
        pytest.skip("this host has the Neuron SDK: the refusal is for a host without it")
    monkeypatch.setattr(v, "port_run_outputs_and_checkpoint", lambda *a, **k: pytest.fail("opened the model"))
    code, _, err = _run(capsys, "bisect", "--model", "tiny", "--golden", tmp_path, "--backend", "neuron",
                        "--json", tmp_path / "b.json")
    assert code == 2 and "the neuron backend cannot run" in err
    assert not (tmp_path / "b.json").exists()


# ---- quality: --shard with the judged pass's outputs; a corpus nested 100,000 levels ------------

@pytest.mark.parametrize("stop", [["--shard", "0/2"], ["--reference-only"]])
@pytest.mark.parametrize("output", ["--json", "--report"])
def test_quality_refuses_judge_outputs_on_a_run_that_stops_before_judging(stop, output, tmp_path, capsys):
    target = tmp_path / ("q.json" if output == "--json" else "report")
    code, _, err = _run(capsys, "quality", "--model", "tiny", "--corpus", CORPUS, "--golden", tmp_path / "g",
                        *stop, output, target)
    assert code == 2 and f"{output} with {stop[0]}" in err and "once every shard is written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_deeply_nested_corpus_is_refused_before_the_model_is_opened(tmp_path, monkeypatch, capsys):
    """Refused from the corpus's shape alone: the tiny-model cache stays empty (nothing built) and no
    golden directory appears."""
    corpus = tmp_path / "deep.json"
    corpus.write_text("[" * 100_000 + "]" * 100_000)
    cache = tmp_path / "cache"
    monkeypatch.setenv("GEMMA_PARITY_CACHE", str(cache))
    code, _, err = _run(capsys, "quality", "--model", "tiny", "--corpus", corpus, "--golden", tmp_path / "g")
    assert code == 2 and "nested too deeply" in err
    assert not (tmp_path / "g").exists() and (not cache.exists() or not any(cache.iterdir()))


# ---- info --perf --instance-rates: the floors at length use the given rates -----------------------

def test_floors_at_length_follow_the_instance_rates(tmp_path, capsys):
    rates = {"cores": 2, "chips": 1, "hbm_bytes": 32 * 2**30, "bf16_flops_per_s": 190e12, "fp32_flops_per_s": 47.5e12}
    rows = {}
    for name, bandwidth in (("full", 820e9), ("tenth", 82e9)):
        (tmp_path / f"{name}.json").write_text(json.dumps({**rates, "hbm_bytes_per_s": bandwidth}))
        out = tmp_path / f"info-{name}.json"
        code, _, _ = _run(capsys, "info", "--config", CONFIG_12B, "--perf", "--instance-rates", tmp_path / f"{name}.json",
                          "--json", out)
        assert code == 0
        rows[name] = json.loads(out.read_text())["floors_at_length"]
    assert [r["context"] for r in rows["full"]] == [r["context"] for r in rows["tenth"]]
    for full, tenth in zip(rows["full"], rows["tenth"]):
        if full["tpot_bound"] == "memory":  # a memory-bound floor scales with the bandwidth exactly
            assert tenth["tpot_ms"] == pytest.approx(10 * full["tpot_ms"], rel=1e-6)
        assert tenth["ttft_ms"] > full["ttft_ms"]


# ---- reference --overwrite: the commit point -------------------------------------------------------

@pytest.fixture(scope="module")
def first_golden(tiny0_dir, tmp_path_factory):
    """A golden of one short prompt and one new token (the cheapest reference run), written once."""
    prompts = tmp_path_factory.mktemp("prompts") / "p.json"
    prompts.write_text("[[5, 6, 7, 8]]")
    out = tmp_path_factory.mktemp("first") / "g"
    assert cli(["reference", "--checkpoint", str(tiny0_dir), "--prompts", str(prompts), "--new-tokens", "1",
                "--out", str(out)]) == 0
    return out, prompts


@pytest.fixture
def old_golden(first_golden, tmp_path, capsys):
    import shutil

    capsys.readouterr()
    out = tmp_path / "g"
    shutil.copytree(first_golden[0], out)
    return out, {p.name: p.read_bytes() for p in out.iterdir()}, first_golden[1]


def _overwrite(tiny0_dir, old) -> list[str]:
    out, _, prompts = old
    return ["reference", "--checkpoint", str(tiny0_dir), "--prompts", str(prompts), "--new-tokens", "2",
            "--out", str(out), "--overwrite"]


def _ctrl_c_then(original):
    def patched(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)
    return patched


@pytest.mark.slow  # a reference run (~3 CPU-s); the default lane's sibling is the swap case below
def test_ctrl_c_before_the_commit_point_keeps_the_previous_golden_whole(tiny0_dir, old_golden, monkeypatch, capsys):
    from harness.inputs import sealed

    out, before, _ = old_golden
    monkeypatch.setattr(sealed, "save_file", _ctrl_c_then(sealed.save_file))
    handler = signal.getsignal(signal.SIGINT)
    code, _, err = _run(capsys, *_overwrite(tiny0_dir, old_golden))
    assert code == 130 and "interrupted; nothing half written was kept" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in out.parent.iterdir()] == ["g"]  # no temp directory left beside it
    assert signal.getsignal(signal.SIGINT) is handler


@pytest.mark.parametrize("where", ["at the swap", pytest.param("after the command returned", marks=pytest.mark.slow)])
# the slow case: a reference run more (~3 CPU-s); its default-lane sibling is the swap case
def test_ctrl_c_at_or_after_the_commit_point_lets_the_run_finish_and_says_so(where, tiny0_dir, old_golden, monkeypatch,
                                                                            capsys):
    import harness.cli as cli_package
    from harness.base import atomic
    from harness.reference.golden import read_golden

    out, before, _ = old_golden
    if where == "at the swap":
        monkeypatch.setattr(atomic, "_rename_into_place", _ctrl_c_then(atomic._rename_into_place))
    else:
        monkeypatch.setattr(cli_package, "release_claims", _ctrl_c_then(cli_package.release_claims))
    handler = signal.getsignal(signal.SIGINT)
    code, out_text, err = _run(capsys, *_overwrite(tiny0_dir, old_golden))
    assert code == 0 and "golden written to" in out_text
    assert "Ctrl-C came after the output was written whole; the run finished (exit 0)" in err
    assert read_golden(out).new_tokens == 2  # the new golden, whole (read_golden verifies its hashes)
    assert {p.name: p.read_bytes() for p in out.iterdir()} != before
    assert [p.name for p in out.parent.iterdir()] == ["g"]
    assert signal.getsignal(signal.SIGINT) is handler
