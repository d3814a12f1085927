"""Build hook: ship the repository's ``conf/`` tree inside the installed ``recipes`` package.

Metadata lives in setup.cfg. ``conf/`` sits at the top of the repository (the Hydra config tree, see
docs/design.md section 1); a plain ``pip install .`` copies it to ``recipes/conf`` so that installed entry
points find their configs. Editable installs read ``conf/`` from the checkout instead
(``recipes.config_dir``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithConf(build_py):
    def run(self) -> None:
        super().run()
        source = Path(__file__).resolve().parent / "conf"
        if source.is_dir():
            shutil.copytree(source, Path(self.build_lib) / "recipes" / "conf", dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildPyWithConf})
