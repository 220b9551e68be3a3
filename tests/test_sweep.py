"""`esrl sweep`'s input checks: a bad flag, folder, config or grid key is one line before any run starts (its runs
and tables are tested on real runs in test_analysis.py)."""

from __future__ import annotations

import re

import pytest
from conftest import run_esrl, write_tiny_config
from esrl.sweep import SweepError


@pytest.fixture
def config(tmp_path, tiny_model):
    return write_tiny_config(tmp_path / "tiny.yaml", tiny_model, trainer={"callbacks": [
        {"class_path": "esrl.callbacks.Evaluation", "init_args": {"num_samples": 2}}]})


def refused(out, tmp_path) -> str:
    """The one error line of a sweep that stopped before creating its folder."""
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "sweep").exists()
    (error,) = out.stderr.strip().splitlines()
    return error


@pytest.mark.parametrize("jobs", ["0", "-2"])
def test_jobs_below_one_is_refused(config, tmp_path, jobs):
    out = run_esrl("sweep", "--config", config, "--out", tmp_path / "sweep", "--grid", "model.es.sigma=0.1",
                   f"--jobs={jobs}")
    assert refused(out, tmp_path) == f"esrl sweep: error: --jobs {jobs}: must be >= 1 (the number of runs at once)"


def test_a_table_name_with_a_folder_is_refused_before_any_run(config, tmp_path):
    """`--name sub/x` failed with FileNotFoundError writing the tables, after every run had finished."""
    out = run_esrl("sweep", "--config", config, "--out", tmp_path / "sweep", "--grid", "model.es.sigma=0.1",
                   "--name", "sub/x")
    assert refused(out, tmp_path) == ("esrl sweep: error: --name 'sub/x': a file name without a folder (the tables "
                                      "are OUT/NAME.csv, .md)")


@pytest.mark.parametrize(("args", "message"), [
    (["--grid", "model.es.sigma=0.005,0.01", "--", "--model.es.sigma", "0.02"],
     "--grid model.es.sigma: also given after -- (--model.es.sigma), which would set it for every run"),
    (["--grid", "model.es.sigma=0.005,0.01", "--", "--model.es.sigma=0.02"],
     "--grid model.es.sigma: also given after -- (--model.es.sigma=0.02), which would set it for every run"),
    (["--grid", "trainer.default_root_dir=a,b"],
     "--grid trainer.default_root_dir: set by the sweep (--out, --config)"),
])
def test_a_grid_key_the_flags_after_the_dashes_would_override_is_refused(config, tmp_path, args, message):
    """The flags after -- come later in each run's command: every point ran at 0.02, its row labelled 0.005."""
    from esrl.sweep import main

    with pytest.raises(SweepError, match=re.escape(message)):
        main(["--config", str(config), "--out", str(tmp_path / "sweep"), *args])
    assert not (tmp_path / "sweep").exists()


