"""What the resume tests (test_resume.py: signals; test_resume_slurm.py: SLURM's requeue and what the user gave
against the checkpoint) share: the checkpointing trainer section, the run's length, and waiting on a run."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import write_tiny_config

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


def es_config(tiny_model: Path, folder: Path) -> Path:
    """The tiny ES config both files resume: 40 steps (a run is stopped before its end), a checkpoint every step."""
    return write_tiny_config(folder / "es.yaml", tiny_model, max_steps=40,
                             es={"population_size": 4, "sigma": 0.05, "alpha": 0.02}, trainer=CHECKPOINTS)
