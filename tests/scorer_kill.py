"""Test-only Lightning callback: kills the scorer service as an ES iteration starts (imported by `esrl fit`
through PYTHONPATH=tests), and records what the run looked like when the resulting error reached Lightning."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback


class KillScorerAt(Callback):
    """At the start of iteration `step`: SIGKILL the process `pid` and wait until `port` refuses connections.

    On the exception that follows, writes `report` (JSON): the exception's class and whether the policy's weights
    equal those at the start of the failed iteration (the ES iteration must restore its perturbation).
    """

    def __init__(self, step: int, pid: int, port: int, report: str):
        self.step, self.pid, self.port, self.report = step, pid, port, Path(report)
        self.before: dict[str, torch.Tensor] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step or self.before is not None:
            return
        self.before = {k: v.detach().clone() for k, v in pl_module.policy.state_dict().items()}
        os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
            except OSError:
                return
            time.sleep(0.05)
        raise RuntimeError(f"scorer on port {self.port} still answers after SIGKILL")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        after = pl_module.policy.state_dict()
        restored = self.before is not None and all(torch.equal(after[k], v) for k, v in self.before.items())
        self.report.write_text(json.dumps({"exception": type(exception).__name__, "step": trainer.global_step,
                                           "restored": restored}))
