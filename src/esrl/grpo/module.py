"""GRPOModule: one training_step is one GRPO micro-batch. Thin glue over esrl.grpo's plain-torch math.

Read top to bottom, one step is:

1. rollout   G sampled completions per prompt with the shared engine, seeded by (run seed, step,
             micro-batch, rank); at a window's first micro-batch, every micro-batch of the optimizer step
             (the data module serves the window's prompts to each), as TRL generates a whole generation batch
2. reward    the task's reward functions, the same ones ES and evaluation use
3. advantage (r - group mean) / (group std + 1e-4), as TRL 1.16
4. logps     old log-probs (only when num_iterations > 1) and reference log-probs (only when beta > 0),
             without gradients
5. loss      per-token log-probs of the policy, clipped surrogate + beta * k3 KL (GRPOLoss, TRL parity)
6. update    Lightning does backward, gradient accumulation, clipping, AdamW and the LR schedule

With num_iterations = mu > 1, the rollouts of one optimizer step are kept and trained on for mu optimizer steps (and
saved in a checkpoint taken inside those mu steps, so a resumed run trains on them as the uninterrupted one does).
Rolling the whole window out before its first backward makes dapo/cispo/vespo's divisor (TRL's num_items_in_batch,
the step's loss tokens on every process) known to every micro-batch's loss, so the gradient Lightning (or
DeepSpeed) accumulates is TRL's without touching gradient buffers afterwards.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_warn

from esrl.errors import ConfigError
from esrl.finite import check_gradient, check_weights
from esrl.grpo.advantages import group_advantages, nanstd
from esrl.grpo.config import GRPOConfig
from esrl.grpo.importance import engine_correction
from esrl.grpo.loss import GLOBAL_TOKEN_LOSSES, GRPOLoss
from esrl.grpo.optim import optimizers
from esrl.grpo.reference import FrozenReference
from esrl.grpo.rollout_batch import RolloutBatch, Scores, reuse_state, reused, rollout_tensors
from esrl.grpo.step_metrics import (OTHER_HOOKS, loss_metrics, sample_metrics, window_samples,
                                     window_sampling_metrics)
from esrl.models.loading import load_causal_lm
from esrl.models.logps import per_token_logps
from esrl.models.lora import GRPO_FIELDS, is_peft, policy_adapter, wrap_lora
from esrl.policy import PolicyConfig, PolicyModule, world_info
from esrl.rollout import AdapterSpec, Completion, RolloutConfig, encode_prompts, engine_capabilities
from esrl.seeding import derive_seed
from esrl.tasks.reward_values import check_bad_rewards


def sampling_seed(run_seed: int, step: int, micro_batch: int, rank: int) -> int:
    """The seed of one micro-batch's rollouts: from (run seed, optimizer step, micro-batch, rank) alone."""
    return derive_seed("esrl-grpo", run_seed, step, micro_batch, rank)


