"""Fixtures of the fault catalog live in the root conftest.py (the inexact-scale variant is shared
with tests/unit)."""
