"""Gemma-4 12B on Inferentia2 at TP=2, and the parity harness that proves it right."""

from pathlib import Path

__version__ = "0.1.0"

# fixtures/ sits beside the package in the repository (the README installs with `pip install -e .`).
FIXTURES_DIR = Path(__file__).resolve().parent.parent / "fixtures"
