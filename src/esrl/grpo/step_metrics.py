"""GRPO's step metrics as TRL logs them: over the optimizer step's whole window (TRL's generation batch), on every
process's samples; the loss's statistics per micro-batch over processes, then averaged over micro-batches."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from esrl.grpo.advantages import nanstd
from esrl.grpo.importance import sampling_stats
from esrl.grpo.rollout_batch import RolloutBatch

OTHER_HOOKS = ("train/loss", "train/grad_norm", "train/lambda", "train/cost_mean")
"""Metrics the GRPO module logs from hooks other than the step's logging (the optimizer step's): a name a reward
function's log_metric may not take either."""


def rank_reduction(key: str) -> str:
    """How a loss statistic combines over processes: "min" for a ..._min or .../min key, "max" likewise, else
    "mean" (TRL's)."""
    for reduce_fx in ("min", "max"):
        if key.endswith((f"_{reduce_fx}", f"/{reduce_fx}")):
            return reduce_fx
    return "mean"


def window_samples(rollouts: Sequence[RolloutBatch]) -> dict[str, torch.Tensor]:
    """The window's per-sample values on this process as flat float tensors, of one length on every process (what
    all_gather needs): rewards, advantages, lengths, truncated, each reward function's, and the unscorable count."""
    samples = {key: torch.cat([getattr(x, key).detach().float().cpu() for x in rollouts])
               for key in ("rewards", "advantages", "lengths", "truncated")}
    samples["unscorable"] = torch.tensor([float(sum(x.unscorable for x in rollouts))])
    for name in rollouts[0].rewards_per_function:
        samples[f"rewards/{name}"] = torch.cat([x.rewards_per_function[name] for x in rollouts]).float()
    return samples


def sample_metrics(samples: dict[str, torch.Tensor], num_generations: int) -> dict[str, float]:
    """The step's reward, advantage and length statistics over `samples` (window_samples, gathered from every
    process), as TRL's over its gathered generation batch."""
    r, adv, lengths, truncated = (samples[k] for k in ("rewards", "advantages", "lengths", "truncated"))
    unscorable = int(samples["unscorable"].sum())
    group_std = nanstd(r.view(-1, num_generations), dim=1)
    finite = r[~r.isnan()]
    ended = lengths[truncated == 0] if (truncated == 0).any() else torch.zeros(1)  # 0 when none ended, as TRL
    metrics = {
        "train/reward_mean": r.nanmean(), "train/reward_std": nanstd(r),  # TRL's: over all rewards
        "train/reward_group_std": group_std.nanmean(),
        "train/reward_min": finite.min() if finite.numel() else math.nan,
        "train/reward_max": finite.max() if finite.numel() else math.nan,
        "train/frac_reward_zero_std": (group_std < 1e-6).float().mean(),
        "train/bad_rewards": int(r.isnan().sum()) - unscorable,  # left out of the advantages for a NaN/inf reward
        "train/unscorable": unscorable,  # no reward function applied: left out too, as TRL
        "train/advantage_abs_mean": adv.abs().mean(), "train/advantage_std": adv.std(unbiased=False),
        "train/advantage_min": adv.min(), "train/advantage_max": adv.max(),
        "train/completion_length_mean": lengths.mean(), "train/completion_length_min": lengths.min(),
        "train/completion_length_max": lengths.max(),
        "train/truncated_frac": truncated.mean(),
        # those that ended (an end token or a stop string)
        "train/terminated_length_mean": ended.mean(), "train/terminated_length_min": ended.min(),
        "train/terminated_length_max": ended.max(),
    }
    for key in (k for k in samples if k.startswith("rewards/")):  # TRL's rewards/<function>/mean, /std; None out
        metrics[f"train/{key}/mean"], metrics[f"train/{key}/std"] = samples[key].nanmean(), nanstd(samples[key])
    return {k: float(v) for k, v in metrics.items()}


def loss_metrics(stats: Sequence[dict[str, torch.Tensor]],
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
    """Each loss (or sampling/*) statistic as TRL logs it: one value per micro-batch, reduced over processes by its
    rank_reduction (`gather`: a tensor stacked from every process, [W, ...]; None: one process), then those values
    averaged leaving NaNs out, as GRPOTrainer.log does (NaN if all are). Taking min/max over micro-batches, or
    letting a NaN micro-batch (all its sequences masked) through, is not TRL's number."""
    keys = list(stats[0])
    local = torch.tensor([[float(s[key]) for s in stats] for key in keys], dtype=torch.float64)  # [K, A]
    every = gather(local) if gather is not None else local.unsqueeze(0)  # [W, K, A]
    return {f"train/{key}": float(over_processes(every[:, i], rank_reduction(key)).nanmean())
            for i, key in enumerate(keys)}


def over_processes(values: torch.Tensor, reduce_fx: str) -> torch.Tensor:
    """[W, A] -> [A]: the mean over processes, or min / max leaving NaNs out (trl.trainer.utils.nanmin / nanmax:
    NaN if all are)."""
    if reduce_fx == "mean":
        return values.mean(0)
    fill = math.inf if reduce_fx == "min" else -math.inf
    kept = torch.where(values.isnan(), fill, values)
    out = kept.amin(0) if reduce_fx == "min" else kept.amax(0)
    return torch.where(values.isnan().all(0), math.nan, out)


def window_loss_metrics(rollouts: Sequence[RolloutBatch], stats: Sequence[dict[str, torch.Tensor]],
                        gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
    """The window's loss statistics (loss_metrics) and, with the vLLM correction, TRL's sampling/* metrics: those
    once over the window's rollouts (TRL's generation batch), not micro-batch values averaged."""
    metrics = loss_metrics(stats, gather)
    if rollouts[0].is_values:
        metrics.update(loss_metrics([sampling_stats([x.is_values for x in rollouts])], gather))
    return metrics
