"""`--assistant tiny` (and `tiny-31b`): the embedded tiny target's fitted assistant, built and cached on
first use like `--model tiny` (harness/cli/common.py's assistant_dir); names that have no assistant,
a name paired with another target, and a name that is also a path are refused (exit 2) before
any model work. The slow lane runs docs/speculative.md's first command as written."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from harness.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]


def test_the_embedded_assistants_are_those_of_tiny_and_tiny_31b():
    from harness.cli.common import tiny_assistant_names
    from harness.inputs.tiny import TINY_CONFIG, TINY_FAMILY

    assert tiny_assistant_names() == {"tiny": TINY_CONFIG, "tiny-31b": TINY_FAMILY["31b"]}


@pytest.mark.parametrize("model, name", [("tiny", "tiny"), ("tiny-31b", "tiny-31b")])
def test_a_tiny_name_builds_the_assistant_of_its_target(model, name, monkeypatch):
    """The name resolves through tiny_assistant() with --seed and the target's tiny config (the build
    itself, minutes on first use, is the slow lane's and the speculative fault suite's)."""
    import argparse

    from harness.cli.common import assistant_dir, tiny_config
    from harness.reference import tiny_assistant as module

    calls = []
    monkeypatch.setattr(module, "tiny_assistant", lambda seed, target_config: calls.append((seed, target_config))
                        or (Path("target"), Path(f"/cache/{target_config.stem}-assistant-seed{seed}")))
    args = argparse.Namespace(assistant=name, model=model, checkpoint=None, config=None, seed=3)
    resolved = assistant_dir(args)
    assert calls == [(3, tiny_config(args))]
    assert resolved == f"/cache/{tiny_config(args).stem}-assistant-seed3"
    args.assistant = "some/dir"
    assert assistant_dir(args) == "some/dir"  # a directory is taken as given


@pytest.mark.parametrize("argv, named", [
    (["--model", "tiny-e2b", "--assistant", "tiny-e2b"], "no embedded tiny assistant of that name"),
    (["--model", "tiny-31b", "--assistant", "tiny"], "use --model tiny with it"),
    (["--checkpoint", "CKPT", "--assistant", "tiny"], "not of --checkpoint"),
])
def test_a_tiny_name_that_does_not_fit_is_refused_before_model_work(argv, named, tmp_path, capsys, monkeypatch, tiny0_dir):
    from harness.reference import tiny_assistant as module

    monkeypatch.setattr(module, "tiny_assistant", lambda *a, **k: pytest.fail("built an assistant"))
    argv = [str(tiny0_dir) if a == "CKPT" else a for a in argv]
    code = cli(["check", *argv, "--speculate", "3", "--json", str(tmp_path / "out.json")])
    err = capsys.readouterr().err
    assert code == 2 and named in err and "Traceback" not in err, err
    assert not (tmp_path / "out.json").exists()


def test_a_tiny_name_that_is_also_a_path_is_refused(tmp_path, capsys, monkeypatch):
    from harness.reference import tiny_assistant as module

    monkeypatch.setattr(module, "tiny_assistant", lambda *a, **k: pytest.fail("built an assistant"))
    (tmp_path / "tiny").mkdir()
    monkeypatch.chdir(tmp_path)
    code = cli(["info", "--model", "tiny", "--assistant", "tiny", "--speculate", "3"])
    err = capsys.readouterr().err
    assert code == 2 and "write ./tiny for the path" in err, err


def _first_command(page: Path) -> list[str]:
    block = re.search(r"```\n(gemma-parity [^\n]+)\n", page.read_text())
    assert block, f"{page}: no command block"
    return shlex.split(block.group(1))


def test_the_speculative_pages_first_command_uses_the_embedded_pair():
    """The first command of docs/speculative.md and the README's speculative row name `--assistant tiny`."""
    argv = _first_command(ROOT / "docs" / "speculative.md")
    assert argv[:2] == ["gemma-parity", "check"] and argv[argv.index("--assistant") + 1] == "tiny"
    assert argv[argv.index("--model") + 1] == "tiny"
    assert "`gemma-parity check --model tiny --assistant tiny --speculate 3`" in (ROOT / "README.md").read_text()


@pytest.mark.slow  # minutes: the fitted pair's build on first use and a whole check with the speculative
# stage; the default lane's siblings above cover the name's resolution and its refusals
def test_the_speculative_pages_first_command_runs_as_written(tmp_path):
    argv = _first_command(ROOT / "docs" / "speculative.md")
    out = tmp_path / "check.json"
    assert cli([*argv[1:], "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "tiny-assistant" in result["provenance"]["settings"]["run"]["assistant"]
