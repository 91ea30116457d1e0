"""The opt-in alias (``packages/sagemaker-alias``): ``import amzn_sagemaker_checkpointing...`` lines
run on tierckpt, and never in place of Amazon's package.

The alias is installed for real, once per module: ``pip install --no-deps --target`` of a copy of
its source (the wheel setuptools builds, ``.pth`` included), then each case runs a fresh
interpreter that adds that directory as a site directory (``site.addsitedir``: the ``.pth`` file
is processed as at start-up). This venv has Amazon's ``amzn-sagemaker-checkpointing`` installed,
so "without it" is an interpreter started with ``-S`` on a copy of this venv's site-packages
(symlinks) that leaves Amazon's package out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ALIAS_SRC = REPO / "packages" / "sagemaker-alias"
REAL = "amzn_sagemaker_checkpointing"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The alias pip-installed into its own directory; returns that site directory."""
    work = tmp_path_factory.mktemp("alias")
    src = work / "src"
    shutil.copytree(ALIAS_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    site = work / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(site), str(src)], capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr
    yield site


@pytest.fixture(scope="module")
def without_amazon(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This venv's site-packages as symlinks, minus Amazon's package and its metadata."""
    farm = tmp_path_factory.mktemp("site-without-amazon")
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(REAL) and not entry.name.endswith(".pth"):
            (farm / entry.name).symlink_to(entry)
    return farm


def _run(code: str, *, isolated_site: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src")] + ([str(isolated_site)] if isolated_site else []))
    argv = [sys.executable, *(["-S"] if isolated_site else []), "-c", code]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)


def test_the_wheel_installs_the_alias_one_directory_down_with_a_pth_that_appends_it(installed: Path) -> None:
    assert (installed / "tierckpt-sagemaker-alias.pth").read_text().split() == ["tierckpt_sagemaker_alias"]
    assert not (installed / REAL).exists()  # nothing at the top level that could overwrite Amazon's files
    init = installed / "tierckpt_sagemaker_alias" / REAL / "__init__.py"
    assert init.read_text().startswith('"""NOT Amazon\'s amzn-sagemaker-checkpointing: tierckpt\'s alias')


@pytest.mark.slow  # a fresh interpreter imports torch: 6-8 s on 2 shared cores
def test_without_amazons_package_the_seeds_import_lines_load_tierckpt(installed: Path, without_amazon: Path) -> None:
    code = f"""
import json, site, sys
site.addsitedir({str(installed)!r})
# seed 000's and seed 002's import lines, unchanged
from amzn_sagemaker_checkpointing.config.sagemaker_checkpoint_config import SageMakerCheckpointConfig
from amzn_sagemaker_checkpointing.checkpointing.filesystem import SageMakerTieredStorageWriter, SageMakerTieredStorageReader
from amzn_sagemaker_checkpointing.checkpointing.filesystem.filesystem import SageMakerTieredStorageWriter as W2
from amzn_sagemaker_checkpointing.config.s3_path_strategy import DefaultS3PathStrategy, RayS3PathStrategy
from amzn_sagemaker_checkpointing.checkpointing.filesystem.exceptions import SageMakerTieredStorageConfigError
import amzn_sagemaker_checkpointing as sm_ckpt
import tierckpt.compat.sagemaker as ours
from tierckpt import TierckptError
cfg = sm_ckpt.CheckpointConfig(world_size=100, in_memory_namespace="my-ml-workload",
                               s3_base_path="s3://bucket-name/prefix/", s3_every_n_steps=100)
try:
    SageMakerCheckpointConfig(namespace="", world_size=1).get_s3_strategy()
    SageMakerTieredStorageWriter(SageMakerCheckpointConfig(namespace="", world_size=1), step=1)
    bad = None
except SageMakerTieredStorageConfigError as exc:
    bad = [str(exc), isinstance(exc, TierckptError)]
print(json.dumps({{
    "alias": getattr(sm_ckpt, "__tierckpt_alias__", False),
    "file": sm_ckpt.__file__,
    "last_path": sys.path[-1],
    "same": [SageMakerCheckpointConfig is ours.SageMakerCheckpointConfig,
             SageMakerTieredStorageWriter is ours.SageMakerTieredStorageWriter is W2,
             SageMakerTieredStorageReader is ours.SageMakerTieredStorageReader,
             DefaultS3PathStrategy is ours.DefaultS3PathStrategy, RayS3PathStrategy is ours.RayS3PathStrategy,
             sm_ckpt.SageMakerTieredStorageWriter is ours.SageMakerTieredStorageWriter],
    "config": [type(cfg).__name__, isinstance(cfg, ours.SageMakerCheckpointConfig), cfg.namespace,
               cfg.s3_tier_base_path, cfg.saves_to_s3(200), cfg.saves_to_s3(250)],
    "bad": bad,
}}))
"""
    done = _run(code, isolated_site=without_amazon)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["alias"] is True
    alias_dir = str(installed / "tierckpt_sagemaker_alias")
    assert got["file"] == os.path.join(alias_dir, REAL, "__init__.py")
    assert got["last_path"] == alias_dir  # appended: every other entry is searched first
    assert got["same"] == [True] * 6
    assert got["config"] == ["CheckpointConfig", True, "my-ml-workload", "s3://bucket-name/prefix/", True, False]
    assert got["bad"] == ["Namespace in SageMakerCheckpointConfig cannot be empty", True]


