"""A fit that fails keeps the steps it finished: interrupted.ckpt, saved when a step fails, resumes into the run
that never failed.

A scorer down after its retries, a reward function's bug or a full disk at final/ stopped a run with nothing saved
since its last periodic checkpoint (es_pku.yaml: every 10 steps; the demos: none). Lightning's
`ModelCheckpoint(save_on_exception=True)` saves there, but its checkpoint of a step that failed before its update
resumed with every later metrics.csv row one step late (Lightning counts such a batch as logged on restart), and one
that failed in an evaluation resumed without that evaluation. Here:

- A failure before the step's update counted (its rollouts, rewards, backward): the checkpoint is the previous step's
  end, the one a ModelCheckpoint would have saved there: the failed batch is marked as never started (its loop
  counters, in `on_save_checkpoint`), so Lightning restarts at it without counting it as logged.
- A failure after the update counted (ES's engine sync after its update; an evaluation at the step's end): the step is
  done and the checkpoint holds it; an evaluation it did not finish runs on resume (esrl.callbacks.evaluation).
- Not saved: a second Ctrl+C (KeyboardInterrupt: stop at once), a non-finite update (its weights are the failure),
  an update applied or begun but not yet counted (`update_in_flight`: GRPO's engine sync after its step; an optimizer
  step of either that failed part way, its weights neither step's: a resume would apply it twice), a failure inside an
  accumulation window after its first micro-batch (the window's rollouts and gradients are in no checkpoint), one in
  an epoch's end hooks (its loop counters resume one batch off), a fit that finished no step since it started, and
  several processes: the save is a collective that ranks which did not fail would not join, so their periodic
  checkpoints stay the way to resume. Nor where a ModelCheckpoint saved the same state (the step before's end, at
  this step): a 7B model's second copy, for nothing.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from esrl.callbacks.interruption import CHECKPOINT
from esrl.errors import NonFiniteUpdateError


class FailureCheckpoint(L.Callback):
    """interrupted.ckpt when a step fails (one process)."""

    def __init__(self) -> None:
        self._started_at: int | None = None
        self._step_done = -1  # the step count at the last batch's end (not its start: callbacks listed before this
        #                       one run their on_train_batch_start first, and may fail there)
        self._window_open = False  # the last batch ended without an optimizer step (mid accumulation window)
        self._before_update = False  # the save in progress is of a batch that counted no update

    def on_train_start(self, trainer, pl_module) -> None:
        self._started_at = self._step_done = trainer.global_step
        self._window_open = False

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self._window_open = trainer.global_step == self._step_done
        self._step_done = trainer.global_step

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        counted = trainer.global_step != self._step_done  # the failed batch's update was counted
        if (not isinstance(exception, Exception) or isinstance(exception, NonFiniteUpdateError)
                or getattr(pl_module, "update_in_flight", False) or (self._window_open and not counted)
                or trainer.world_size > 1 or self._started_at is None or trainer.global_step <= self._started_at
                or _epoch_body_done(trainer)):
            return
        if not counted and any(getattr(c, "_last_global_step_saved", None) == trainer.global_step
                               for c in trainer.checkpoint_callbacks):  # a ModelCheckpoint saved this very state
            rank_zero_info(f"esrl: the fit failed at step {trainer.global_step}, where its ModelCheckpoint saved; "
                           "once the cause is fixed, resume with --ckpt_path last")
            return
        path = pl_module.run_dir() / "checkpoints" / CHECKPOINT
        self._before_update = not counted
        try:
            trainer.save_checkpoint(path, weights_only=False)
        except Exception as e:  # noqa: BLE001 - the fit's own error is the one to raise
            rank_zero_warn(f"esrl: the fit failed at step {trainer.global_step} and its checkpoint could not be saved "
                           f"({type(e).__name__}: {e})")
            return
        finally:
            self._before_update = False
        rank_zero_info(f"esrl: the fit failed at step {trainer.global_step}: saved {path}; once the cause is fixed, "
                       f"resume with --ckpt_path {path}")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """The failed batch as never started: ready and started back to the batches processed, as in a checkpoint
        saved at the previous batch's end after it completed (Lightning then resumes at the failed batch and counts
        nothing more as logged; tests/test_failure_checkpoint.py compares metrics.csv with a run never stopped)."""
        if not self._before_update:
            return
        progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
        for counts in (progress["total"], progress["current"]):
            counts["ready"] = counts["started"] = counts["processed"]


def _epoch_body_done(trainer) -> bool:
    """A failure after the epoch's batches, in its end hooks (on_train_epoch_end: a ModelCheckpoint saving there onto
    a full disk): Lightning's counters there resume with one batch too many in that epoch, so nothing is saved."""
    epoch = trainer.fit_loop.epoch_progress.current
    return epoch.processed != epoch.completed

