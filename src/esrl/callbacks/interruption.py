"""Interrupted runs: SIGTERM and SIGINT stop at the end of the current step with a resumable checkpoint and a
non-zero exit, and a resumed run keeps writing its run folder's metrics.csv as one history.

Lightning's own SIGTERM handling (its signal connector) stops the fit loop at the next step boundary by raising
SIGTERMException, a SystemExit with code 0: a scheduler would read an interrupted run as a success. Here:

- SIGINT (Ctrl+C) is turned into that same graceful stop (the SIGTERM Lightning handles); a second Ctrl+C
  raises KeyboardInterrupt at once through esrl.entry's handler (its one line and exit 130; the per-step
  checkpoints, if any, stay the way to resume).
- Both are only noted when they arrive, and handed to Lightning's SIGTERM handler at the end of a step (an
  optimizer step: GRPO's micro-batches of one accumulation window run on, as a checkpoint inside the window,
  without the window's rollouts, could not resume, tests/test_resume.py -k window), on every rank at once: the
  ranks first agree (a max over ranks) on whether any of them got one. Lightning's handler broadcasts inside the
  signal handler, wherever each rank happens to be, and a terminal's Ctrl+C or SLURM's
  SIGTERM reaches every rank while rank 0 also forwards it to the others: two processes hung there with their
  collectives out of step (tests/test_resume.py -k ranks). A signal to rank 0 alone stops every rank too.
- After training's last step, in the final evaluation (final_phase), one process stops at once and several right
  after it, before final/, with interrupted.ckpt at the last step (the resume runs the evaluation again). A
  SIGTERM that Lightning's own handler took before esrl's was installed (data setup, earlier callbacks'
  on_train_start) stops the run before its first step, not inside GRPO's first accumulation window.
- At that step's end `<run dir>/checkpoints/interrupted.ckpt` is saved through `trainer.save_checkpoint`, where
  ModelCheckpoint saves, then Lightning raises SIGTERMException; `esrl fit` exits 143 (SIGTERM) or 130 (SIGINT).
- SLURM (slurm/fit.sbatch): the batch shell traps the time limit's warning (SIGUSR1), sends SIGTERM to the
  tasks (so this checkpoint is saved at a step boundary) and requeues the job, which resumes from the newest
  checkpoint. Lightning's own auto_requeue is off there: it saves inside its signal handler, mid-step.
- Resuming: the CLI puts the resumed run in the checkpoint's own version folder (esrl.cli) and moves its
  metrics.csv to `metrics.csv.before-resume` before Lightning's CSVLogger (which deletes an existing file) starts;
  on_load_checkpoint here logs back the rows of the steps the checkpoint holds, so the file stays one history.
"""

from __future__ import annotations

import csv
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

EXIT_CODES = {"SIGTERM": 143, "SIGINT": 130}
SIGNALS = (None, "SIGTERM", "SIGINT")  # by strength: a Ctrl+C on any rank names the stop SIGINT on all
BEFORE_RESUME = "metrics.csv.before-resume"
CHECKPOINT = "interrupted.ckpt"
interrupted_by: str | None = None  # the signal that stopped the last fit in this process (read by esrl.cli)
_final_phase = False  # while the final evaluation runs (final_phase)
_active: Interruption | None = None  # the fit's Interruption, from its train start


@contextmanager
def final_phase():
    """The evaluation after training's last step: a signal there stops it at once on one process (a scheduler's
    SIGTERM leaves minutes, a large model's evaluation may take longer) with interrupted.ckpt at the last step, whose
    resume runs the evaluation again; on several processes, whose collectives a stop inside a signal handler would
    leave out of step, it is taken right after the evaluation (Interruption.on_fit_end). One noted before it began
    (after the last step's check: during its ModelCheckpoint save) stops it before it starts, on one process."""
    global _final_phase, interrupted_by
    if _active is not None and _active._pending and _active._world_size == 1:
        interrupted_by = SIGNALS[_active._pending]
        raise SIGTERMException()  # Interruption.on_exception saves interrupted.ckpt
    _final_phase = True
    try:
        yield
    finally:
        _final_phase = False


def kept_rows(path: Path, resumed_step: int) -> list[dict[str, Any]]:
    """The rows of metrics.csv that the checkpoint at `resumed_step` holds: training rows of the steps before
    it (Lightning logs step k's training row at k - 1) and evaluations up to it."""
    rows = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            values = {k: v for k, v in row.items() if k and v not in ("", None)}  # written back as read
            if "step" not in values:
                continue
            step = int(values.pop("step"))
            evaluation = any(k.startswith("eval/") for k in values)
            if step < resumed_step or (evaluation and step <= resumed_step):
                rows.append({"step": step, **values})
    return rows