def test_out_that_cannot_be_a_folder_is_refused(config, tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    out = run_esrl("sweep", "--config", config, "--out", tmp_path / "notes.txt", "--grid", "model.es.sigma=0.1")
    assert refused(out, tmp_path) == f"esrl sweep: error: --out: {tmp_path / 'notes.txt'} cannot be a folder: " \
                                     f"{tmp_path / 'notes.txt'} is a file"
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_summarize_needs_runs_in_out(config, tmp_path):
    grid = ["--grid", "model.es.sigma=0.1,0.2"]
    out = run_esrl("sweep", "--config", config, "--out", tmp_path / "sweep", *grid, "--summarize")
    assert refused(out, tmp_path) == \
        f"esrl sweep: error: --out {tmp_path / 'sweep'}: no such folder, nothing to summarize"
    (tmp_path / "other").mkdir()
    out = run_esrl("sweep", "--config", config, "--out", tmp_path / "other", *grid, "--summarize")
    assert refused(out, tmp_path).endswith("none of this grid's 2 run folders is there, nothing to summarize")
    assert list((tmp_path / "other").iterdir()) == []


@pytest.mark.parametrize(("text", "grid", "message"), [
    ("model:\n  es: [1\n", "model.es.sigma=0.1", "{config}:3:1: invalid YAML (did not find expected ','"),
    ("just a string\n", "model.es.sigma=0.1", "--config {config}: expected a mapping of config sections"),
    ("model:\n  es:\n    sigmaa: 0.1\n", "model.es.sigma=0.1",
     "--config {config}: 'model.es.sigmaa' is not a config field (model.es has no 'sigmaa'; it has: alpha,"),
    ("model:\n  es:\n    sigma: 0.1\n", "model.es.bogus=1,2",
     "--grid: 'model.es.bogus' is not a config field (model.es has no 'bogus'; it has: alpha,"),
])
def test_bad_config_or_grid_key_stops_before_any_run(tmp_path, text, grid, message):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    out = run_esrl("sweep", "--config", config, "--out", tmp_path / "sweep", "--grid", grid)
    assert refused(out, tmp_path).startswith("esrl sweep: error: " + message.format(config=config))


def test_a_valid_config_and_grid_pass_the_check(config, tmp_path):
    """The shipped-style config (callbacks, task_args, algo) and a grid over algo and seed are no false alarm."""
    out = run_esrl("sweep", "--config", config, "--out", tmp_path / "sweep", "--grid", "algo=es,grpo",
                   "--grid", "seed_everything=0,1", "--grid", "trainer.max_steps=1", "--dry-run")
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(out.stdout.strip().splitlines()) == 4 and "--algo grpo" in out.stdout


@pytest.mark.parametrize(("grid", "message"), [
    ("model.es.mode=lowrank,lowrnk", "mode=lowrnk: model.es.mode: choose full, lowrank, lora, got 'lowrnk'"),
    ("model.es.sigma=0.1,abc", 'sigma=abc: Parser key "model.es.sigma": Expected a <class \'float\'>'),
    ("data.task=conciseness,nope", "task=nope: data.task: unknown task 'nope'"),
])
def test_a_bad_grid_value_is_one_line_naming_its_run_before_any_run(config, tmp_path, grid, message):
    """Values are checked as each run's fit checks them (esrl.fit_check), not found in run 2's fit.log after run 1;
    with --dry-run too, which previews the runs."""
    out = run_esrl("sweep", "--config", config, "--out", tmp_path / "sweep", "--grid", grid)
    assert refused(out, tmp_path).startswith("esrl sweep: error: " + message), out.stderr
    assert out.stdout == ""
    # a dry run prints its plan (two fit commands), then the same line and exit 2
    out = run_esrl("sweep", "--config", config, "--out", tmp_path / "sweep", "--grid", grid, "--dry-run")
    assert refused(out, tmp_path).startswith("esrl sweep: error: " + message), out.stderr
    assert len(out.stdout.splitlines()) == 2 and all(" fit --config " in line for line in out.stdout.splitlines())


@pytest.mark.parametrize(("grid", "message"), [
    ("model.es.alpha=0.001,0.001", "model.es.alpha: values '0.001', '0.001' share one run folder (alpha=0.001); "),
    ("data.task_args.path=data/a.jsonl,data_a.jsonl",
     "data.task_args.path: values 'data/a.jsonl', 'data_a.jsonl' share one run folder (path=data-a.jsonl); "),
    ("data.task_args.path=a b,a-b", "data.task_args.path: values 'a b', 'a-b' share one run folder (path=a-b); "),
    ("model.es.sigma=0.01,0.010", "model.es.sigma: values '0.01', '0.010' are one number; give it once"),  # ran twice
])
def test_grid_values_that_share_a_run_folder_are_refused(config, tmp_path, grid, message):
    """Both points would run in one folder: the second overwrote (or, rerun, skipped) the first, and the table
    listed one run twice while the other configuration never ran."""
    out = run_esrl("sweep", "--config", config, "--out", tmp_path / "sweep", "--grid", "seed_everything=0",
                   "--grid", grid)
    assert refused(out, tmp_path).startswith("esrl sweep: error: --grid " + message), out.stderr


def test_the_table_calls_ok_only_a_run_that_finished(tmp_path):
    """A run without a returncode (still running, or killed hard: SIGKILL at a time limit, OOM) and without a
    final/ was listed ok, its mid-run evaluation as its final eval reward."""
    import json

    from esrl.sweep import run_name, summarize_run

    def row(alpha: str, rc: int | None, final: bool, evals: bool = True, log: bool = True) -> str:
        combo = {"model.es.alpha": alpha}
        root = tmp_path / run_name(combo)
        version = root / "lightning_logs" / "version_0"
        version.mkdir(parents=True)
        if log:
            (root / "fit.log").write_text("$ esrl fit ...\n")
        if rc is not None:
            (root / "returncode").write_text(f"{rc}\n")
        if evals:
            (version / "eval.jsonl").write_text(json.dumps({"step": 0, "reward": -1.0}) + "\n")
        if final:
            (version / "final").mkdir()
        return summarize_run(tmp_path, combo)["status"]

    assert row("1", None, final=False) == "incomplete"
    assert row("2", None, final=False, evals=False) == "incomplete"
    assert row("3", None, final=False, evals=False, log=False) == "not run"
    assert row("4", None, final=True) == "ok"  # fit outside the sweep: no returncode, but its final/
    assert row("5", 0, final=True) == "ok"
    assert row("6", 1, final=False) == "failed (exit 1)"


def test_a_signal_reaches_the_running_fit_no_later_run_starts_and_the_tool_exits_with_its_code(tmp_path):
    """esrl.fit_runs, which sweep and study share: subprocess.run in a worker thread kept the fit out of the
    signal's reach and the tool waited for it. A child standing in for a fit records the SIGTERM it gets."""
    import os
    import signal
    import sys
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from esrl.fit_runs import Fits, signals_reach

    child = ("import pathlib, signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path(sys.argv[1]).write_text('SIGTERM'), sys.exit(143)))\n"
             "time.sleep(60)\n")
    runs = [tmp_path / "a", tmp_path / "b"]
    fits, before = Fits(), signal.getsignal(signal.SIGTERM)

    def signal_once_running():
        deadline = time.monotonic() + 30
        while not fits.running and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the child's handler is set
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_once_running, daemon=True).start()
    with pytest.raises(SystemExit) as stopped, signals_reach(fits):
        with fits.under_way(), ThreadPoolExecutor(1) as pool:
            codes = list(pool.map(lambda root: fits.run([sys.executable, "-c", child, str(root / "got")], root),
                                  runs))
        fits.exit_if_stopped("sweep", [r.name for r, rc in zip(runs, codes) if rc != 0])
    assert stopped.value.code == 143 and codes == [143, None]
    assert (runs[0] / "got").read_text() == "SIGTERM" and (runs[0] / "returncode").read_text() == "143\n"
    assert not (runs[1] / "returncode").exists()  # never started
    assert signal.getsignal(signal.SIGTERM) is before  # the tool's handler is gone with it


