"""--strict-precision (issue 38) composes with check's and bisect's options or is refused: with
bisect's truncate mode (which judges no distribution) it is refused before any work; on check it turns
an over-precision warning into exit 1."""

from __future__ import annotations

import json

import pytest

from harness.cli import main


def test_strict_precision_with_truncate_mode_is_refused(tiny0_dir, tmp_path, capsys):
    code = main(["bisect", "--checkpoint", str(tiny0_dir), "--golden", str(tmp_path / "no-golden"),
                 "--mode", "truncate", "--strict-precision"])
    err = capsys.readouterr().err
    assert code == 2 and "--strict-precision with truncate mode" in err and "--mode capture" in err, err


@pytest.mark.slow  # two checks of the tiny 12B (~40 CPU-s); default-lane sibling: the refusal above and
# tests/unit/test_distribution.py::test_over_precision_warns_names_its_start_and_its_cost_and_fails_under_strict
def test_strict_precision_fails_an_over_precise_port(tiny0_dir, tmp_path, monkeypatch, capsys):
    from tests.faults.precision import residual_in_fp32

    residual_in_fp32(monkeypatch)
    args = ["check", "--checkpoint", str(tiny0_dir), "--new-tokens", "4", "--batch", "1", "--skip-served-build"]
    assert main(args + ["--json", str(tmp_path / "warn.json")]) == 0
    warned = json.loads((tmp_path / "warn.json").read_text())["extra_stages"]["distribution"]
    assert warned["passed"] and warned["over_precision"][0]["where"].startswith("layer 0")
    assert "WARNING over-precision" in capsys.readouterr().out
    assert main(args + ["--strict-precision", "--json", str(tmp_path / "strict.json")]) == 1
    strict = json.loads((tmp_path / "strict.json").read_text())
    assert strict["failed_stages"] == ["distribution"] and strict["extra_stages"]["distribution"]["strict_precision"]
