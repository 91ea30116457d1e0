"""Adds ``tierckpt-sagemaker-alias.pth`` to the wheel's root (as pytest-cov ships its .pth).

The .pth holds one relative path, ``tierckpt_sagemaker_alias``: ``site`` appends that directory
to the END of ``sys.path`` at start-up, so ``amzn_sagemaker_checkpointing`` resolves to the alias
only when no earlier entry (site-packages) has Amazon's package.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "tierckpt-sagemaker-alias.pth"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(Path(__file__).parent / PTH), str(Path(self.build_lib) / PTH))


setup(cmdclass={"build_py": BuildWithPth})