class Interruption(L.Callback):
    """Signals end a fit in a resumable state; a resumed run continues the run folder's metrics.csv."""

    def __init__(self) -> None:
        self._lightning_sigterm: Any = None
        self._announce = True
        self._saved_at: int | None = None
        self._step_before = -1
        self._pending = 0  # the strongest signal noted on this rank since the fit started (SIGNALS' index)
        self._world_size = 1

    def on_train_start(self, trainer, pl_module) -> None:
        global interrupted_by, _active
        interrupted_by = None
        _active = self
        self._pending = 0
        self._saved_at = None
        self._announce = trainer.is_global_zero  # one "stopping" line for a terminal's Ctrl+C to every rank
        self._world_size = trainer.world_size
        # After Lightning registered its handlers (it restores the previous ones at teardown).
        if _main_thread():
            self._lightning_sigterm = signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        from esrl import entry

        if entry.PRESSED:  # a Ctrl+C before training whose KeyboardInterrupt a finalizer swallowed: stop now
            self._on_signal(signal.SIGINT, None)
        # A SIGTERM Lightning's handler took before esrl's (data setup, the on_train_start of callbacks listed
        # earlier): Lightning would stop after the first batch, inside a GRPO accumulation window, in a checkpoint
        # that cannot resume. Stopped here instead, at a step boundary.
        early = trainer.received_sigterm
        if trainer.world_size > 1:
            flag = torch.tensor(int(early), device=trainer.strategy.root_device)
            early = bool(trainer.strategy.reduce(flag, reduce_op="max"))
        if early:
            interrupted_by = "SIGTERM"
            self._save(trainer, pl_module)
            raise SIGTERMException()

    def _on_signal(self, signum, frame) -> None:
        """Only noted here: handed to Lightning at the end of the step (on_train_batch_end), or, in the final
        evaluation on one process, at once (final_phase)."""
        global interrupted_by
        from esrl import entry

        name = signal.Signals(signum).name
        now = _final_phase and self._world_size == 1
        if name == "SIGINT":
            signal.signal(signal.SIGINT, entry.on_sigint)  # a second Ctrl+C stops at once, with esrl's line
            if self._announce:
                print(f"esrl: SIGINT: stopping {'the final evaluation now' if now else 'after this step'} with a "
                      "resumable checkpoint (Ctrl+C again to stop now)", flush=True)
        self._pending = max(self._pending, SIGNALS.index(name))
        if now:
            interrupted_by = SIGNALS[self._pending]
            raise SIGTERMException()  # on_exception saves interrupted.ckpt

    def on_train_batch_start(self, trainer, pl_module, *args) -> None:
        self._step_before = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step == self._step_before:
            return  # inside an accumulation window: its rollouts are in no checkpoint, so stop after its last batch
        self._stop_if_signalled(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        """A signal during the final evaluation on several processes (or right after it): stop before final/ (the
        fit loop is over, so Lightning's graceful stop would not come: raised here)."""
        self._stop_if_signalled(trainer, pl_module, loop_over=True)

    def _stop_if_signalled(self, trainer, pl_module, loop_over: bool = False) -> None:
        global interrupted_by
        pending = self._pending
        if trainer.world_size > 1:  # every rank stops after the same step, naming the same signal
            flag = torch.tensor(pending, device=trainer.strategy.root_device)
            pending = int(trainer.strategy.reduce(flag, reduce_op="max"))
        if not pending:
            return
        interrupted_by = SIGNALS[pending]
        self._save(trainer, pl_module)
        if callable(self._lightning_sigterm) and not loop_over:  # Lightning's graceful stop, every rank at once
            self._lightning_sigterm(signal.SIGTERM, None)
        else:
            raise SIGTERMException()

    def _save(self, trainer, pl_module) -> None:
        """interrupted.ckpt, saved where ModelCheckpoint saves (the end of a step's batch). Saved later, from
        on_exception, after Lightning has counted the batch done, a stop after an epoch's last batch resumed into
        other weights than the uninterrupted run (tests/test_resume.py -k epoch)."""
        path = pl_module.run_dir() / "checkpoints" / CHECKPOINT
        trainer.save_checkpoint(path, weights_only=False)  # resumable: optimizer, loops, callbacks
        self._saved_at = trainer.global_step
        rank_zero_info(f"esrl: {interrupted_by} at step {trainer.global_step}: saved {path}; resume with "
                       f"--ckpt_path {path}")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        global interrupted_by
        self._release()
        if not isinstance(exception, SIGTERMException):  # a failure: esrl.callbacks.failure
            return
        interrupted_by = interrupted_by or "SIGTERM"
        if self._saved_at != trainer.global_step:  # a stop that came another way than on_train_batch_end
            self._save(trainer, pl_module)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        """The run finished: its interrupted.ckpt is spent (a restarted job must not resume from it). Not at
        on_fit_end, which Lightning calls on callbacks before the module's, where final/ is written: a run whose
        final save failed keeps its checkpoint (teardown hooks run only after a fit that ended without an error)."""
        if stage == "fit" and trainer.is_global_zero:  # a file, or a folder under DeepSpeed: Lightning removes both
            trainer.strategy.checkpoint_io.remove_checkpoint(pl_module.run_dir() / "checkpoints" / CHECKPOINT)
        self._release()

    def _release(self) -> None:
        """The fit is over: a later fit in this process (resumed at its last step, so no train start) sees no
        signal of this one's."""
        global _active
        if _active is self:
            _active = None

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        old = pl_module.run_dir() / BEFORE_RESUME
        if not trainer.is_global_zero or not old.is_file():
            return
        csv_loggers = [lg for lg in trainer.loggers if isinstance(lg, CSVLogger)
                       and Path(lg.log_dir).resolve() == pl_module.run_dir().resolve()]
        for logger in csv_loggers:
            for row in kept_rows(old, int(checkpoint.get("global_step", 0))):
                step = row.pop("step")
                logger.experiment.log_metrics(row, step)
            logger.save()
        if csv_loggers:
            old.unlink()


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
