"""`esrl study`'s inputs: a bad study file, grid value, --jobs or --out is one line before any run; --count and
--dry-run plan without writing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import run_esrl
from study_files import write_study

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("change, message", [
    ({"algorithms": ["es", "ppo"]}, "algorithms.ppo.algo: unknown algorithm 'ppo'"),
    ({"grid": {"model.es.sigmaa": [0.1, 0.2]}}, "grid.model.es.sigmaa: 'model.es.sigmaa' is not a config field"),
    ({"overrides": {"data.task": "nosuchtask"}}, "data.task: unknown task 'nosuchtask'"),
    ({"seeds": [0, 0]}, "seeds: seeds must differ"),
    ({"seeds": [True, 2]}, "seeds: a non-empty list of integers, got "),  # True is an int to Python
    # wrong shapes: AttributeError / TypeError tracebacks where the study first read them
    ({"grid": ["model.es.sigma"]}, "grid: expected a mapping, got ['model.es.sigma']"),
    ({"overrides": ["trainer.max_steps"]}, "overrides: expected a mapping, got "),
    ({"algorithms": {"es": {"algo": "es", "overide": {}}}}, "algorithms.es.overide: unknown study field"),
    ({"algorithms": [{"algo": "es"}]}, "algorithms[0]: a mapping in the list needs its label"),
    ({"out": None}, "out: expected a string, got None"),
    ({"seeds": 0}, "seeds: expected a list, got 0"),
    ({"checkpoint_every_n_steps": "2"}, "checkpoint_every_n_steps: expected an integer, got '2'"),
    ({"analysis": {"analyses": "similarity"}}, "analysis.analyses: expected a list, got 'similarity'"),
    # set by the study: a grid of seed_everything gave points in their own folders that ran one config
    ({"grid": {"seed_everything": [1, 2]}}, "grid.seed_everything: 'seed_everything' is set by the study (seeds)"),
    ({"overrides": {"trainer.default_root_dir": "x"}}, "overrides.trainer.default_root_dir: 'trainer.default_root_"),
    ({"overrides": {"model.es.seed": 3}}, "overrides: model.es.seed is fixed, so every seed of the study would draw"),
    # analysis settings that failed only in the report, after every fit
    ({"analysis": {"alphas": [0, 0.5, 1, 1.5]}}, "analysis.alphas: must lie in [0, 1] and include both"),
    ({"analysis": {"sigmas": [0, -1]}}, "analysis.sigmas: must be finite non-negative numbers"),
    ({"analysis": {"alphas": [0, "0.5", 1]}}, "analysis.alphas: must lie in [0, 1] and include both"),
])
def test_bad_study_file_is_one_line_before_any_run(tiny_model, tmp_path, change, message):
    from esrl.errors import ConfigError
    from esrl.study.config import load_study

    path = write_study(tmp_path, tiny_model, **change)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_study(path)
    assert not (tmp_path / "out").exists()


def test_jobs_below_one_is_refused_as_by_sweep(tiny_model, tmp_path, capsys):
    """`esrl study --jobs 0` ran one run at a time without a word; `esrl sweep` refuses it."""
    from esrl.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["study", str(write_study(tmp_path, tiny_model)), "--jobs", "0"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "esrl study: error: --jobs 0: must be >= 1 (the number of runs at once)"]


def test_a_study_file_given_twice_over_is_refused(tiny_model, tmp_path, capsys):
    """`esrl study A.yaml --config B.yaml` ran B and dropped A without a word."""
    from esrl.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["study", "a.yaml", "--config", "b.yaml", "--count"])
    assert exit_.value.code == 2 and capsys.readouterr().err.strip() == (
        "esrl study: error: two study files, a.yaml and --config b.yaml: give one")
    path = write_study(tmp_path, tiny_model)  # one file, spelled two ways
    main(["study", str(path), "--config", str(path.parent / "." / path.name), "--count"])
    assert capsys.readouterr().out.strip() == "4"


def test_bad_study_file_through_the_cli(tiny_model, tmp_path, capsys):
    from esrl.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["study", str(write_study(tmp_path, tiny_model, grid={"trainer.max_stepz": [1]}))])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "esrl study: error: grid.trainer.max_stepz: 'trainer.max_stepz' is not a config field (trainer has no "
        "'max_stepz'; it has: see `esrl fit --help`)"]
    assert not (tmp_path / "out").exists()


def test_study_out_that_is_a_file_is_one_line_before_any_run(tiny_model, tmp_path, capsys):
    from esrl.cli import main

    (tmp_path / "out").write_text("a file, not the study folder\n")
    path = write_study(tmp_path, tiny_model)
    with pytest.raises(SystemExit) as exit_:
        main(["study", str(path)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"esrl study: error: out: {tmp_path / 'out'} cannot be a folder: {tmp_path / 'out'} is a file"]
    with pytest.raises(SystemExit):  # --out below a file: named as --out
        main(["study", str(path), "--out", str(tmp_path / "out" / "below")])
    below = tmp_path / "out" / "below"
    assert capsys.readouterr().err.strip().startswith(f"esrl study: error: --out: {below} cannot be a folder")
    assert (tmp_path / "out").is_file()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc (a real folder nothing is made in)")
def test_a_study_out_where_nothing_can_be_written_is_counted_and_planned_then_refused(tiny_model, tmp_path, capsys):
    """--count writes nothing: an --out where no folder can be made (here under /proc; a read-only share) counts as
    anywhere. --dry-run prints the plan, then the line its first run would stop at; a run is refused in one line
    before anything starts. A sweep likewise."""
    from esrl.cli import main

    path = write_study(tmp_path, tiny_model)
    main(["study", str(path), "--out", "/proc/study", "--count"])
    assert capsys.readouterr().out.strip() == "4"
    unwritable = "cannot be written: no folder can be made in /proc (No such file or directory)"
    with pytest.raises(SystemExit) as exit_:
        main(["study", str(path), "--out", "/proc/study", "--dry-run"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and len(out.strip().splitlines()) == 4
    assert err.strip() == ("esrl study: error: es_seed=0: trainer.default_root_dir: /proc/study/runs/es_seed=0 "
                           + unwritable)
    with pytest.raises(SystemExit) as exit_:
        main(["study", str(path), "--out", "/proc/study"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == f"esrl study: error: --out: /proc/study {unwritable}"
    sweep = ["sweep", "--config", str(tmp_path / "base.yaml"), "--out", "/proc/sweep", "--grid", "seed_everything=0,1"]
    with pytest.raises(SystemExit) as exit_:
        main([*sweep, "--dry-run"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and len(out.strip().splitlines()) == 2 and "/proc/sweep/seed_everything=0" in err
    with pytest.raises(SystemExit) as exit_:
        main(sweep)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == f"esrl sweep: error: --out: /proc/sweep {unwritable}"


@pytest.mark.parametrize("grid, message", [
    ({"model.es.sigma": [0.05, -1]}, "es_sigma=-1_seed=0: model.es.sigma: must be > 0, got -1"),
    ({"model.rollout.max_new_tokens": [4, "many"]},
     'es_max_new_tokens=many_seed=0: Parser key "model.rollout.max_new_tokens": Expected a <class \'int\'>'),
])
def test_a_bad_grid_value_is_one_line_naming_its_run_before_any_run(tiny_model, tmp_path, capsys, grid, message):
    """Grid values are checked as each run's fit checks them (esrl.fit_check) before the first run starts: not
    a failed fit.log after the runs before it."""
    from esrl.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["study", str(write_study(tmp_path, tiny_model, grid=grid))])
    assert exit_.value.code == 2
    (error,) = capsys.readouterr().err.strip().splitlines()
    assert error.startswith("esrl study: error: " + message), error
    assert not (tmp_path / "out").exists()


def test_dry_run_prints_each_runs_fit_command_which_fit_accepts(tiny_model, tmp_path):
    """--dry-run's lines are `esrl fit` commands (over the base config, the run's keys as flags) that fit's own checks
    accept, one per run, and it writes nothing."""
    import shlex

    from esrl.fit_check import check_fit_args

    path = write_study(tmp_path, tiny_model, grid={"model.rollout.max_new_tokens": [4, 6]})
    out = run_esrl("study", path, "--dry-run")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 * 2 * 2 and not (tmp_path / "out").exists()  # algorithms x grid points x seeds
    commands = {}
    for line in lines:
        name, command = line.split(" (new): ")
        words = shlex.split(command.split(" # + ")[0])
        assert words[:2] == ["esrl", "fit"] and f"--trainer.default_root_dir {tmp_path / 'out' / 'runs' / name}" \
            in " ".join(words)
        commands[name] = words[2:]
    assert "--model.rollout.max_new_tokens 6 --seed_everything 1 --algo grpo" in " ".join(
        commands["grpo_max_new_tokens=6_seed=1"])
    check_fit_args(list(commands.items()))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on a GPU machine the GPU need is met")
def test_a_dry_run_where_the_runs_cannot_run_prints_its_plan_then_the_problem(tiny_model, tmp_path):
    """Planned on a machine without the runs' GPUs: the plan, then the one line that a real run would stop at."""
    path = write_study(tmp_path, tiny_model, overrides={"trainer.accelerator": "gpu"})
    out = run_esrl("study", path, "--dry-run")
    assert out.returncode == 2 and len(out.stdout.strip().splitlines()) == 4, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == [
        "esrl study: error: es_seed=0: trainer.accelerator: gpu needs 1 CUDA GPU(s) (0 found; on a CPU pass "
        "--trainer.accelerator cpu)"]
    assert not (tmp_path / "out").exists()


def test_a_cell_over_fewer_seeds_than_its_group_says_so():
    """A metric some seeds never logged (a count logged only when above 0) is a mean over the others: the table
    said nothing, under a "seeds 3" column."""
    from esrl.study.report import _fmt

    assert _fmt({"mean": 3.0, "ci95": None, "n": 1}, seeds=3) == "3 (n=1)"
    assert _fmt({"mean": 0.5, "ci95": 0.25, "n": 3}, seeds=3) == "0.5 ± 0.25"
