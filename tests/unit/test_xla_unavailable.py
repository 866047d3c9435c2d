"""Without torch-xla (the default torch 2.13 environment) `--backend xla` is bad input: exit 2,
naming the install command, before any reference work."""

from __future__ import annotations

import sys

from harness.backends import xla
from harness.cli import EXIT_BAD_INPUT, main


def test_check_backend_xla_without_torch_xla_exits_2_with_the_install_command(monkeypatch, capsys, tiny0_dir):
    monkeypatch.setitem(sys.modules, "torch_xla", None)  # `import torch_xla` now raises ImportError
    xla.xla_runtime.cache_clear()
    try:
        code = main(["check", "--backend", "xla", "--checkpoint", str(tiny0_dir)])
    finally:
        xla.xla_runtime.cache_clear()
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT, err
    assert "pip install torch==2.9.0 torch-xla==2.9.0" in err and "[xla]" in err
    assert "reference" not in capsys.readouterr().out


def test_graphs_without_torch_xla_exits_2_with_the_install_command(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch_xla", None)
    xla.xla_runtime.cache_clear()
    try:
        code = main(["graphs", "--config", "fixtures/configs/gemma-4-12b-it.json"])
    finally:
        xla.xla_runtime.cache_clear()
    assert code == EXIT_BAD_INPUT and "pip install torch==2.9.0 torch-xla==2.9.0" in capsys.readouterr().err
