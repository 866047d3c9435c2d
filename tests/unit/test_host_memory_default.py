"""`--host-memory` defaults to what this machine has (`auto`) on every command that takes it, `info`
included (issue 49): a run is judged against the host it runs on, not the inf2 instance it might."""

from __future__ import annotations

import json

import pytest

from harness import FIXTURES_DIR
from harness.cli import EXIT_BAD_INPUT, EXIT_OK, build_parser, main
from harness.cli import host_gate

CONFIG_12B = str(FIXTURES_DIR / "configs" / "gemma-4-12b-it.json")
GIB = 1 << 30
COMMANDS = (["check"], ["bisect", "--golden", "g"], ["reference", "--out", "g"], ["quality", "--corpus", "c", "--golden", "g"], ["bench", "--model", "tiny", "--out", "b.json"],
            ["info"])


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_every_command_takes_auto_and_defaults_to_it(command):
    parser = build_parser()
    args = parser.parse_args(command + ["--host-memory", "auto"])
    assert args.host_memory == "auto"
    default = parser.parse_args(command)
    assert host_gate.budget(default)[0] == host_gate.budget(args)[0] == host_gate.machine_ram_bytes()
    assert "default, --host-memory auto" in host_gate.budget(default)[1]


def test_info_plan_judges_this_machine_unless_told(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(host_gate, "machine_ram_bytes", lambda: 64 * GIB)  # a 64 GiB workstation
    out = tmp_path / "plan.json"
    assert main(["info", "--config", CONFIG_12B, "--tp", "2", "--plan", "--host-memory", "auto",
                 "--json", str(out)]) == EXIT_OK
    plan = json.loads(out.read_text())["resource_plan"]
    assert plan["host_bytes"] == 64 * GIB and not plan["commands"]["check"]["fits_host"]  # the 12B check: ~91 GiB
    out.unlink()
    assert main(["info", "--config", CONFIG_12B, "--tp", "2", "--plan", "--json", str(out)]) == EXIT_OK
    assert json.loads(out.read_text())["resource_plan"]["host_bytes"] == 64 * GIB  # the default is auto
    out.unlink()
    assert main(["info", "--config", CONFIG_12B, "--tp", "2", "--plan", "--host-memory", "128",
                 "--json", str(out)]) == EXIT_OK
    assert json.loads(out.read_text())["resource_plan"]["commands"]["check"]["fits_host"]
    capsys.readouterr()


def test_a_run_over_this_machine_is_refused_before_model_work(monkeypatch, capsys):
    import harness.parity.check as parity

    monkeypatch.setattr(parity, "run_parity_check", lambda *a, **k: pytest.fail("model work started"))
    monkeypatch.setattr(host_gate, "machine_ram_bytes", lambda: GIB // 8)  # a machine smaller than the tiny check
    assert main(["check", "--model", "tiny"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "over the host budget of 0.1 GiB (this machine's RAM (the default, --host-memory auto" in err, err
    assert "no option of check" in err or "which fits" in err  # what would fit
