"""PolicyModule: what ES and GRPO share in Lightning (model, rollouts, evaluation, final save)."""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import fmean
from types import SimpleNamespace
from typing import Any, Iterable, Iterator, Sequence

import lightning as L
import torch

from esrl.errors import EsrlError, require
from esrl.atomic_files import write_final
from esrl.models.loading import DTYPES, load_causal_lm, load_tokenizer, resolve_model_path
from esrl.models.lora import save_final
from esrl.rollout import AdapterSpec, RolloutConfig, build_engine
from esrl.scoring.lagrangian import find_constrained_reward
from esrl.tasks import Task
from esrl.tasks.reward_logs import RewardLogs


@dataclass
class PolicyConfig:
    """The model being trained."""

    name_or_path: str = "smollm2-135m-instruct"
    """Hub id, local folder, or `smollm2-135m-instruct` (embedded, no network needed)."""
    dtype: str = "float32"
    """Weights dtype: float32, bfloat16 or float16 (the paper used bfloat16 on GPUs). float32 by default because
    the default machine is a CPU and a Trainer's default precision is 32-true; TRL's GRPOConfig turns bf16 autocast
    on by default, as `trainer.precision: bf16-mixed` does here (configs/grpo_*.yaml set it)."""


class PolicyModule(L.LightningModule):
    """Base of ESModule and GRPOModule: neither knows which task it trains on."""

    def __init__(self, policy: PolicyConfig | None = None, rollout: RolloutConfig | None = None):
        super().__init__()
        self.update_in_flight = False  # an update begun but not yet counted (optimizer_step): no failure checkpoint
        self.policy_config = policy or PolicyConfig()
        self.rollout_config = rollout or RolloutConfig()
        require(self.policy_config.dtype in DTYPES, "model.policy.dtype",
                f"unknown dtype {self.policy_config.dtype!r}; choose one of {', '.join(DTYPES)}")
        require(self.rollout_config.max_new_tokens >= 1, "model.rollout.max_new_tokens", "must be >= 1")
        require(self.rollout_config.max_batch_size >= 1, "model.rollout.max_batch_size", "must be >= 1")
        require(self.rollout_config.temperature > 0, "model.rollout.temperature", "must be > 0")
        require(self.rollout_config.compile in ("auto", "on", "fused", "off"), "model.rollout.compile",
                f"choose auto, on, fused or off, got {self.rollout_config.compile!r}")
        require(self.rollout_config.prompt_bucket >= 1, "model.rollout.prompt_bucket", "must be >= 1")
        require(0 < self.rollout_config.top_p <= 1, "model.rollout.top_p", "must be in (0, 1]")
        require(self.rollout_config.vllm_max_loras is None or self.rollout_config.vllm_max_loras >= 1,
                "model.rollout.vllm_max_loras", f"must be >= 1 (or null: the engine's choice), got "
                f"{self.rollout_config.vllm_max_loras}")
        require(all(isinstance(t, str) and t for t in self.rollout_config.stop), "model.rollout.stop",
                f"stop strings must be non-empty (an empty one ends every completion at once), got "
                f"{self.rollout_config.stop!r}")
        # Fail before any training starts, with the places esrl looked, if the model cannot be found.
        self.model_path = resolve_model_path(self.policy_config.name_or_path)
        self.policy: torch.nn.Module | None = None
        self.tokenizer = None
        self.engine = None
        self._timings: dict[str, float] = {}  # this step's time split, logged as time/<key>
        self._lagrangian_state: dict[str, Any] | None = None  # restored from a checkpoint, applied at train start
        self._compiles_reported = 0
        self.reward_logs = RewardLogs()  # what reward functions log in training (log_metric), until logged

    def seed_or_global(self, seed: int | None) -> int:
        """A configured seed, else the run's seed_everything value (Lightning exports it as PL_GLOBAL_SEED)."""
        return seed if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        """Adds the block's wall time to this step's time split."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._timings[key] = self._timings.get(key, 0.0) + time.perf_counter() - start

    # -- model ---------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        self.tokenizer = load_tokenizer(self.model_path)
        self.policy = load_causal_lm(self.model_path, self.policy_config.dtype)
        self.engine = build_engine(self.rollout_config, self.policy, self.tokenizer, adapters=self.engine_adapters(),
                                   compute_dtype=precision_dtype(self._trainer))

    def report_compiles(self) -> float:
        """Print each newly compiled decode shape once, with its first call's time; the seconds added since the
        last report (logged as time/compile)."""
        times = self.engine.compile_times() if self.engine is not None else []
        new = times[self._compiles_reported:]
        self._compiles_reported = len(times)
        for (rows, prompt, tokens), seconds in new:
            self.print(f"[compile] decode for {rows} rows x {prompt} prompt + {tokens} new tokens: first call "
                       f"{seconds:.1f} s (compile included; later calls of this shape reuse it)")
        return sum(seconds for _, seconds in new)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        seconds = self.report_compiles()
        if seconds:
            self.log("time/compile", seconds, on_step=True, on_epoch=False, rank_zero_only=True)

    def frozen_base(self) -> torch.nn.Module | None:
        """The base weights, frozen on this module's device, when the algorithm already holds them (GRPO's KL
        reference): the evaluation's KL reads them rather than loading a second copy of the model."""
        return None

    def engine_adapters(self) -> AdapterSpec | None:
        """Row adapters the algorithm will run on an engine with its own weights (ES lowrank / lora); none here."""
        return None

    @property
    def task(self) -> Task:
        return self.trainer.datamodule.task

    def stop_strings(self) -> list[str]:
        return list(dict.fromkeys([*self.task.stop, *self.rollout_config.stop]))

    # -- evaluation, shared by both algorithms ---------------------------------------------------------
    @torch.no_grad()
    def rollout_eval(self, rows: Sequence[dict[str, Any]], greedy: bool = True, n: int = 1,
                     temperature: float | None = None, seed: int | None = None, top_p: float | None = None):
        """Completions of the current weights for evaluation (rows repeated n times, row-major); sampled ones with
        the given temperature and top_p, else the rollout's."""
        return self.engine.generate(self.task.prompts(rows), max_new_tokens=self.rollout_config.max_new_tokens,
                                    greedy=greedy, temperature=temperature or self.rollout_config.temperature,
                                    top_p=top_p if top_p is not None else self.rollout_config.top_p,
                                    stop=self.stop_strings(),
                                    num_return_sequences=n, seed=seed)

    def reward_context(self, logs: RewardLogs | None = None) -> dict[str, Any]:
        """What TRL hands its reward functions besides the data: trainer_state (global_step, max_steps, epoch, the
        fields of transformers' TrainerState a reward schedule reads), log_metric and log_extra (into `logs`, by
        default the training step's)."""
        state = SimpleNamespace(global_step=self.global_step, epoch=self.current_epoch,  # 0 without a Trainer
                                max_steps=self._trainer.max_steps if self._trainer is not None else None)
        return {"trainer_state": state, **(logs or self.reward_logs).context()}

    def reward_metrics(self, logged: Iterable[str]) -> dict[str, float]:
        """train/<name> for what reward functions logged since the last call, pooled over processes (a collective:
        the training step's logging calls it on every process); a name esrl logs itself (`logged`) is refused."""
        own = [k.removeprefix("train/") for k in logged]
        return {f"train/{k}": v for k, v in self.reward_logs.take(reserved=own).items()}

    def log_once(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Metrics of one step's own rollouts (the same on every process), straight to the loggers at `step`
        (default: this one) on global rank 0, as the evaluation callback logs: given to self.log's loggers, a value
        is logged again at every later step of its epoch (Lightning keeps it until the epoch ends), so GRPO's window
        reused for num_iterations steps would count its rollouts that many times. self.log still gets them, for
        callbacks (a checkpoint's monitor) and the progress bar, with logger=False."""
        if not metrics:
            return
        self.log_dict(metrics, on_step=True, on_epoch=False, logger=False)
        if self.trainer.is_global_zero:
            for logger in self.trainer.loggers:
                logger.log_metrics(metrics, step=self.global_step if step is None else step)

    def score_rows(self, rows: Sequence[dict[str, Any]], completions, pool: bool = False) -> dict[str, list[float]]:
        """Per-sample task reward and metrics of completions (one per row); a metric a reward function logged
        (log_metric) counts its calls' mean for every sample (`pool`: every process's calls, a collective)."""
        texts, ids = [c.text for c in completions], [c.token_ids for c in completions]
        logs = RewardLogs()
        context = self.reward_context(logs)
        values = {"reward": self.task.rewards(rows, texts, ids, **context)}
        values.update(self.task.metrics(rows, texts, ids, **context))
        values["completion_tokens"] = [float(len(c.token_ids)) for c in completions]
        values["truncated"] = [float(c.truncated) for c in completions]
        logs.add_to(values, pool)
        return values

    def evaluate_rows(self, rows: Sequence[dict[str, Any]], pool: bool = False) -> dict[str, list[float]]:
        """Greedy completions of the current weights, scored by the task: per-sample values."""
        return self.score_rows(rows, self.rollout_eval(rows), pool)

    def _eval_step(self, batch: dict[str, Any], prefix: str) -> None:
        # pooled: every process then logs the same names (reward functions may log some on some ranks only), as
        # sync_dist's collectives need
        values = self.evaluate_rows(batch["rows"], pool=self.trainer.world_size > 1)
        n = len(batch["rows"])
        for k, v in values.items():
            self.log(f"{prefix}/{k}", fmean(v), batch_size=n, sync_dist=True)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._eval_step(batch, "eval")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def configure_callbacks(self):
        """A step progress bar and the shared evaluation, unless the config brings its own."""
        from esrl.callbacks import Evaluation, FailureCheckpoint, Interruption, StepProgressBar

        callbacks = [Interruption(), FailureCheckpoint()]  # a signal, a failed step: a resumable checkpoint
        if self.trainer.progress_bar_callback is not None:
            callbacks.append(StepProgressBar())
        if not any(isinstance(c, Evaluation) for c in self.trainer.callbacks):
            callbacks.append(Evaluation())
        return callbacks

    # -- cost constraint: tasks scored reward - lambda * cost (pku_saferlhf) ---------------------------------
    @property
    def constraint(self):
        """The task's reward with a cost (its last raw rewards and costs, its Lagrangian); None without a cost."""
        return find_constrained_reward(self.task)

    def adapt_lambda(self, cost_sum: float, raw_reward_sum: float, safe_sum: float, count: int) -> dict[str, float]:
        """After a step's update: lambda adapts to the step's mean cost over all ranks (the caller sums them, over
        ES's members, each its rows' means, or GRPO's samples; safe_sum sums cost <= 0 as 1 or 0, or ES's members'
        safe fractions).

        Returns the step's constraint metrics, the same for both algorithms, lambda being the value the step trained
        with."""
        lagrangian = self.constraint.lagrangian
        used = lagrangian.lam
        count = max(1, count)
        lagrangian.update(cost_sum / count)
        return {"train/lambda": used, "train/cost_mean": cost_sum / count,
                "train/raw_reward_mean": raw_reward_sum / count, "train/safe_frac": safe_sum / count}

    def mid_step(self) -> str | None:
        """What makes the weights no step's own right now (None: they are a step's): a checkpoint refuses them."""
        return "an optimizer step is updating them" if self.update_in_flight else None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if (why := self.mid_step()) is not None:  # a save from a signal handler, e.g. Lightning's SLURM auto-requeue
            failed = sys.exc_info()[1]  # ModelCheckpoint(save_on_exception=True) saving after a failure: name it
            raise EsrlError((f"{type(failed).__name__}: {failed} (the checkpoint saved on it was refused: {why})"
                             if failed is not None else
                             f"a checkpoint was requested at step {self.global_step} while {why}; nothing was saved "
                             "(SLURM: --trainer.plugins.auto_requeue false, or slurm/fit.sbatch, which saves at a "
                             "step's end)"))
        if self._trainer is not None:  # a resumed run continues this folder (esrl.cli)
            checkpoint["esrl_run_dir"] = str(self.run_dir())
        if self._trainer is not None and self.constraint is not None:
            checkpoint["esrl_lagrangian"] = self.constraint.lagrangian.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._lagrangian_state = checkpoint.get("esrl_lagrangian")

    def on_train_start(self) -> None:
        self.update_in_flight = False  # a fit before this one may have failed inside its step
        self.prepare_rollouts()

    def prepare_rollouts(self) -> None:
        """What the first rollout after a restore needs (lambda from the checkpoint; in ES and GRPO, an engine with its
        own weights gets the policy's). At train start; a run resumed at its last step trains nothing and Lightning
        skips the train hooks, so its final evaluation calls this first (esrl.callbacks.evaluation)."""
        if self._lagrangian_state is not None and self.constraint is not None:
            self.constraint.lagrangian.load_state_dict(self._lagrangian_state)

    # -- outputs -----------------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        # trainer.log_dir is a collective (broadcast) call: resolve it once here, on every rank.
        self._run_dir = Path(self.trainer.log_dir or self.trainer.default_root_dir)

    def run_dir(self) -> Path:
        return self._run_dir

    def write_model(self, out: Path) -> None:
        """The trained model in HF format into the fresh folder `out`, loadable by from_pretrained (a LoRA policy:
        the merged model there, its adapter in PEFT format under out/adapter/)."""
        save_final(self.policy, self.tokenizer, out)

    def on_fit_end(self) -> None:
        """The trained model under <log dir>/final/ (write_model), written by rank 0. The ranks then agree on
        whether it was written, a collective rather than a barrier, so that a save that raised on rank 0 (a full
        disk) ends every rank with it instead of leaving the others waiting for a rank that is gone."""
        failed = None
        if self.trainer.is_global_zero:
            try:
                write_final(self.write_model, self.run_dir() / "final")
            except Exception as e:
                failed = e
        if not self.trainer.strategy.reduce_boolean_decision(failed is None, all=True):
            raise failed or EsrlError(f"rank 0 could not write {self.run_dir() / 'final'} (its error is above)")

    def save_configs(self, **configs: Any) -> None:
        """Hyperparameters as plain dicts, so checkpoints load with torch.load(weights_only=True)."""
        configs = {"policy": self.policy_config, "rollout": self.rollout_config, **configs}
        self.save_hyperparameters({name: asdict(c) for name, c in configs.items()})


def world_info(module: L.LightningModule) -> tuple[int, int]:
    """(rank, world size) of the running trainer; (0, 1) outside one."""
    try:
        trainer = module.trainer
    except RuntimeError:  # Lightning: "is not attached to a `Trainer`"
        return 0, 1
    return trainer.global_rank, trainer.world_size


def precision_dtype(trainer: L.Trainer | None) -> torch.dtype | None:
    """The dtype the policy's forward runs in under Lightning's precision where the loaded weights do not say it:
    a mixed precision's autocast ('bf16-mixed', '16-mixed'), or a true half precision's conversion ('bf16-true',
    '16-true'), which Lightning applies after configure_model; else None (the weights' dtype)."""
    precision = str(trainer.precision) if trainer is not None else ""
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": torch.bfloat16,
            "16-true": torch.float16}.get(precision)