def test_with_amazons_package_installed_the_alias_is_never_imported(installed: Path) -> None:
    code = f"""
import json, site, sys
site.addsitedir({str(installed)!r})
from amzn_sagemaker_checkpointing.config.sagemaker_checkpoint_config import SageMakerCheckpointConfig
import amzn_sagemaker_checkpointing as pkg
print(json.dumps([pkg.__file__, getattr(pkg, "__tierckpt_alias__", False), SageMakerCheckpointConfig.__module__,
                  any(m.startswith("tierckpt") for m in sys.modules), sys.path[-1]]))
"""
    done = _run(code)
    assert done.returncode == 0, done.stderr
    file, alias, module, tierckpt_loaded, last = json.loads(done.stdout.strip().splitlines()[-1])
    assert file == os.path.join(sysconfig.get_paths()["purelib"], REAL, "__init__.py")  # Amazon's
    assert alias is False and tierckpt_loaded is False
    assert module == f"{REAL}.config.sagemaker_checkpoint_config"
    assert last == str(installed / "tierckpt_sagemaker_alias")  # the alias is there, behind it


@pytest.mark.slow  # a fresh interpreter imports tierckpt (torch)
def test_forced_ahead_of_amazons_package_the_alias_refuses_with_a_typed_error(installed: Path) -> None:
    code = f"""
import json, sys
sys.path.insert(0, {str(installed / "tierckpt_sagemaker_alias")!r})
try:
    import amzn_sagemaker_checkpointing
    print(json.dumps(["imported", amzn_sagemaker_checkpointing.__file__]))
except ImportError as exc:
    from tierckpt import TierckptError
    from tierckpt.compat.alias import AliasShadowsPackageError
    print(json.dumps([type(exc).__name__, isinstance(exc, AliasShadowsPackageError), isinstance(exc, TierckptError),
                      str(exc), "amzn_sagemaker_checkpointing" in sys.modules]))
"""
    done = _run(code)
    assert done.returncode == 0, done.stderr
    name, typed, rooted, message, left = json.loads(done.stdout.strip().splitlines()[-1])
    assert (name, typed, rooted, left) == ("AliasShadowsPackageError", True, True, False)
    assert "amzn-sagemaker-checkpointing 1.1.3 is installed too; the alias refuses to hide it" in message
    assert "pip uninstall tierckpt-sagemaker-alias" in message and "pip uninstall amzn-sagemaker-checkpointing" in message


def test_the_extra_names_the_alias_distribution() -> None:
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    alias = tomllib.loads((ALIAS_SRC / "pyproject.toml").read_text())["project"]
    assert extras["sagemaker-alias"] == [f"{alias['name']}>={alias['version']}"]
    assert alias["dependencies"] == ["tierckpt[s3]>=0.2.0"]
