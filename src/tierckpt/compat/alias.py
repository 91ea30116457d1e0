"""The guard of ``tierckpt-sagemaker-alias``: our ``amzn_sagemaker_checkpointing`` never hides Amazon's.

The alias distribution (``packages/sagemaker-alias``, installed by ``pip install
'tierckpt[sagemaker-alias]'``) makes ``import amzn_sagemaker_checkpointing...`` lines load
``tierckpt.compat.sagemaker``. Its modules sit in their own directory, which its ``.pth`` file
appends to the end of ``sys.path``, so the real ``amzn-sagemaker-checkpointing``, when installed,
is found first and the alias is never imported. If the alias is imported anyway (its directory
put ahead of site-packages by hand) while the real distribution is installed, the alias's
``__init__`` calls ``refuse_to_shadow`` first, which raises ``AliasShadowsPackageError``.

Call order: the alias package's ``__init__`` → ``refuse_to_shadow(__file__)`` → its re-exports.
"""

from __future__ import annotations

import importlib.metadata

from tierckpt.errors import TierckptError

__all__ = ["ALIAS_DISTRIBUTION", "REAL_DISTRIBUTION", "AliasShadowsPackageError", "refuse_to_shadow"]

REAL_DISTRIBUTION = "amzn-sagemaker-checkpointing"
ALIAS_DISTRIBUTION = "tierckpt-sagemaker-alias"


class AliasShadowsPackageError(TierckptError, ImportError):
    """tierckpt's alias was imported as ``amzn_sagemaker_checkpointing`` while Amazon's package is installed."""


def refuse_to_shadow(alias_file: str) -> None:
    """Raise ``AliasShadowsPackageError`` when the real distribution is installed (any version)."""
    try:
        real = importlib.metadata.distribution(REAL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return
    raise AliasShadowsPackageError(
        f"{ALIAS_DISTRIBUTION} (tierckpt's alias, {alias_file}) was imported as amzn_sagemaker_checkpointing, "
        f"but Amazon's {REAL_DISTRIBUTION} {real.version} is installed too; the alias refuses to hide it. "
        f"Use one: `pip uninstall {ALIAS_DISTRIBUTION}` to keep Amazon's library, or `pip uninstall "
        f"{REAL_DISTRIBUTION}` to run these imports on tierckpt (and take the alias's directory off the "
        "front of sys.path / PYTHONPATH: its .pth file puts it last)",
        path=alias_file,
    )
