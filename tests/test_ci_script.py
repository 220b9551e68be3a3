"""`.ci/run`'s control flow, with a stand-in `make`: its exit status is what CI judges.

The real commands take half an hour, so a fake `make` on PATH stands in for them (it prints what the demo prints and
exits with the status a test asks for). What runs is the real script: its background install, its trap, its checks.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_MAKE = """#!/usr/bin/env bash
# make TARGET [VAR=VALUE...]: what .ci/run's targets leave behind, each exiting with FAKE_<TARGET>_RC.
target=$1; shift
for arg in "$@"; do case $arg in VENV=*) venv=${arg#VENV=};; esac; done
case $target in
  demo)
    mkdir -p "$venv/bin" && touch "$venv/.installed"
    printf '#!/bin/sh\\nexit 0\\n' > "$venv/bin/python" && printf '#!/bin/sh\\necho env\\n' > "$venv/bin/esrl"
    chmod +x "$venv/bin/python" "$venv/bin/esrl"
    echo "[eval] reward 1.0"
    exit "${FAKE_DEMO_RC:-0}";;
  install-test) exit "${FAKE_INSTALL_RC:-0}";;
  test) echo "fake suite"; exit "${FAKE_TEST_RC:-0}";;
esac
echo "fake make: unknown target $target" >&2; exit 2
"""


def run_ci(tmp_path, **rcs):
    """Runs a copy of .ci/run in tmp_path with the fake make first on PATH; returns the finished process."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text(FAKE_MAKE)
    (bin_dir / "make").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "TMPDIR": str(tmp_path)}
    env.update({f"FAKE_{name.upper()}_RC": str(rc) for name, rc in rcs.items()})
    return subprocess.run(["bash", str(tmp_path / ".ci" / "run")], env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_green_run_exits_zero_and_leaves_nothing_behind(tmp_path):
    done = run_ci(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "== done" in done.stdout
    assert not list(tmp_path.glob("tmp.*")), "the run's work folder was left behind"


@pytest.mark.parametrize("failing", ["test", "install", "demo"])
def test_a_failing_step_fails_the_run(tmp_path, failing):
    done = run_ci(tmp_path, **{failing: 3})
    assert done.returncode != 0
    assert "== done" not in done.stdout
    if failing == "install":
        assert "make install-test failed" in done.stderr
