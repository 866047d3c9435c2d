"""The reference checked against itself before it judges (harness/reference/selfcheck.py, issue 38):
a planted reference fault (transformers' uncached path broken) is refused with exit 2 by `reference`
and `check`, naming what disagreed, before any model work is written; each of the three checks
decides on what it measured."""

from __future__ import annotations

import pytest
import torch

from harness.cli import main
from harness.reference import run as reference_run
from harness.reference.selfcheck import CACHE_TOLERANCE, FP32_TOLERANCE, SelfCheck, refuse_unsound_reference


def _break_uncached_path(monkeypatch):
    """transformers' forward without a cache puts every token at position 0 (its rope forgets where
    tokens are; a uniform offset would not show: rope is relative)."""
    real = reference_run.load_reference_model

    def load(*args, **kwargs):
        model = real(*args, **kwargs)
        forward = model.forward

        def uncached_at_position_0(*a, use_cache=None, **kw):
            if use_cache is False:
                kw["position_ids"] = torch.zeros_like(kw["input_ids"])
            return forward(*a, use_cache=use_cache, **kw)

        model.forward = uncached_at_position_0
        return model

    monkeypatch.setattr(reference_run, "load_reference_model", load)


def test_the_healthy_reference_passes_its_self_checks(tiny0_ckpt):
    found = refuse_unsound_reference(tiny0_ckpt, [[5, 9, 11, 40, 7, 300, 2], [5, 9, 11, 40, 7, 300, 2, 8]])
    assert not found.problems(), found
    assert found.cache_error < CACHE_TOLERANCE and found.float64_error < FP32_TOLERANCE and found.tokens_agree


@pytest.mark.parametrize("command", ["reference", "check"])
def test_a_broken_uncached_path_is_refused_with_exit_2(tiny0_dir, tmp_path, monkeypatch, capsys, command):
    _break_uncached_path(monkeypatch)
    out = tmp_path / "out"
    args = ["--checkpoint", str(tiny0_dir), "--new-tokens", "2"]
    args += ["--out", str(out)] if command == "reference" else ["--json", str(out / "check.json")]
    assert main([command] + args) == 2
    err = capsys.readouterr().err
    assert "disagrees with itself" in err and "cached decode differs from the uncached recomputation" in err, err
    assert not (out / "manifest.json").exists() and not (out / "check.json").exists()


def test_each_disagreement_is_named():
    healthy = SelfCheck(cache_error=1e-7, tokens_agree=True, config_equal=True, config_diff=[], float64_error=1e-6)
    assert healthy.problems() == []
    config = SelfCheck(1e-7, True, False, ["rope_parameters"], 1e-6).problems()
    assert len(config) == 1 and "rope_parameters" in config[0] and "save and reload" in config[0]
    fp32 = SelfCheck(1e-7, True, True, [], 10 * FP32_TOLERANCE).problems()
    assert len(fp32) == 1 and "float64" in fp32[0]
    tokens = SelfCheck(1e-7, False, True, [], None).problems()
    assert len(tokens) == 1 and "greedy tokens differ" in tokens[0]
