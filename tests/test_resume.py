"""Interrupted and resumed runs through the real CLI: SIGTERM and SIGINT (Ctrl+C) at a step, before training, inside
an accumulation window or an evaluation, on one and two processes (SLURM's requeue: test_resume_slurm.py)."""

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
from resume_common import CHECKPOINTS, STEPS, es_config, output_unless_hung, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def config(tiny_model, tmp_path_factory) -> Path:
    return es_config(tiny_model, tmp_path_factory.mktemp("cfg"))


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


def test_a_killed_run_keeps_the_metrics_of_its_finished_steps(config, tmp_path):
    """SIGKILL (the OOM killer, srun past its grace time) runs no handler: metrics.csv holds what was flushed. The CSV
    logger's own flush is every 100 steps; Lightning's trainer saves its loggers after each log call, so the rows of
    finished steps are on disk and a run resumed from its checkpoint keeps its history (a review read the logger's
    default alone; this pins the behaviour esrl relies on)."""
    from resume_common import train_steps

    proc = subprocess.Popen([*ESRL, "fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    version = tmp_path / "lightning_logs" / "version_0"
    try:
        wait_for(version / "checkpoints" / "step=3.ckpt", proc)  # step 2's checkpoint: its row is logged after it
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert train_steps(version / "metrics.csv")[:2] == [0, 1]


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
