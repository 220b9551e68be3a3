"""Interrupted and resumed runs through the real CLI: signals (SIGTERM, SIGINT, SLURM's requeue through
slurm/fit.sbatch), one history per run folder, the unfinished final evaluation, and what the user gave against
what the checkpoint was trained with."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ESRL, FIXTURES, ROOT, assert_same_tensors, fit_final, load_safetensors, run_esrl, write_tiny_config

pytestmark = pytest.mark.slow

CHECKPOINTS = {"enable_checkpointing": True,
               "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                              "init_args": {"every_n_train_steps": 1, "save_top_k": -1, "filename": "{step}",
                                            "save_last": True}}]}
STEPS = 5


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.1)


def output_unless_hung(proc: subprocess.Popen, timeout: float) -> str:
    """The run's output once it ends; a run still going after `timeout` s hung: killed (its session) and failed."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the ranks hung after the signal: {proc.communicate()[0][-3000:]}")


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


def train_steps(metrics_csv: Path) -> list[int]:
    import csv

    with metrics_csv.open() as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("train/reward_mean")]


@pytest.fixture(scope="module")
def config(tiny_model, tmp_path_factory) -> Path:
    return write_tiny_config(tmp_path_factory.mktemp("cfg") / "es.yaml", tiny_model, max_steps=40,
                             es={"population_size": 4, "sigma": 0.05, "alpha": 0.02}, trainer=CHECKPOINTS)