def test_a_rerun_resumes_an_interrupted_run_from_its_checkpoint_and_skips_a_finished_one(tmp_path):
    """The sweep, stopped, says "rerun the sweep to resume them": its rerun started every run again from step 0 in a
    new version folder and overwrote its fit.log. As a study does, it now resumes a run from its newest checkpoint
    (fit.log appended to), skips one whose final/ exists and starts a new one as before."""
    from esrl.fit_runs import Fits
    from esrl.sweep import run_name, run_one

    class Recorded(Fits):  # the fit commands the sweep would run
        def __init__(self):
            super().__init__()
            self.calls = []

        def run(self, cmd, root, append=False):
            self.calls.append((root.name, cmd, append))
            return 0

    combos = [{"model.es.sigma": v} for v in ("0.01", "0.02", "0.03")]
    interrupted, finished, new = (tmp_path / run_name(c) for c in combos)
    ckpt = interrupted / "lightning_logs" / "version_0" / "checkpoints" / "interrupted.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"saved at step 17")
    (interrupted / "fit.log").write_text("$ the first attempt\n")
    (finished / "lightning_logs" / "version_0" / "final").mkdir(parents=True)
    (finished / "lightning_logs" / "version_0" / "final" / "config.json").write_text("{}")
    fits = Recorded()
    assert [run_one("c.yaml", c, tmp_path, ["--trainer.max_steps", "200"], fits) for c in combos] == [0, 0, 0]
    (first, cmd, append), (second, new_cmd, new_append) = fits.calls
    assert first == interrupted.name and cmd[-4:-2] == ["--ckpt_path", str(ckpt)] and append
    assert second == new.name and "--ckpt_path" not in new_cmd and not new_append


