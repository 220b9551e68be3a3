"""The test suite's CLI runner (tests/cli_runner.py, cli_server.py) behaves as a fresh `python -m esrl.cli` would
where forking from a pre-imported server could differ: a PYTHONPATH folder that shadows a module the server has
imported: the call must run as a fresh interpreter, which imports the shadowing module. (A new module on a call's
PYTHONPATH, imported in the forked call as in a fresh one: tests/test_bad_rewards.py's reward plugins.)"""

from __future__ import annotations

import cli_runner
from cli_runner import run_esrl


def test_a_pythonpath_shadowing_an_imported_module_runs_as_a_fresh_interpreter(tmp_path, monkeypatch):
    assert run_esrl("--help").returncode == 0  # the server is up, with the suite's own PYTHONPATH
    server = cli_runner._server["proc"]
    (tmp_path / "json.py").write_text("raise SystemExit(7)\n")  # the server imported the real json long ago
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert run_esrl("--help").returncode == 7  # a fresh interpreter imports this json first
    assert server is None or (cli_runner._server["proc"] is server and server.poll() is None)
