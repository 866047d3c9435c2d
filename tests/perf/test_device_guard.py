"""The device budget test's guard, checked on CPU: under `-m neuron` a missing 12B checkpoint is a
failure that names the variable to set, never a skip."""

from __future__ import annotations

import pytest

from tests.perf import test_device_budgets as device


def test_missing_checkpoint_fails_naming_the_variable(monkeypatch):
    monkeypatch.delenv(device.CHECKPOINT_ENV, raising=False)
    with pytest.raises(pytest.fail.Exception, match=f"{device.CHECKPOINT_ENV} is not set.*export"):
        device.checkpoint_path()


def test_a_directory_without_config_fails_too(monkeypatch, tmp_path):
    monkeypatch.setenv(device.CHECKPOINT_ENV, str(tmp_path))
    with pytest.raises(pytest.fail.Exception, match="no config.json there"):
        device.checkpoint_path()
    (tmp_path / "config.json").write_text("{}")
    assert device.checkpoint_path() == tmp_path