def test_a_sweep_folder_takes_only_its_own_base_config(config, tmp_path, monkeypatch, capsys):
    """Rerun into another sweep's folder with another base config, the finished runs (named by grid values alone) were
    skipped and tabled as the new sweep's, exit 0. Refused in one line before any run; new grid values, and a summary
    called with the grid alone (slurm/sweep.sbatch), are fine. The fits are recorded, not run (their code is not
    what is tested)."""
    import esrl.sweep
    from esrl.cli import main

    started = []
    monkeypatch.setattr(esrl.sweep, "run_one", lambda cfg, combo, out, extra, fits: started.append(combo) or 0)
    sweep = ["sweep", "--config", str(config), "--out", str(tmp_path / "sweep")]
    main([*sweep, "--grid", "seed_everything=0", "--", "--trainer.max_steps", "1"])
    main([*sweep, "--grid", "seed_everything=0,1", "--", "--trainer.max_steps", "1"])  # the same base, a new value
    assert len(started) == 3
    (tmp_path / "sweep" / "seed_everything=0").mkdir()
    main([*sweep, "--grid", "seed_everything=0,1", "--summarize"])
    capsys.readouterr()

    for other in ([*sweep, "--grid", "seed_everything=0", "--", "--trainer.max_steps", "2"],
                  [*sweep[:2], str(write_tiny_config(tmp_path / "b.yaml", "other-model")), *sweep[3:],
                   "--grid", "seed_everything=0", "--", "--trainer.max_steps", "1"]):
        with pytest.raises(SystemExit) as exit_:
            main(other)
        assert exit_.value.code == 2 and len(started) == 3
        assert capsys.readouterr().err.strip() == (
            f"esrl sweep: error: --out {tmp_path / 'sweep'}: holds a sweep of another base config or other flags "
            f"after -- (its grid.json: {config} --trainer.max_steps 1); its finished runs would be reported as this "
            "sweep's: use a new --out")


def test_a_copied_version_folder_and_a_cut_returncode_neither_stop_the_summary(tmp_path):
    """A user's lightning_logs/version_0_old copy ended final_dir and a study's report in int('old'); a returncode
    file cut short by a kill, the sweep's summary in int('')."""
    import json

    from esrl.fit_runs import final_dir, version_folders
    from esrl.sweep import summarize_run

    root = tmp_path / "out" / "sigma=0.1"
    for version in ("version_0_old", "version_1", "version_10", "version_2"):
        (root / "lightning_logs" / version / "final").mkdir(parents=True)
        (root / "lightning_logs" / version / "final" / "config.json").write_text("{}")
        (root / "lightning_logs" / version / "eval.jsonl").write_text(json.dumps({"step": 0, "reward": 1.0}) + "\n")
    assert [v.name for v in version_folders(root)] == ["version_1", "version_2", "version_10"]
    assert final_dir(root) == root / "lightning_logs" / "version_10" / "final"
    (root / "returncode").write_text("")
    row = summarize_run(tmp_path / "out", {"sigma": "0.1"})
    assert row["run_dir"].endswith("version_10") and row["status"] == "ok" and float(row["reward"]) == 1.0, row
