"""`esrl study` end to end on the tiny model: 2 seeds x {ES, GRPO}, 1 step each, then the report.

The report's numbers are checked against the runs' own files (eval.jsonl, final/ weights); a rerun skips the
finished runs and resumes one whose final/ is gone from its checkpoint; bad study files fail before any run.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from statistics import fmean, stdev

import pytest
import yaml
from conftest import FIXTURES, ROOT, run_esrl

from esrl.sweep import hacked

pytestmark = pytest.mark.slow


def base_config(tiny_model: str) -> dict:
    return {
        "seed_everything": 0, "algo": "es",
        "model": {"policy": {"name_or_path": str(tiny_model)}, "rollout": {"max_new_tokens": 4},
                  "es": {"population_size": 2, "sigma": 0.05, "alpha": 0.02},
                  "grpo": {"num_generations": 2, "learning_rate": 1e-2}},
        "data": {"task": "conciseness", "prompts_per_step": 1,
                 "task_args": {"train_path": str(FIXTURES / "conciseness_train3.jsonl"),
                               "eval_path": str(FIXTURES / "conciseness_eval2.jsonl")}},
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 1, "enable_progress_bar": False,
                    "enable_model_summary": False, "enable_checkpointing": False,
                    "callbacks": [{"class_path": "esrl.callbacks.Evaluation",
                                   "init_args": {"num_samples": 2, "kl": True}}]},
    }


def write_study(folder: Path, tiny_model: str, **changes) -> Path:
    (folder / "base.yaml").write_text(yaml.safe_dump(base_config(tiny_model)))
    study = {"name": "tiny", "base_config": "base.yaml", "out": str(folder / "out"), "seeds": [0, 1],
             "algorithms": {"es": None, "grpo": {"algo": "grpo", "overrides": {"model.grpo.beta": 0.0}}},
             "checkpoint_every_n_steps": 1, "keep_checkpoints": True,
             "analysis": {"num_prompts": 2, "alphas": [0, 0.5, 1], "sigmas": [0, 0.05]}, **changes}
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


@pytest.fixture(scope="module")
def study(tiny_model, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("study")
    path = write_study(folder, tiny_model)
    res = run_esrl("study", path, "--jobs", 2, timeout=900)  # 4 fits, 2 at a time: about 40 s on 2 idle cores
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count(": ok (") == 4
    return path


def final_eval(run: Path) -> dict:
    lines = (run / "lightning_logs" / "version_0" / "eval.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


def ci95(values: list[float]) -> float:
    return 12.706 * stdev(values) / math.sqrt(len(values))  # Student t, 1 degree of freedom


def test_report_numbers_are_the_runs_own(study):
    out = study.parent / "out"
    summary = json.loads((out / "summary.json").read_text())
    report = (out / "report.md").read_text()
    groups = {g["algorithm"]: g for g in summary["groups"]}
    assert set(groups) == {"es", "grpo"}
    for algo, g in groups.items():
        evals = [final_eval(out / "runs" / f"{algo}_seed={s}") for s in (0, 1)]
        assert g["seeds"] == [0, 1] and g["hacked_runs"] == [f"{algo}_seed={s}" for s in (0, 1) if hacked(evals[s])]
        for metric in ("reward", "kl", "sampled/reward", "pass@2", "hacking/empty"):
            values = [e[metric] for e in evals]
            assert g[metric]["values"] == pytest.approx(values), (algo, metric)
            assert g[metric]["mean"] == pytest.approx(fmean(values))
            assert g[metric]["ci95"] == pytest.approx(ci95(values), abs=1e-12)
        cell = f"{g['reward']['mean']:.4g} ± {g['reward']['ci95']:.2g}"
        assert f"| {algo} | all | 2 |" in report and cell in report
    for png in ("curves.png", "cosine_all.png", "unembedding_all.png", "connectivity_all_seed=0.png",
                "robustness_all.png", "similarity_all.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"]({png})" in report


def test_weight_analyses_match_the_final_weights(study, tiny_model):

    from esrl.models import load_causal_lm

    out = study.parent / "out"
    numbers = json.loads((out / "summary.json").read_text())["analyses"]["all"]
    base = dict(load_causal_lm(tiny_model).named_parameters())
    deltas = {}
    for algo in ("es", "grpo"):
        for s in (0, 1):
            final = out / "runs" / f"{algo}_seed={s}" / "lightning_logs" / "version_0" / "final"
            model = load_causal_lm(str(final))
            deltas[f"{algo}/s{s}"] = {n: (p.double() - base[n].double()) for n, p in model.named_parameters()}
    # Unembedding share: the tiny Llama ties its embeddings, so it is the embedding matrix's share of |delta|^2.
    emb = "model.embed_tokens.weight"
    share = numbers["unembedding_share"]
    assert share["unit"] == "embeddings=unembedding (tied)"
    moved = 0
    for algo in ("es", "grpo"):
        totals = [float(sum(d.square().sum() for d in deltas[f"{algo}/s{s}"].values())) for s in (0, 1)]
        want = [float(deltas[f"{algo}/s{s}"][emb].square().sum()) / t for s, t in zip((0, 1), totals) if t > 0]
        assert share["by_algorithm"][algo] == pytest.approx(want, rel=1e-6)  # a run that did not move has no share
        moved += len(want)
    assert moved >= 2
    # Whole-model cosine across algorithms: the 4 ES x GRPO pairs, from the deltas themselves.
    cos = numbers["cosine"]
    assert sorted(cos) == ["es vs es", "es vs grpo", "grpo vs grpo"] and len(cos["es vs grpo"]["pairs"]) == 4

    def whole(a: str, b: str) -> float:
        dot = sum(float((deltas[a][n] * deltas[b][n]).sum()) for n in base)
        na = math.sqrt(sum(float(d.square().sum()) for d in deltas[a].values()))
        nb = math.sqrt(sum(float(d.square().sum()) for d in deltas[b].values()))
        return dot / (na * nb) if na * nb > 0 else None  # a run that did not move has no direction

    want = [whole(*p.split("|")) for p in cos["es vs grpo"]["pairs"]]
    assert cos["es vs grpo"]["whole_model"] == pytest.approx(want, abs=1e-9)
    assert cos["es vs es"]["whole_model"] == pytest.approx([whole("es/s0", "es/s1")], abs=1e-9)
    # Connectivity base -> run ends at the run's own final greedy reward (the whole 2-prompt eval split).
    ends = sorted((p["kind"], p["b"] if p["kind"] == "base->run" else f"{p['a']}->{p['b']}")
                  for p in numbers["connectivity"])
    assert ends == [("base->run", "es/s0"), ("base->run", "grpo/s0"), ("run->run", "es/s0->grpo/s0")]
    conn = json.loads((out / "analysis" / "all" / "connectivity_seed=0" / "connectivity.json").read_text())
    for pair in conn["pairs"]:
        if pair["kind"] == "base->run":
            algo = pair["b"].split("/")[0]
            assert pair["points"][-1]["reward"] == pytest.approx(final_eval(out / "runs" / f"{algo}_seed=0")["reward"])
    rob = numbers["robustness"]
    assert set(rob) == {"es/s0", "grpo/s0"}
    for label, groups in rob.items():
        assert groups["all"][0] == pytest.approx(final_eval(out / "runs" / f"{label.split('/')[0]}_seed=0")["reward"])


def test_rerun_skips_finished_runs_and_resumes_an_interrupted_one(study, capsys):
    from esrl.study.cli import main

    out = study.parent / "out"
    runs = out / "runs"
    logs = {p.name: (p / "fit.log").read_text() for p in runs.iterdir()}
    victim = runs / "grpo_seed=1"
    assert list((victim / "checkpoints").glob("*.ckpt"))
    shutil.rmtree(victim / "lightning_logs" / "version_0" / "final")  # as if killed after its last checkpoint
    main([str(study), "--report"])  # runs nothing; the report names the unfinished run
    assert "grpo_seed=1" in (out / "report.md").read_text().split("Not finished", 1)[1].splitlines()[0]
    capsys.readouterr()
    main([str(study)])
    printed = capsys.readouterr().out
    assert printed.count("done (final/ exists), skipped") == 3
    assert "grpo_seed=1: resuming from step=1.ckpt" in printed and "grpo_seed=1: ok" in printed
    for name, text in logs.items():
        now = (runs / name / "fit.log").read_text()
        assert now == text if name != victim.name else (now.startswith(text) and "--ckpt_path" in now[len(text):])
    tree = sorted(str(p.relative_to(victim)) for p in victim.glob("lightning_logs/*/*"))
    assert list(victim.glob("lightning_logs/version_*/final/config.json")), tree  # the resumed fit's final/
    summary = json.loads((out / "summary.json").read_text())
    assert {g["algorithm"]: len(g["seeds"]) for g in summary["groups"]} == {"es": 2, "grpo": 2}


def test_slurm_array_task_runs_its_run_then_writes_the_report(study):
    """slurm/sweep.sbatch with ESRL_TOOL=study as SLURM runs array task 3 (no SLURM here: the script runs under
    bash with the array index set): its run (finished: skipped), then the report, since every run is done."""
    out = study.parent / "out"
    (out / "report.md").unlink()
    env = {**os.environ, "ESRL_TOOL": "study", "SLURM_ARRAY_TASK_ID": "3",
           "ESRL": str(Path(sys.executable).parent / "esrl")}
    res = subprocess.run(["bash", str(ROOT / "slurm" / "sweep.sbatch"), str(study), str(out)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "skipped" in res.stdout and (out / "report.md").is_file()


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


def test_an_interrupted_runs_newest_checkpoint_is_its_interrupted_ckpt_or_a_newer_periodic_one(tmp_path):
    """A signal saves lightning_logs/version_N/checkpoints/interrupted.ckpt, not in the study's checkpoints/: the
    run is interrupted and resumes from the newer of the two (it restarted from step 0, or an older step)."""
    from esrl.study.config import AlgorithmSpec
    from esrl.fit_runs import last_checkpoint
    from esrl.study.runner import Run, status

    run = Run(AlgorithmSpec("es", "es", {}), {}, 0, tmp_path / "es_seed=0")
    interrupted = run.root / "lightning_logs" / "version_0" / "checkpoints" / "interrupted.ckpt"
    interrupted.parent.mkdir(parents=True)
    interrupted.write_bytes(b"x")
    (run.root / "fit.log").write_text("...\nesrl: SIGTERM at step 3: saved ...\n")
    (run.root / "returncode").write_text("143\n")
    assert last_checkpoint(run.root) == interrupted and status(run) == "interrupted"
    older = [run.root / "checkpoints" / "step=2.ckpt", run.root / "lightning_logs/version_1/checkpoints/last.ckpt"]
    for when, ckpt in enumerate(older):  # saved before the signal
        ckpt.parent.mkdir(parents=True)
        ckpt.write_bytes(b"x")
        os.utime(ckpt, (1_000_000 + when, 1_000_000 + when))
    assert last_checkpoint(run.root) == interrupted
    pick = re.search(r"^CKPT=\$\((.*)\)$", (ROOT / "slurm" / "fit.sbatch").read_text(), re.M).group(1)
    shell = subprocess.run(["bash", "-c", pick], env={**os.environ, "ROOT": str(run.root)}, capture_output=True,
                           text=True)
    assert shell.stdout.strip() == str(interrupted)  # slurm/fit.sbatch's pick is the same
    periodic = older[0]
    os.utime(periodic, (4_000_000_000, 4_000_000_000))  # the resumed run went on past the interrupted step
    assert last_checkpoint(run.root) == periodic


def test_sigterm_stops_the_running_fits_with_their_checkpoints_and_a_rerun_resumes_them(tiny_model, tmp_path):
    """SIGTERM to `esrl study` (kill, SLURM's time limit) reaches its running fits: each stops after its step
    with interrupted.ckpt, the study exits 143, and a rerun resumes each from that checkpoint into its folder.
    Before, the fits ran to the end (the signal reached only the study's main thread, which waited for them)."""
    import signal
    import time

    path = write_study(tmp_path, tiny_model, algorithms={"es": None}, checkpoint_every_n_steps=0,
                       overrides={"trainer.max_steps": 1000})
    runs = [tmp_path / "out" / "runs" / f"es_seed={s}" for s in (0, 1)]
    proc = subprocess.Popen([sys.executable, "-m", "esrl", "study", str(path), "--jobs", "2"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 300
        while not all((r / "lightning_logs" / "version_0" / "eval.jsonl").is_file() for r in runs):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # the study alone, as `kill PID` does
        out = proc.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the study did not stop its fits: " + proc.communicate()[0][-3000:])
    assert proc.returncode == 143, out[-3000:]
    assert out.count("interrupted by SIGTERM") == 2 and "report" not in out, out[-3000:]
    for run in runs:
        assert (run / "lightning_logs" / "version_0" / "checkpoints" / "interrupted.ckpt").is_file(), out[-3000:]
        assert not (run / "lightning_logs" / "version_0" / "final").exists()
    path = write_study(tmp_path, tiny_model, algorithms={"es": None}, checkpoint_every_n_steps=0,
                       overrides={"trainer.max_steps": 2})
    res = run_esrl("study", path, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("resuming from interrupted.ckpt") == 2, res.stdout
    for run in runs:
        assert [p.name for p in (run / "lightning_logs").iterdir()] == ["version_0"]  # resumed into its folder
        assert (run / "lightning_logs" / "version_0" / "final" / "config.json").is_file()
        assert "Restored all states from the checkpoint" in (run / "fit.log").read_text()
