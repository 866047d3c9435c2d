"""`--model tiny-31b|tiny-e2b|tiny-e4b|tiny-26b-a4b`: the family's tiny shapes from the command line,
built and cached like the tiny 12B (harness/inputs/tiny.py TINY_FAMILY), on every command with --model."""

from __future__ import annotations

import json

import pytest

from harness.cli import main
from harness.inputs.tiny import TINY_FAMILY, tiny_checkpoint_path

NAMES = [f"tiny-{name}" for name in TINY_FAMILY]


@pytest.mark.parametrize("model", NAMES)
def test_info_reads_the_family_member_asked_for(model, tmp_path, capsys):
    out = tmp_path / "info.json"
    assert main(["info", "--model", model, "--json", str(out)]) == 0
    info = json.loads(out.read_text())
    expected = tiny_checkpoint_path(0, TINY_FAMILY[model.removeprefix("tiny-")])
    assert info["source"].startswith(str(expected)), (info["source"], expected)


def test_every_command_with_model_offers_the_family(capsys):
    from harness.cli import build_parser

    parser = build_parser()
    for command in ("info", "check", "bisect", "reference", "quality", "bench"):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([command, "--model", "tiny-7b"] if command != "bench" else
                              ["bench", "--model", "tiny-7b", "--out", "x.json"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert all(name in err for name in NAMES), (command, err)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-e2b", "tiny-31b"])
def test_check_runs_on_a_family_member(model, tmp_path, capsys):
    assert main(["check", "--model", model, "--json", str(tmp_path / "c.json")]) == 0
    assert "PARITY PASS" in capsys.readouterr().out
