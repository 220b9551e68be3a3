"""Signals at the edges of a fit, through the real CLI: before esrl takes the signals over, during the final
evaluation, and a second Ctrl+C. Each ends in a resumable state or in esrl's own line and exit code."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from conftest import ESRL, FIXTURES, ROOT, run_esrl, write_tiny_config

pytestmark = pytest.mark.slow


def _ckpt(root):
    return root / "lightning_logs" / "version_0" / "checkpoints" / "interrupted.ckpt"


def test_a_signal_during_the_final_evaluation_stops_it_with_a_checkpoint_of_the_last_step(tiny_model, tmp_path,
                                                                                          monkeypatch):
    """A SIGTERM during the evaluation after the last step was only noted: the run went on through the evaluation
    and final/ and exited 0, and a scheduler's SIGKILL at the end of its grace period lost everything. Now the
    evaluation stops at once with interrupted.ckpt at the last step and exit 143; the resume runs that evaluation
    and writes final/."""
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    config = write_tiny_config(tmp_path / "es.yaml", tiny_model, max_steps=2, es={"population_size": 4})
    out = run_esrl("fit", "--config", config, "--trainer.default_root_dir", tmp_path,
                   "--trainer.callbacks+=signal_at_step.SignalDuringEvaluation", "--trainer.callbacks.at=after")
    assert out.returncode == 143, out.stderr[-3000:]
    ckpt = _ckpt(tmp_path)
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 2
    run = ckpt.parent.parent
    assert not (run / "final").exists() and "Traceback" not in out.stderr
    assert [json.loads(line)["step"] for line in (run / "eval.jsonl").read_text().splitlines()] == [0]
    resumed = run_esrl("fit", "--config", config, "--trainer.default_root_dir", tmp_path, "--ckpt_path", ckpt)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (run / "eval.jsonl").read_text().splitlines()] == [0, 2]
    assert (run / "final" / "model.safetensors").is_file() and not ckpt.exists()


def test_a_signal_noted_just_before_the_final_evaluation_stops_it_at_once(tiny_model, tmp_path, monkeypatch):
    """A SIGTERM after the last step's check and before the final evaluation (during its ModelCheckpoint save) was
    only noted: the whole evaluation ran, then the run stopped, and a scheduler's SIGKILL could land in it. Now the
    evaluation does not start: interrupted.ckpt at the last step, exit 143, no final record in eval.jsonl."""
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    config = write_tiny_config(tmp_path / "es.yaml", tiny_model, max_steps=2, es={"population_size": 4})
    out = run_esrl("fit", "--config", config, "--trainer.default_root_dir", tmp_path,
                   "--trainer.callbacks+=signal_at_step.SignalAtTrainEnd")
    assert out.returncode == 143, out.stderr[-3000:]
    ckpt = _ckpt(tmp_path)
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 2
    run = ckpt.parent.parent
    assert [json.loads(line)["step"] for line in (run / "eval.jsonl").read_text().splitlines()] == [0]


def test_a_sigterm_before_esrl_takes_the_signals_stops_at_a_step_boundary(tiny_model, tmp_path, monkeypatch):
    """Lightning's handler, in place from its data setup to the module's Interruption.on_train_start, took a SIGTERM
    there and stopped after the first batch: with GRPO's accumulation, inside a window, in a checkpoint whose resume
    crashed. Now the stop comes before the first step, in a checkpoint the resume continues from."""
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    config = write_tiny_config(tmp_path / "grpo.yaml", tiny_model, max_steps=1, grpo={"num_generations": 4},
                               rollout={"temperature": 1.0}, trainer={"accumulate_grad_batches": 2})
    out = run_esrl("fit", "--config", config, "--algo", "grpo", "--trainer.default_root_dir", tmp_path,
                   "--trainer.callbacks+=signal_at_step.SignalAtStart")
    assert out.returncode == 143, out.stderr[-3000:]
    ckpt = _ckpt(tmp_path)
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 0
    resumed = run_esrl("fit", "--config", config, "--algo", "grpo", "--trainer.default_root_dir", tmp_path,
                       "--ckpt_path", ckpt)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (ckpt.parent.parent / "final" / "model.safetensors").is_file()


def test_a_second_ctrl_c_mid_step_is_esrls_line_and_exit_130(tiny_model, tmp_path):
    """The first Ctrl+C asks for a stop after the step; the second stops at once. It went to Python's own handler,
    so Lightning's exit 1 reached the shell with no line (entry.py promises one line and 130 for any Ctrl+C)."""
    config = write_tiny_config(tmp_path / "es.yaml", tiny_model, max_steps=3, es={"population_size": 4})
    out = subprocess.run([*ESRL, "fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path),
                          "--trainer.callbacks+=signal_at_step.SignalAtStep", "--trainer.callbacks.at=1",
                          "--trainer.callbacks.name=SIGINT", "--trainer.callbacks.times=2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(FIXTURES)})  # esrl's entry, not the forked CLI
    assert out.returncode == 130, out.stderr[-3000:]
    assert out.stderr.rstrip().splitlines()[-1] == "esrl: interrupted (Ctrl+C)" and "Traceback" not in out.stderr
