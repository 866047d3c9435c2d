"""Only what pyproject.toml cannot say: the wheel carries fixtures/ (the tiny model's config and the
default prompts) inside the package, as harness/fixtures, so that a non-editable install runs
`gemma-parity check` too. In the repository fixtures/ stays at the top (harness/__init__.py finds
either)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithFixtures(build_py):
    def run(self):
        super().run()
        source = Path(__file__).resolve().parent / "fixtures"
        target = Path(self.build_lib) / "harness" / "fixtures"
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("goldens-*"))  # the drift goldens are for tests


setup(cmdclass={"build_py": BuildWithFixtures})