class GRPOModule(PolicyModule):
    """Group Relative Policy Optimization on a causal LM, with the task, data and evaluation ES uses."""

    def __init__(self, policy: PolicyConfig | None = None, rollout: RolloutConfig | None = None,
                 grpo: GRPOConfig | None = None, optimizer: OptimizerCallable | None = None,
                 lr_scheduler: LRSchedulerCallable | None = None):
        super().__init__(policy, rollout)
        self.grpo = grpo or GRPOConfig()
        self.optimizer_factory = optimizer  # --optimizer: called on the trainable parameters in configure_optimizers
        self.lr_scheduler_factory = lr_scheduler  # --lr_scheduler: called on the optimizer
        self.grpo.validate()
        self.save_configs(grpo=self.grpo)
        self.loss_fn = GRPOLoss.from_config(self.grpo, max_completion_length=self.rollout_config.max_new_tokens)
        # vLLM rollouts: reweight by pi_trainer / pi_engine (refused here, before any model loads, if impossible)
        self.importance_sampling = self.grpo.importance_sampling_applies(
            engine_capabilities(self.rollout_config, self.engine_adapters()))
        self._num_items: torch.Tensor | None = None  # dapo/cispo/vespo: the optimizer step's loss tokens, all ranks
        self._step_loss = 0.0  # the optimizer step's loss as TRL logs it (its micro-batch losses summed)
        self._closes_window = True  # this micro-batch ends its accumulation window (training_step)
        for message in self.grpo.trl_warnings():
            rank_zero_warn(message)
        self.reference: FrozenReference | None = None  # beta > 0; outside the module tree, see FrozenReference
        self._rollouts: list[RolloutBatch] = []  # this optimizer step's micro-batches, reused for mu steps
        self._window_sampled = False  # whether this optimizer step rolled out its window (else reused it)
        self._step_start = 0.0
        self._step_scores: list[tuple[float, float]] = []  # (raw reward, cost) of the step's rollouts, if a cost
        self._window_log: list[tuple[RolloutBatch, dict[str, torch.Tensor]]] = []  # logged once the window closes

    # -- models ----------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        super().configure_model()
        if self.grpo.lora is not None and not is_peft(self.policy):
            # model.grpo.lora: the adapter is injected into the loaded model in place, so the HF engine generates
            # with it; base weights frozen, only the adapter's train (esrl.models.lora)
            self.policy = wrap_lora(self.policy, self.grpo.lora, self.run_seed, GRPO_FIELDS)
        if self.grpo.gradient_checkpointing and not self.policy.is_gradient_checkpointing:
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def engine_adapters(self) -> AdapterSpec | None:
        """model.grpo.lora on an engine with its own weights (vLLM): the engine keeps the base weights and runs the
        policy's adapter on every generate (set_default_adapter), one adapter at a time."""
        lora = self.grpo.lora
        if lora is None or engine_capabilities(self.rollout_config).shares_policy_weights:
            return None
        return AdapterSpec(lora.rank, tuple(m.rsplit(".", 1)[-1] for m in lora.target_modules), GRPO_FIELDS.rank,
                           max_loras=1)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        strategy = self.trainer.strategy
        if isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage_3:  # before configure_model loads
            if self.grpo.lora is not None:  # ZeRO-3 would build the adapter as partitioned parameters
                raise ConfigError("model.grpo.lora: LoRA is not supported under DeepSpeed ZeRO-3 (trainer.strategy); "
                                  "use deepspeed_stage_2, or model.grpo.lora: null for full fine-tuning")
            # Partitioned weights need gathering where esrl reads them whole: the final save (rank 0 would write
            # empty tensors), generate on several ranks (synced_gpus, or a rank that stops early hangs the others)
            # and the load inside zero.Init. None of it is built or run on GPUs yet.
            raise ConfigError("trainer.strategy: GRPO under DeepSpeed ZeRO-3 is not supported yet (its partitioned "
                              "weights are not gathered for generate and the final save); use deepspeed_stage_2, "
                              "which shards the optimizer states and gradients (tested on an H100)")
        # TRL clips gradients at 1.0 by default; the trainer's own gradient_clip_val wins when set.
        if stage == "fit" and self.trainer.gradient_clip_val is None and self.grpo.max_grad_norm is not None:
            self.trainer.gradient_clip_val = self.grpo.max_grad_norm

    def on_fit_start(self) -> None:
        # Models load in eval mode and Lightning keeps a module's mode: the loss runs in train mode, as TRL's.
        self.policy.train()
        dtype = next(self.policy.parameters()).dtype
        if self.grpo.beta > 0 and self.reference is None and self.grpo.lora is None:  # lora: the adapter disabled
            # Here, not in configure_model: that runs in the strategy's sharded-init context (ZeRO-3's zero.Init),
            # which would partition a model the strategy never wraps. Fit alone needs it.
            self.reference = FrozenReference(load_causal_lm(self.model_path, self.policy_config.dtype))
        if self.reference is not None:
            self.reference.to(self.policy, self.device)
        if dtype != torch.float32 and not isinstance(self.trainer.strategy, DeepSpeedStrategy):
            rank_zero_warn(f"GRPO: AdamW steps {dtype} weights in place, without fp32 master weights: "
                           "updates smaller than the dtype's resolution (lr 1e-6 on most weights) are "
                           "rounded away. Load model.policy.dtype float32, or use a DeepSpeed strategy "
                           "(fp32 master weights).")

    def configure_optimizers(self):
        """TRL's AdamW and LR schedule, or the command line's `--optimizer` / `--lr_scheduler` (esrl.grpo.optim)."""
        params = [(n, p) for n, p in self.policy.named_parameters() if p.requires_grad]
        return optimizers(params, self.grpo, self.optimizer_factory, self.lr_scheduler_factory,
                          self.trainer.estimated_stepping_batches)

    @property
    def run_seed(self) -> int:  # the configured seed, else the run's seed_everything value (Lightning exports it)
        return self.seed_or_global(self.grpo.seed)

    def frozen_base(self) -> torch.nn.Module | None:
        return self.reference.model if self.reference is not None else None

    def on_train_start(self) -> None:
        super().on_train_start()
        self._rollouts = [r.to(self.device) for r in self._rollouts]  # a resumed reuse window's (on_load_checkpoint)
        self._num_items = None if self._num_items is None else self._num_items.to(self.device)

    def prepare_rollouts(self) -> None:
        super().prepare_rollouts()  # here, not at fit start: after DeepSpeed's late restore
        if self.grpo.lora is not None or self.trainer.ckpt_path is not None:
            self.sync_engine()

    # -- one step --------------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        # Lightning's own test for the first micro-batch of an accumulation window (automatic optimization's
        # zero_grad): batch_idx counts this epoch's batches, and an epoch's last window may be short.
        accumulate = self.trainer.accumulate_grad_batches
        micro_batch = batch_idx % accumulate
        if micro_batch == 0:  # a new window: rolled out by this step (_window_sampled), or reused
            self._step_loss, self._window_log, self._window_sampled = 0.0, [], False
        if micro_batch == 0 or not self._step_start:  # the step's time from its first micro-batch (or a resumed one)
            self._timings, self._step_start = {"rollout": 0.0, "reward": 0.0, "logps": 0.0}, time.perf_counter()
        # DeepSpeed: Lightning calls optimizer_step and on_before_optimizer_step every micro-batch; steps on the last
        self._closes_window = micro_batch == accumulate - 1 or batch_idx + 1 == self.trainer.num_training_batches
        window_start = micro_batch == 0 and self.global_step % self.grpo.num_iterations == 0
        if window_start or micro_batch >= len(self._rollouts):  # a resumed run may start mid-window: from there on
            self.roll_out_window(batch, micro_batch)
            self._window_sampled = True
        rollout = self._rollouts[micro_batch]

        logps, entropies = per_token_logps(self.policy, rollout.input_ids, rollout.attention_mask,
                                           rollout.completion_width, self.rollout_config.temperature, True)
        loss, stats = self.loss_fn(logps, rollout.old_logps, rollout.advantages, rollout.completion_mask,
                                   ref_per_token_logps=rollout.ref_logps, num_items_in_batch=self._num_items,
                                   num_processes=world_info(self)[1], accumulate_grad_batches=accumulate,
                                   importance_sampling_ratio=rollout.is_ratio, entropies=entropies)
        self._step_loss += float(loss.detach()) / accumulate  # Lightning divides the loss by accumulate too
        self._log_step(rollout, stats)
        # DeepSpeed's engine divides by its gradient_accumulation_steps (= A) once more in backward; transformers'
        # Trainer turns that off (scale_wrt_gas=False), Lightning does not: undone here, so the update is TRL's.
        return loss * accumulate if isinstance(self.trainer.strategy, DeepSpeedStrategy) else loss

    def roll_out_window(self, batch: dict[str, Any], first: int) -> None:
        """Roll out micro-batches first..A-1 of this optimizer step now, before any of their backwards: the batch
        holds the whole window's prompts (PromptSampler serves it to each micro-batch, as TRL's RepeatSampler)."""
        accumulate = self.trainer.accumulate_grad_batches
        rows = batch["rows"]
        if batch.get("micro_batches", 1) != accumulate or len(rows) % accumulate:
            raise ConfigError(f"trainer.accumulate_grad_batches: GRPO with {accumulate} micro-batches per step needs "
                              "batches holding the whole window's prompts (esrl.data.PromptDataModule serves them); "
                              f"got a batch of {len(rows)} prompts for {batch.get('micro_batches', 1)} micro-batches")
        size = len(rows) // accumulate
        parts = {k: rows[k * size:(k + 1) * size] for k in range(first, accumulate)}
        sampled = {k: self.sample(part, k) for k, part in parts.items()}
        if self.engine.capabilities.sleeps:  # rollout.vllm_sleep: once a window; its memory goes to logps and steps
            self.engine.sleep()
        scored = dict(zip(parts, self.score(list(parts.values()), list(sampled.values()))))
        batch_std = None  # scale_rewards batch: the std of the whole window's rewards on every process, as TRL's
        if self.grpo.scale_rewards == "batch":  # generation batch (a run resumed mid-window: the rest of it)
            batch_std = nanstd(self.all_gather(torch.cat([x.rewards for x in scored.values()]).to(self.device))
                               .flatten().float().cpu())
        self._rollouts[first:] = [self.make_rollout(part, sampled[k], scored[k], batch_std)
                                  for k, part in parts.items()]
        if self.grpo.loss_type in GLOBAL_TOKEN_LOSSES:  # TRL's num_items_in_batch: each count is all-reduced
            self._num_items = torch.stack([r.num_tokens for r in self._rollouts[first:]]).sum()

    def sample(self, rows: list[dict[str, Any]], micro_batch: int) -> list[Completion]:
        """G completions per prompt, seeded by (run seed, step, micro-batch, rank) alone."""
        cfg = self.rollout_config
        with self.timed("rollout"):
            return self.engine.generate(
                self.task.prompts(rows), max_new_tokens=cfg.max_new_tokens, greedy=False, temperature=cfg.temperature,
                top_p=cfg.top_p, stop=self.stop_strings(), num_return_sequences=self.grpo.num_generations,
                seed=sampling_seed(self.run_seed, self.global_step, micro_batch, world_info(self)[0]))

    def score(self, parts: list[list[dict[str, Any]]], sampled: list[list[Completion]]) -> list[Scores]:
        """Micro-batches' rewards in one call of each reward function, as TRL scores its generation batch, checked:
        completions no reward function applied to are NaN, as TRL's unscorable ones, but no failure."""
        with self.timed("reward"):
            repeated = [row for rows in parts for row in rows for _ in range(self.grpo.num_generations)]
            completions = [c for part in sampled for c in part]
            rewards = self.task.rewards(repeated, [c.text for c in completions], [c.token_ids for c in completions],
                                        unscorable=math.nan, **self.reward_context())
        if self.constraint is not None:  # per-sample reward - lambda * cost; the costs adapt lambda after the step
            self._step_scores.extend(zip(self.constraint.last_rewards, self.constraint.last_costs, strict=True))
        window = Scores(self.checked_rewards(torch.tensor(rewards, dtype=torch.float32), self.task.last_unscorable),
                        ~torch.tensor(self.task.last_scored, dtype=torch.bool),
                        {k: torch.tensor(v) for k, v in self.task.last_per_function.items()})
        return window.split([len(part) for part in sampled])

    @torch.no_grad()
    def make_rollout(self, rows: list[dict[str, Any]], completions: list[Completion], scores: Scores,
                     batch_std: torch.Tensor | None = None) -> RolloutBatch:
        """What the loss needs from a micro-batch's scored completions."""
        G = self.grpo.num_generations
        cfg = self.rollout_config
        rewards = scores.rewards
        prompts = self.task.prompts(rows)
        advantages = group_advantages(rewards, G, self.grpo.scale_rewards, batch_std=batch_std)

        rollout = rollout_tensors(self.tokenizer, encode_prompts(self.tokenizer, prompts), completions, rewards,
                                  advantages, self.grpo.mask_truncated_completions, self.device)
        rollout.unscorable, rollout.rewards_per_function = scores.unscorable, scores.per_function
        if self.grpo.loss_type in GLOBAL_TOKEN_LOSSES:  # TRL's num_items_in_batch: loss tokens over all ranks
            rollout.num_tokens = self.trainer.strategy.reduce(rollout.completion_mask.sum().float(), reduce_op="sum")
        with self.timed("logps"):
            width, temperature = rollout.completion_width, cfg.temperature
            if self.grpo.num_iterations > 1 or self.importance_sampling:  # ratios against the sampling weights
                rollout.old_logps = per_token_logps(self.policy, rollout.input_ids, rollout.attention_mask,
                                                    width, temperature)
            if self.importance_sampling:  # TRL's vLLM correction: pi_old / pi_engine, once per rollout
                g = self.grpo
                rollout.is_ratio, rollout.is_values = engine_correction(
                    rollout.old_logps, [c.logprobs for c in completions], rollout.completion_mask,
                    g.vllm_importance_sampling_mode, g.vllm_importance_sampling_clip_min,
                    g.vllm_importance_sampling_clip_max)
            if self.grpo.beta > 0:
                rollout.ref_logps = self.reference_logps(rollout.input_ids, rollout.attention_mask, width,
                                                         temperature)
        return rollout

    def reference_logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int,
                        temperature: float) -> torch.Tensor:
        """Per-token log-probs of the KL's reference: the frozen base copy, or with model.grpo.lora the policy
        with its adapter disabled (PEFT's disable_adapter; its base weights never train, so that IS the base)."""
        if self.reference is not None:
            return per_token_logps(self.reference.model, input_ids, attention_mask, width, temperature)
        with self.policy.disable_adapter():
            return per_token_logps(self.policy, input_ids, attention_mask, width, temperature)

    def checked_rewards(self, rewards: torch.Tensor, unscorable: int = 0) -> torch.Tensor:
        """Every non-finite reward as NaN (a float32 overflow included): left out of its group's mean and std,
        advantage 0. Too many in this window, on any rank, stop the run (esrl.tasks.reward_values); the
        `unscorable` NaNs (no reward function applied) are no failures and count on neither side."""
        rewards = torch.where(torch.isfinite(rewards), rewards, torch.nan)
        local = torch.tensor([float(rewards.isnan().sum()) - unscorable, rewards.numel() - unscorable],
                             dtype=torch.float64)
        total = self.trainer.strategy.reduce(local.to(self.device), reduce_op="sum").cpu()
        check_bad_rewards(int(total[0]), int(total[1]), step=self.global_step, unit="GRPO samples",
                          sources=self.task.last_bad)
        return rewards

    # -- logging ---------------------------------------------------------------------------------------------
    def _log_step(self, rollout: RolloutBatch, stats: dict[str, torch.Tensor]) -> None:
        """Keep a micro-batch's rollout and loss stats; at its window's last, log the optimizer step's metrics over
        all of them from every process's values (step_metrics), as TRL over its generation batch."""
        self._window_log.append((rollout, stats))
        if not self._closes_window:
            return
        rollouts, stats = zip(*self._window_log)
        self._window_log = []
        metrics = {"train/lr": self.trainer.optimizers[0].param_groups[0]["lr"]}
        metrics.update(loss_metrics(stats, self.gathered))
        batch_size = sum(int(x.rewards.numel()) for x in rollouts) * self.trainer.world_size
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=batch_size)
        sampled = {}  # a reused window's were logged on the step that sampled it, once, as TRL logs them
        if self._window_sampled:
            samples = {k: self.gathered(v).reshape(-1) for k, v in window_samples(rollouts).items()}
            sampled = {**sample_metrics(samples, self.grpo.num_generations, self.grpo.scale_rewards),
                       **window_sampling_metrics(rollouts, self.gathered)}
            self.log("reward", sampled["train/reward_mean"], prog_bar=True, logger=False, batch_size=batch_size)
        sampled.update(self.reward_metrics([*metrics, *sampled, *OTHER_HOOKS]))  # what reward functions logged
        self.log_once(sampled)

    def gathered(self, values: torch.Tensor) -> torch.Tensor:
        """`values` of every process, stacked [W, ...] on the CPU."""
        if self.trainer.world_size == 1:
            return values.unsqueeze(0)
        return self.all_gather(values.to(self.device)).cpu()

    def on_before_optimizer_step(self, optimizer) -> None:
        if not self._closes_window:  # DeepSpeed, mid-window: no step (see training_step)
            return
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        # the step's loss as TRL logs it (the sum of its micro-batch losses; mean over ranks)
        self.log("train/loss", self._step_loss, on_step=True, on_epoch=False, sync_dist=True)
        if grads and getattr(self.trainer.precision_plugin, "scaler", None) is None:  # fp16 scaling skips inf steps
            check_gradient(grads, algo="GRPO", step=self.global_step)
        if grads:  # before clipping, as TRL logs it (DeepSpeed keeps its own gradients: none here)
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
            self.log("train/grad_norm", float(norm), on_step=True, on_epoch=False, sync_dist=True)
        # Last before the optimizer changes the weights (after the callbacks' hooks, on every precision plugin and
        # DeepSpeed): one that fails part way (an OOM inside AdamW) leaves weights of no step, so no failure
        # checkpoint may save them as this step's start (esrl.callbacks.failure).
        self.update_in_flight = True

    # -- vLLM rollouts (rollout.engine: vllm): the engine keeps its own copy of the weights ---------------------
    def optimizer_step(self, *args, **kwargs) -> None:
        """Lightning's optimizer step, then the new weights pushed into a vLLM engine (HF names; model.grpo.lora: its
        adapter only; vllm_sleep: the push wakes it; not with ZeRO-3's partitioned parameters; the HF engine uses the
        policy itself); non-finite weights stop the run (esrl.finite)."""
        step = self.global_step
        super().optimizer_step(*args, **kwargs)
        self.update_in_flight = True  # esrl.callbacks.failure: a checkpoint now would hold an uncounted update
        if self._closes_window:  # else DeepSpeed, mid-window: its engine took no step (see training_step)
            check_weights((p for p in self.policy.parameters() if p.requires_grad), algo="GRPO", step=step)
            self.sync_engine()
            if (step + 1) % self.grpo.num_iterations and not self.engine.capabilities.shares_policy_weights:
                self.engine.sleep()  # the push woke it (vllm_sleep); the next step reuses this window: no sampling
            if self.constraint is not None:
                self._adapt_lambda(step)
            self._log_times()
        self.update_in_flight = False

    def sync_engine(self) -> None:
        """An engine with its own weights (vLLM) gets the policy's: with model.grpo.lora the adapter (an adapter
        push, the engine keeps the base weights), else every weight. The HF engine generates with the policy."""
        if self.engine.capabilities.shares_policy_weights:
            return
        if self.grpo.lora is not None:
            self.engine.set_default_adapter(policy_adapter(self.policy))
        else:
            self.engine.load_weights(list(self.policy.named_parameters()))

    def _adapt_lambda(self, step: int) -> None:
        """lambda from the mean cost of this step's fresh rollouts on all ranks (none when rollouts are reused)."""
        raw, costs = zip(*self._step_scores) if self._step_scores else ((), ())
        local = [math.fsum(costs), math.fsum(raw), sum(c <= 0 for c in costs), len(costs)]
        self._step_scores = []
        total = self.trainer.strategy.reduce(torch.tensor(local, dtype=torch.float64, device=self.device),
                                             reduce_op="sum")
        if total[3] > 0:
            self.log_once(self.adapt_lambda(*(float(t) for t in total[:3]), int(total[3])), step)

    def _log_times(self) -> None:
        """The step's time split over its micro-batches (update: forwards, backwards, optimizer step), as ES's."""
        total, self._step_start = time.perf_counter() - self._step_start, 0.0
        self.log_dict({**{f"time/{k}": v for k, v in self._timings.items()},
                       "time/update": total - sum(self._timings.values()), "time/step": total},
                      on_step=True, on_epoch=False, sync_dist=True)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """num_iterations > 1, saved inside a reuse window: every process's rollouts (old logps included) too, so the
        resumed run trains on them as the uninterrupted one does, instead of sampling a fresh batch. Every process
        runs this hook (ModelCheckpoint, esrl's interruption); rank 0 writes the file."""
        super().on_save_checkpoint(checkpoint)
        checkpoint["esrl_grpo"] = {"config": asdict(self.grpo), "run_seed": self.run_seed}
        if self.global_step % self.grpo.num_iterations and self._rollouts:
            checkpoint["esrl_grpo_reuse"] = reuse_state(self._rollouts, self._num_items, self.trainer.world_size)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)  # the rollouts go to the device at train start
        self._rollouts, self._num_items = reused(checkpoint.get("esrl_grpo_reuse"), self.trainer.world_size,
                                                 self.trainer.global_rank)
