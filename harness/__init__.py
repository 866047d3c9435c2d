"""Gemma-4 12B on Inferentia2 at TP=2, and the parity harness that proves it right."""

from pathlib import Path

__version__ = "0.1.0"

# fixtures/ sits beside the package in the repository (`pip install -e .`, or PYTHONPATH); a built
# wheel carries it inside the package (setup.py), so a non-editable install finds it there.
_PACKAGED_FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURES_DIR = _PACKAGED_FIXTURES if _PACKAGED_FIXTURES.is_dir() else Path(__file__).resolve().parent.parent / "fixtures"
