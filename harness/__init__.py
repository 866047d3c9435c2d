"""Gemma-4 12B on Inferentia2 at TP=2, and the parity harness that proves it right."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """FIXTURES_DIR, computed on first use: this package imports nothing at all, so that the command's
    signal guard (harness/entry.py) is in place a few milliseconds after the interpreter starts."""
    if name != "FIXTURES_DIR":
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    from pathlib import Path

    # fixtures/ sits beside the package in the repository (`pip install -e .`, or PYTHONPATH); a built
    # wheel carries it inside the package (setup.py), so a non-editable install finds it there.
    packaged = Path(__file__).resolve().parent / "fixtures"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parent.parent / "fixtures"