@pytest.fixture(scope="module")
def slurm_run(config, tmp_path_factory) -> dict:
    """slurm/fit.sbatch run twice as SLURM would (fixtures/fake_slurm's srun, scancel and scontrol on PATH; srun
    SIGKILLs its task on a SIGTERM of its own, as Slurm's does): SIGUSR1 (the time limit's warning) to the batch shell
    after step 2 of 40, then the requeued job with --trainer.max_steps 5."""
    tmp = tmp_path_factory.mktemp("slurm")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    root = tmp / "run"
    env = {**os.environ, "PATH": f"{bin_dir}:{FIXTURES / 'fake_slurm'}:{os.environ['PATH']}",
           "FAKE_SCONTROL_LOG": str(tmp / "scontrol.log"), "FAKE_STEP_PIDS": str(tmp / "step_pids"),
           "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1",
           "SLURM_JOB_NAME": "esrl", "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0",
           "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "ESRL": str(bin_dir / "esrl"), "ROOT": str(root),
           "PYTHONUNBUFFERED": "1"}
    (bin_dir / "esrl").write_text(f'#!/bin/sh\nexec {sys.executable} -m esrl.cli "$@"\n')
    (bin_dir / "esrl").chmod(0o755)
    version = root / "lightning_logs" / "version_0"
    first = subprocess.Popen(["bash", str(ROOT / "slurm" / "fit.sbatch"), str(config)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(version / "checkpoints" / "step=2.ckpt", first)
    first.send_signal(signal.SIGUSR1)  # SLURM's warning (--signal=B:USR1@120) goes to the batch shell
    first_out = first.communicate(timeout=240)[0]
    interrupted = version / "checkpoints" / "interrupted.ckpt"
    log = tmp / "scontrol.log"
    saved = {"rc": first.returncode, "out": first_out, "scontrol": log.read_text() if log.exists() else ""}
    if interrupted.exists():
        step = torch.load(interrupted, map_location="cpu", weights_only=True)["global_step"]
        saved.update(step=step, same_weights=all(
            torch.equal(a, b) for a, b in zip(weights(interrupted).values(),
                                              weights(version / "checkpoints" / f"step={step}.ckpt").values())))
    second = subprocess.run(["bash", str(ROOT / "slurm" / "fit.sbatch"), str(config), "--trainer.max_steps",
                             str(STEPS)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return {**saved, "second": second, "root": root, "version": version}


def test_sigterm_saves_a_resumable_checkpoint_and_exits_non_zero(slurm_run):
    assert slurm_run["rc"] == 143, slurm_run["out"][-3000:]
    assert slurm_run["scontrol"].split() == ["requeue", "4242"]  # the script's trap, after esrl stopped
    assert "step" in slurm_run, slurm_run["out"][-3000:]
    assert 2 <= slurm_run["step"] < 40 and slurm_run["same_weights"]  # at a step boundary, like step=K.ckpt
    assert f"esrl: SIGTERM at step {slurm_run['step']}: saved" in slurm_run["out"]


def test_requeued_job_resumes_into_the_same_folder_with_one_history(slurm_run):
    second, version = slurm_run["second"], slurm_run["version"]
    assert second.returncode == 0, second.stderr[-3000:]
    # the newest checkpoint: interrupted.ckpt, or last.ckpt saved at the same step end just after it
    assert any(f"Restored all states from the checkpoint at {version}/checkpoints/{name}" in second.stderr
               for name in ("interrupted.ckpt", "last.ckpt")), second.stderr[-3000:]
    assert [p.name for p in (slurm_run["root"] / "lightning_logs").iterdir()] == ["version_0"]
    assert (version / "final" / "model.safetensors").is_file()
    assert not (version / "checkpoints" / "interrupted.ckpt").exists()  # spent once the run finished
    assert train_steps(version / "metrics.csv") == list(range(STEPS))  # each step once, old and new rows
    assert [json.loads(line)["step"] for line in (version / "eval.jsonl").read_text().splitlines()] == [0, STEPS]
    seed_log = (version / "seed_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["t"] for line in seed_log[1:]] == list(range(STEPS))


def test_resume_runs_the_final_evaluation_the_interrupted_run_did_not_finish(slurm_run, config):
    """A scorer outage in the final evaluation left no step-5 row and no final/; resuming from last.ckpt (step 5,
    nothing left to train) runs that evaluation, then writes final/."""
    import shutil

    version = slurm_run["version"]
    lines = (version / "eval.jsonl").read_text().splitlines()
    (version / "eval.jsonl").write_text(lines[0] + "\n")
    shutil.rmtree(version / "final")
    out = run_esrl("fit", "--config", config, "--trainer.default_root_dir", slurm_run["root"],
                   "--trainer.max_steps", STEPS, "--ckpt_path", version / "checkpoints" / "last.ckpt")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (version / "eval.jsonl").read_text().splitlines()] == [0, STEPS]
    assert (version / "final" / "model.safetensors").is_file()


def test_sigint_stops_after_the_step_with_a_checkpoint_and_exit_130(config, tmp_path):
    proc = subprocess.Popen([*ESRL, "fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    wait_for(checkpoints / "step=1.ckpt", proc)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 130, out[-3000:]
    assert (checkpoints / "interrupted.ckpt").is_file() and "esrl: SIGINT at step" in out
    assert "Traceback" not in out and not (checkpoints.parent / "final").exists()
    assert "manual optimization" not in out  # Lightning's 12-line advice on pre-step states: not for ES
    assert "litlogger" not in out  # nor its tip to install an experiment tracker
    # nor "Received SIGTERM" (its handler, which esrl calls for a Ctrl+C too) or `weights_only` (esrl's own save)
    assert "Received SIGTERM" not in out and "weights_only" not in out, out[-3000:]
    # nor, on one device, Lightning's process-group banner (ES's strategy makes a group of one) or the note that
    # esrl's step bar replaced the default one
    assert "distributed_backend" not in out and "MEMBER: 1/1" not in out and "RichProgressBar" not in out


@pytest.mark.parametrize("when", ["importing", "Seed set", "Loading weights"])
def test_ctrl_c_before_training_is_one_line_and_exit_130(config, tmp_path, when):
    """Ctrl+C while esrl imports torch (its handling not there yet), after the parse, or inside Lightning's fit
    loading the model (Lightning's own handler: "graceful shutdown", exit 1): one esrl line and 130, as in
    training, never a KeyboardInterrupt traceback."""
    proc = subprocess.Popen([*ESRL, "fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if when == "importing":
        time.sleep(0.3)
    else:
        for line in proc.stderr:
            if when in line:
                break
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130 and "Traceback" not in err and "graceful shutdown" not in err, err[-3000:]
    # at once, or, where Python lost the KeyboardInterrupt in a finalizer, after the first step with a checkpoint
    stopped_at_once = err.strip().splitlines()[-1] == "esrl: interrupted (Ctrl+C)"
    assert stopped_at_once or "esrl: SIGINT at step 1: saved" in err, err[-3000:]
    assert not list(tmp_path.rglob("final"))


LOST_CTRL_C = """
import sys, weakref
from esrl import entry

class Held:
    pass

def lost(_):
    raise KeyboardInterrupt  # as a Ctrl+C's, arriving while Python runs this finalizer

held = Held()
ref = weakref.ref(held, lost)
sys.unraisablehook = entry._unraisable
entry.PRESSED.append(2)  # what entry's handler noted before raising
del held  # the KeyboardInterrupt is lost here, as it was once in Lightning's setup
sys.argv = ["esrl", *sys.argv[1:]]
entry.main()
"""


def test_a_ctrl_c_python_lost_in_a_finalizer_still_stops_the_run_after_its_first_step(config, tmp_path):
    """A KeyboardInterrupt raised inside a finalizer is only printed ("Exception ignored"): the run went on to
    the end and exited 0. The press noted by esrl's handler stops it after step 1 with interrupted.ckpt and 130,
    and the lost exception is no traceback on the terminal."""
    done = subprocess.run([sys.executable, "-c", LOST_CTRL_C, "fit", "--config", str(config),
                           "--trainer.default_root_dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "esrl: SIGINT at step 1: saved" in done.stderr + done.stdout
    assert list(tmp_path.rglob("interrupted.ckpt")) and not list(tmp_path.rglob("final"))


def test_what_a_ctrl_c_broke_on_its_way_is_the_interrupt_not_a_traceback():
    """A library that catches the KeyboardInterrupt mid-import fails later on the half-imported module (CI saw an
    ImportError from accelerate): after a press, that is the Ctrl+C's one line and 130."""
    script = ("import sys; from esrl import entry; entry.PRESSED.append(2); sys.modules['esrl.cli'] = None; "
              "entry.main()")  # importing esrl.cli now raises ImportError, as the half-imported module did
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (130, "esrl: interrupted (Ctrl+C)\n")


@pytest.fixture(scope="module")
def uninterrupted(config, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The config's weights after STEPS steps in one process, never stopped."""
    return load_safetensors(fit_final(config, tmp_path_factory.mktemp("whole"), "--trainer.max_steps", STEPS))


@pytest.mark.parametrize("devices", ["1", "2"])
def test_a_stop_after_an_epochs_last_step_resumes_to_the_uninterrupted_weights(config, uninterrupted, tmp_path,
                                                                               monkeypatch, devices):
    """3 prompts, one a step: a SIGTERM at step 2 (to rank 0 alone) stops after the epoch's last batch. Saved from
    on_exception, after Lightning counted that batch done, the checkpoint resumed into other weights; saved where
    ModelCheckpoint saves, it resumes to the weights of the run that never stopped (on one or two processes)."""
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    stop = ["--trainer.callbacks+=signal_at_step.SignalAtStep", "--trainer.callbacks.at=2",
            "--trainer.devices", devices]
    out = run_esrl("fit", "--config", config, "--trainer.default_root_dir", tmp_path, *stop)
    assert out.returncode == 143, out.stderr[-3000:]
    ckpt = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "interrupted.ckpt"
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 3
    resumed = run_esrl("fit", "--config", config, "--trainer.default_root_dir", tmp_path, "--trainer.devices", devices,
                       "--trainer.max_steps", STEPS, "--ckpt_path", ckpt)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_tensors(uninterrupted, load_safetensors(ckpt.parent.parent / "final" / "model.safetensors"))


def test_a_stop_inside_an_accumulation_window_waits_for_its_optimizer_step(tiny_model, tmp_path, monkeypatch):
    """GRPO rolls a window's prompts out at its first micro-batch, so a checkpoint inside the window cannot resume
    it (the resumed run crashed: no rollouts for the window's second micro-batch). A SIGTERM during step 1's first
    micro-batch stops after step 2's optimizer step; resumed, the weights are those of the run that never stopped."""
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    config = write_tiny_config(tmp_path / "grpo.yaml", tiny_model, max_steps=3, grpo={"num_generations": 4},
                               rollout={"temperature": 1.0}, trainer={**CHECKPOINTS, "accumulate_grad_batches": 2})
    whole = fit_final(config, tmp_path / "whole", "--algo", "grpo")
    stopped = tmp_path / "stopped"
    out = run_esrl("fit", "--config", config, "--algo", "grpo", "--trainer.default_root_dir", stopped,
                   "--trainer.callbacks+=signal_at_step.SignalAtStep", "--trainer.callbacks.at=1")
    assert out.returncode == 143, out.stderr[-3000:]
    ckpt = stopped / "lightning_logs" / "version_0" / "checkpoints" / "interrupted.ckpt"
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 2
    resumed = run_esrl("fit", "--config", config, "--algo", "grpo", "--trainer.default_root_dir", stopped,
                       "--ckpt_path", ckpt)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_tensors(load_safetensors(whole), load_safetensors(ckpt.parent.parent / "final" / "model.safetensors"))


@pytest.mark.parametrize("to", ["every rank", "rank 0"])
def test_a_signal_stops_two_ranks_after_one_step_and_they_resume_to_one_process_weights(config, uninterrupted,
                                                                                        tmp_path, to):
    """Two processes: a terminal's Ctrl+C reaches every rank, SLURM's trap signals rank 0 alone (its srun task).
    Either way every rank stops after the same step with interrupted.ckpt and exits 130 / 143. (Lightning's own
    handler broadcast inside the signal handler: both ways, the two ranks hung with no checkpoint.) Resumed on two
    ranks to step 5, the weights are those of one process that never stopped."""
    proc = subprocess.Popen([*ESRL, "fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path),
                             "--trainer.devices", "2"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    wait_for(checkpoints / "step=1.ckpt", proc)
    if to == "every rank":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    out = output_unless_hung(proc, timeout=120)
    assert proc.returncode == (130 if to == "every rank" else 143), out[-3000:]
    assert (checkpoints / "interrupted.ckpt").is_file() and "Traceback" not in out
    resumed = run_esrl("fit", "--config", config, "--trainer.default_root_dir", tmp_path, "--trainer.devices", "2",
                       "--trainer.max_steps", STEPS, "--ckpt_path", checkpoints / "interrupted.ckpt")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_tensors(uninterrupted, load_safetensors(checkpoints.parent / "final" / "model.safetensors"))


@pytest.mark.parametrize("devices", ["1", "2"])
def test_a_signal_during_the_evaluation_before_training_stops_after_the_first_step(config, tmp_path, monkeypatch,
                                                                                     devices):
    """The configs list Evaluation among the trainer's callbacks, ahead of the module's Interruption, so a signal
    during the evaluation before training (minutes on a large model) reached Lightning's own handler, which
    broadcasts from inside it wherever the ranks are, the evaluation's own collectives included (two ranks: here
    both happened to be between collectives and stopped at step 0, through that broadcast). Now the evaluation runs at
    the first step's start, after every on_train_start: the stop is noted and taken after step 1, with
    interrupted.ckpt and exit 143, on one rank or two."""
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    proc = subprocess.Popen([*ESRL, "fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path),
                             "--trainer.devices", devices,
                             "--trainer.callbacks+=signal_at_step.SignalDuringEvaluation"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = output_unless_hung(proc, timeout=240)
    assert proc.returncode == 143, out[-3000:]
    ckpt = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "interrupted.ckpt"
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 1, out[-5000:]
    evaluations = (ckpt.parent.parent / "eval.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in evaluations] == [0], out[-3000:]


def test_resume_with_other_hyperparameters_is_one_line_listing_each(slurm_run, config, tmp_path):
    ckpt = slurm_run["version"] / "checkpoints" / "step=1.ckpt"
    out = run_esrl("fit", "--config", config, "--ckpt_path", ckpt, "--trainer.default_root_dir", tmp_path,
                   "--model.es.alpha", "0.05", "--model.es.population_size", "6", "--model.es.mode", "lowrank",
                   "--seed_everything", "7", "--model.policy.name_or_path", tmp_path)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.startswith("esrl: error:")]
    assert len(lines) == 1, out.stderr[-3000:]
    for conflict in ("model.es.alpha 0.02 in the checkpoint, 0.05 given",
                     "model.es.population_size 4 in the checkpoint, 6 given",
                     "model.es.mode 'full' in the checkpoint, 'lowrank' given",
                     "seed_everything 3 in the checkpoint, 7 given", f"{tmp_path}' given"):
        assert conflict in lines[0], lines[0]
    assert "Traceback" not in out.stderr


def test_an_es_checkpoint_resumed_with_grpo_says_so(slurm_run, config, tmp_path):
    ckpt = slurm_run["version"] / "checkpoints" / "step=1.ckpt"
    out = run_esrl("fit", "--config", config, "--ckpt_path", ckpt, "--algo", "grpo",
                   "--trainer.default_root_dir", tmp_path)
    assert out.returncode == 2
    assert f"esrl: error: --ckpt_path {ckpt}: a checkpoint of an ES run, but --algo grpo; resume it with --algo es" \
        in out.stderr and "Traceback" not in out.stderr


def test_resume_plan_keeps_the_checkpoints_values_and_lets_safe_ones_win():
    """Left at the default: the checkpoint's value (Lightning restores it); given and in MAY_CHANGE: the given
    value; a GRPO checkpoint refused under ES; the run seed taken from the checkpoint when not given."""
    from esrl.errors import ConfigError
    from esrl.resume import plan_resume

    ckpt = {"hyper_parameters": {"policy": {"name_or_path": "m"}, "es": {"alpha": 0.02, "checksum_every": 10}},
            "datamodule_hyper_parameters": {"task": "conciseness", "eval_batch_size": 16},
            "esrl_es": {"noise_seed": 3}}
    given = {"algo": "es", "seed_everything": 0, "model": {"policy": {"name_or_path": "m"},
                                                          "es": {"alpha": 5e-4, "checksum_every": 2}},
             "data": {"task": "conciseness", "eval_batch_size": 4}}
    plan = plan_resume("x.ckpt", ckpt, given)
    assert plan.overrides == {"model.es.checksum_every": 2, "data.eval_batch_size": 4} and plan.seed == 3
    with pytest.raises(ConfigError, match="data.task 'conciseness' in the checkpoint, 'countdown' given"):
        plan_resume("x.ckpt", ckpt, {**given, "data": {"task": "countdown"}})
    with pytest.raises(ConfigError, match="a checkpoint of a GRPO run, but --algo es; resume it with --algo grpo"):
        plan_resume("x.ckpt", {"hyper_parameters": {"grpo": {}}, "esrl_grpo": {"run_seed": 0}}, given)
    with pytest.raises(ConfigError, match="a checkpoint of an ES run, but --algo grpo; resume it with --algo es"):
        plan_resume("x.ckpt", ckpt, {**given, "algo": "grpo"})


def test_a_value_typed_equal_to_the_default_is_given_too(tmp_path):
    """`--model.es.alpha 5e-4` (the default) or `alpha: 5e-4` in a --config / -c file or a global config's `fit:`
    against a checkpoint trained with 0.02 is a conflict, not silently the checkpoint's; unwritten: the checkpoint's."""
    from esrl.errors import ConfigError
    from esrl.resume import explicit_fields, plan_resume

    ckpt = {"hyper_parameters": {"es": {"alpha": 0.02}}, "esrl_es": {"noise_seed": 3}}
    given = {"algo": "es", "seed_everything": 0, "model": {"es": {"alpha": 5e-4}}}
    assert plan_resume("x.ckpt", ckpt, given, explicit=explicit_fields(["fit"])).seed == 3
    for argv in (["fit", "--model.es.alpha", "0.0005"], ["fit", "--model.es.alpha=0.0005"]):
        with pytest.raises(ConfigError, match="model.es.alpha 0.02 in the checkpoint, 0.0005 given"):
            plan_resume("x.ckpt", ckpt, given, explicit=explicit_fields(argv))
    config, global_config = tmp_path / "c.yaml", tmp_path / "g.yaml"
    config.write_text("seed_everything: 0\nmodel:\n  es:\n    alpha: 0.0005\n")
    global_config.write_text("fit:\n  seed_everything: 0\n  model:\n    es:\n      alpha: 0.0005\n")
    for argv in (["fit", "--config", config], ["fit", "-c", config], ["fit", f"-c={config}"], [f"--config={config}"],
                 ["--config", global_config, "fit"], ["-c", global_config, "fit", "--trainer.max_steps", "3"]):
        with pytest.raises(ConfigError, match="model.es.alpha 0.02 in the checkpoint, 0.0005 given; seed_everything 3"):
            plan_resume("x.ckpt", ckpt, given, explicit=explicit_fields([str(a) for a in argv]))
    assert "model.es.alpha" not in explicit_fields(["-c", str(global_config), "validate"])  # not validate's section


def test_ckpt_path_last_is_the_newest_checkpoint_of_the_root_or_one_line(slurm_run, config, tmp_path):
    """`--ckpt_path last` trained from step 0 with exit 0 (Lightning looked in this fit's new version folder). Now
    the root's newest version_*/checkpoints/{last,interrupted}.ckpt: conflicts checked, its folder continued."""
    root, last = slurm_run["root"], slurm_run["version"] / "checkpoints" / "last.ckpt"
    fit = ["fit", "--config", config, "--trainer.default_root_dir", root, "--ckpt_path", "last"]
    out = run_esrl(*fit, "--trainer.max_steps", 1, "--model.es.alpha", "0.05")
    assert out.returncode == 2 and f"esrl: error: --ckpt_path {last} was trained with other settings than given: " \
        "model.es.alpha 0.02 in the checkpoint, 0.05 given" in out.stderr, out.stderr[-3000:]
    out = run_esrl(*fit, "--trainer.max_steps", STEPS)
    assert out.returncode == 0 and f"Restored all states from the checkpoint at {last}" in out.stderr, out.stderr
    assert [p.name for p in (root / "lightning_logs").iterdir()] == ["version_0"]
    out = run_esrl(*fit[:4], tmp_path, *fit[5:])
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"esrl: error: --ckpt_path last: no checkpoint to resume in {tmp_path}/lightning_logs/version_*/checkpoints "
        "(last.ckpt or interrupted.ckpt); give a checkpoint file, or start without --ckpt_path"], out.stderr[-3000:]
