"""PromptDataModule: the one data module both algorithms train and evaluate on."""

from __future__ import annotations

import functools
from typing import Any, Iterator

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

from esrl.errors import ConfigError, require
from esrl.tasks import Task, build_task


class PromptSampler(DistributedSampler):
    """Seeded per-epoch permutation that can resume mid-epoch, served in accumulation windows.

    It subclasses DistributedSampler so Lightning does not replace it; the strategy decides the sharding
    (ES: every rank sees every prompt, since all members are scored on the same prompts). Sharded over processes
    (GRPO), an epoch's tail that does not fill every process is padded with its first prompts, as
    DistributedSampler pads: some prompts train twice that epoch (TRL drops an incomplete global batch instead), and
    a set smaller than the processes still trains (the paper's conciseness baseline: 2 prompts on 8 GPUs).

    With `window_repeats` A > 1 (trainer.accumulate_grad_batches), the permutation is cut into windows of
    `window_size` indices (an optimizer step's prompts) and each window is served A times, once per micro-batch,
    as TRL's RepeatSampler does: so an algorithm can roll out a whole optimizer step at its first micro-batch and
    normalize by the step's token count before the first backward. A last window that is not full is skipped that
    epoch (the next epoch reshuffles), as TRL's RepeatSampler skips it, with or without accumulation: every step
    has its prompts_per_step prompts (an ES iteration of fewer prompts scored its members on a smaller sample).
    """

    def __init__(self, n: int, shuffle: bool, seed: int, num_replicas: int = 1, rank: int = 0,
                 window_size: int = 1, window_repeats: int = 1):
        super().__init__(range(n), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        self.window_size = window_size
        self.window_repeats = window_repeats
        self.resume_at: tuple[int, int] | None = None  # (epoch, indices of it consumed before a resume)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        size = self.window_size
        indices = [i for start in range(0, len(indices) - size + 1, size)
                   for _ in range(self.window_repeats) for i in indices[start:start + size]]
        if self.resume_at is not None and self.resume_at[0] == self.epoch:
            indices = indices[self.resume_at[1]:]
            self.resume_at = None
        return iter(indices)

    def __len__(self) -> int:
        return self.num_samples // self.window_size * self.window_size * self.window_repeats


def _collate(rows: list[dict[str, Any]], micro_batches: int = 1) -> dict[str, Any]:
    """rows: the batch's prompts; with micro_batches > 1 the whole accumulation window's, in micro-batch order."""
    return {"rows": rows, "micro_batches": micro_batches}


class PromptDataModule(L.LightningDataModule):
    """Serves a task's rows; prompts are formatted by the task, rewards computed by the task."""

    def __init__(self, task: str = "conciseness", task_args: dict[str, Any] | None = None,
                 prompts_per_step: int = 2, eval_batch_size: int = 16, shuffle: bool = True, seed: int = 0):
        """
        Args:
            task: task name (conciseness, countdown, jsonl, math, pku_saferlhf) or a 'module:function' returning a
                Task.
            task_args: the task builder's options (data paths, sizes, reward functions), each with its default in
                the docstring of the task's build function: `python -m pydoc esrl.tasks.math.build` (conciseness,
                countdown, jsonl, math, pku_saferlhf); an unknown option is refused in one line.
            prompts_per_step: prompts per ES iteration / GRPO micro-batch (per process under GRPO data
                parallelism; a GRPO optimizer step takes trainer.accumulate_grad_batches of them). At most the
                number of training prompts (under GRPO, each process's share; with accumulation, the window's):
                a larger batch is refused, never silently shrunk. With accumulate_grad_batches > 1 each
                training batch carries its whole window's prompts (see PromptSampler).
            eval_batch_size: prompts per evaluation batch.
            shuffle: shuffle training prompts each epoch (seeded, so runs repeat).
            seed: seed of the shuffling.
        """
        super().__init__()
        require(prompts_per_step >= 1, "data.prompts_per_step", f"must be >= 1, got {prompts_per_step}")
        require(eval_batch_size >= 1, "data.eval_batch_size", f"must be >= 1, got {eval_batch_size}")
        self.save_hyperparameters()
        self.task: Task = build_task(task, **(task_args or {}))
        n = len(self.task.train_rows)
        require(n > 0, "data.task", f"task {task!r} has no training rows")
        if not self.task.eval_rows:  # said once, at the start: an evaluation's numbers are then training numbers
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(f"data.task {task!r} has no evaluation rows (with these task_args): evaluations score "
                           "the training prompts")
        # A larger batch would silently shrink to the data set: say so before any model loads.
        require(prompts_per_step <= n, "data.prompts_per_step",
                f"{prompts_per_step} prompts per step, but task {task!r} has only {n} training prompts")
        self.prompts_per_step = prompts_per_step
        self.eval_batch_size = eval_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self._sampler: PromptSampler | None = None
        self._consumed = (0, 0)  # (epoch, batches of that epoch handed to a training step)
        self._committed = (0, 0)  # the same, up to the last batch whose optimizer step completed
        self._handed_at: int | None = None  # trainer.global_step when the last batch was handed over
        self._resume: tuple[int, int] | None = None
        self._layout: tuple[int, int] = (1, 1)  # (processes sharing the prompts, micro-batches a step) of this run
        self._resumed_layout: tuple[int | None, int | None] = (None, None)  # the checkpoint's (older ones: None)

    def train_dataloader(self) -> DataLoader:
        kwargs = {"num_replicas": 1, "rank": 0}
        if self.trainer is not None and self.trainer.distributed_sampler_kwargs:
            kwargs = {k: self.trainer.distributed_sampler_kwargs[k] for k in ("num_replicas", "rank")}
        n, replicas = len(self.task.train_rows), kwargs["num_replicas"]
        micro_batches = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        batch_size = self.prompts_per_step * micro_batches  # an optimizer step's prompts on this process
        accumulated = f" x trainer.accumulate_grad_batches {micro_batches}" if micro_batches > 1 else ""
        require(batch_size <= -(-n // replicas), "data.prompts_per_step",
                f"{self.prompts_per_step} prompts per step{accumulated} and process, but {n} training prompts "
                f"over {replicas} processes give each only {-(-n // replicas)}")
        self._sampler = PromptSampler(n, self.shuffle, self.seed, **kwargs, window_size=batch_size,
                                      window_repeats=micro_batches)
        self._layout = (replicas, micro_batches)
        if self._resume is not None:
            epoch, batches = self._resume
            self._check_layout(batches)
            self._sampler.resume_at = (epoch, batches * batch_size)
            self._resume = None
        return DataLoader(_Rows(self.task.train_rows), batch_size=batch_size, sampler=self._sampler,
                          collate_fn=functools.partial(_collate, micro_batches=micro_batches))

    def eval_dataloader(self) -> DataLoader:
        """Every row on every process, in order (a sampler of one replica, which Lightning keeps): its
        DistributedSampler padded a sharded evaluation (esrl validate / test under GRPO's DDP) with repeated rows,
        counted in its means."""
        rows = self.task.eval_rows or self.task.train_rows
        return DataLoader(_Rows(rows), batch_size=self.eval_batch_size, sampler=PromptSampler(len(rows), False, 0),
                          collate_fn=_collate)

    val_dataloader = eval_dataloader
    test_dataloader = eval_dataloader

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Runs when a batch reaches the training step (not when the loader prefetches it), so the count
        # below is exactly what training consumed: the position a resume starts from.
        if self.trainer is not None and self.trainer.training and self._sampler is not None:
            step = self.trainer.global_step
            if self._handed_at is None or step > self._handed_at:  # the batches handed so far took their step
                self._committed = self._consumed
            epoch = self._sampler.epoch
            done = self._consumed[1] + 1 if self._consumed[0] == epoch else 1
            self._consumed, self._handed_at = (epoch, done), step
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch whose optimizer step completed: a checkpoint saved while a step failed
        (Lightning's save_on_exception) or inside an accumulation window resumes with that step's batches again,
        not past them."""
        stepped = self._handed_at is None or self.trainer is None or self.trainer.global_step > self._handed_at
        epoch, batches = self._consumed if stepped else self._committed
        return {"epoch": epoch, "batches": batches, "replicas": self._layout[0], "micro_batches": self._layout[1]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._consumed = self._committed = (state["epoch"], state["batches"])
        self._handed_at = None
        self._resume = self._consumed
        self._resumed_layout = (state.get("replicas"), state.get("micro_batches"))

    def _check_layout(self, batches: int) -> None:
        """The position counts this process's batches of its shard: read with another number of processes or
        micro-batches it would skip or repeat prompts of the epoch (GRPO; ES shares its prompts, one replica)."""
        (replicas, micro), (old_replicas, old_micro) = self._layout, self._resumed_layout
        if not batches or old_replicas is None or (old_replicas, old_micro) == (replicas, micro):
            return
        raise ConfigError(f"--ckpt_path: saved {batches} batches into its epoch with the prompts over {old_replicas} "
                          f"processes and trainer.accumulate_grad_batches {old_micro}; resumed with {replicas} and "
                          f"{micro}, it would skip or repeat prompts: resume with {old_replicas} processes "
                          f"(trainer.devices x num_nodes) and accumulate_grad_batches {old_micro}")


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict[str, Any]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]
