"""The `plot` extra (matplotlib) is optional: tests that need it skip with the reason when absent."""

from __future__ import annotations

import importlib.util

import pytest

PLOT_REASON = "needs the `plot` extra (matplotlib): pip install -e '.[plot]'"


def require_plot_extra() -> None:
    """Skip the rest of the calling test (its earlier assertions have run) without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip(PLOT_REASON)
