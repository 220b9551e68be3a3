"""`pip install .` gives a working esrl: the built wheel (not src/), with its task data and configs.

A real clean install would download torch and the rest (GBs, minutes, the network). Instead the wheel is
built offline (--no-build-isolation, setuptools from the test extras) from a copy of the sources, installed
with --no-deps into a new venv, and that venv reaches the test venv's dependencies through a .pth line.
A .pth line only appends a folder to sys.path: the test venv's own .pth files (the editable install's
finder among them) are not run, and the new venv's site-packages comes first, so `esrl` is the wheel's copy
(checked) and every other package is the version the suite runs with. The fit runs from a folder outside
the checkout, on a config found through `esrl env --configs`, with the conciseness task's packaged data.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

pytestmark = pytest.mark.slow


def run(*cmd, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    out = subprocess.run([str(c) for c in cmd], check=False, capture_output=True, text=True, cwd=cwd, env=env,
                         timeout=timeout)
    assert out.returncode == 0, f"{cmd}: {out.stdout[-2000:]}{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A new venv holding esrl's wheel only (its dependencies seen through the test venv)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    for part in ("src", "configs"):
        shutil.copytree(ROOT / part, source / part, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, source / part)
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
        "-w", root / "dist", source)
    (wheel,) = (root / "dist").glob("esrl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for packaged in ("esrl/tasks/data/conciseness_train.jsonl", "esrl/configs/demo/es_conciseness.yaml",
                     "esrl/configs/demo/data/pku_train16.jsonl", "esrl/configs/es_pku.yaml",
                     "esrl/tasks/data/math_demo.jsonl", "esrl/configs/demo/es_math.yaml"):
        assert packaged in names, packaged
    venv = root / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    purelib = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (purelib / "zz_test_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel)
    return venv


def test_the_installed_copy_is_the_wheel(installed):
    where = run(installed / "bin" / "python", "-c", "import esrl; print(esrl.__file__)").stdout.strip()
    assert Path(where).is_relative_to(installed) and not Path(where).is_relative_to(ROOT)


def test_one_step_fit_from_the_wheel(installed, tiny_model, tmp_path):
    """The wheel's console script, its packaged configs and task data (`esrl --help` is tests/test_cli_help.py's)."""
    esrl = installed / "bin" / "esrl"
    configs = Path(run(esrl, "env", "--configs", cwd=tmp_path).stdout.strip())
    assert configs.is_relative_to(installed)
    config = yaml.safe_load((configs / "demo" / "es_conciseness.yaml").read_text())
    assert "task_args" not in config["data"]  # the conciseness prompts come from the packaged task data
    run(esrl, "fit", "--config", configs / "demo" / "es_conciseness.yaml", "--model.policy.name_or_path",
        tiny_model, "--model.rollout.max_new_tokens", "4", "--model.es.population_size", "2",
        "--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", tmp_path / "run", cwd=tmp_path, timeout=600)
    assert list((tmp_path / "run").rglob("metrics.csv"))
