"""GRPO's step metrics as TRL logs them: over the optimizer step's whole window (TRL's generation batch), on every
process's samples, on the steps that generate it (with num_iterations > 1 the steps reusing it log none, as TRL's);
the loss's statistics per micro-batch over processes, then averaged over micro-batches, on every step."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from esrl.grpo.advantages import nanstd
from esrl.grpo.importance import sampling_stats
from esrl.grpo.loss import PooledMean
from esrl.grpo.rollout_batch import RolloutBatch

OTHER_HOOKS = ("train/loss", "train/grad_norm", "train/lambda", "train/cost_mean", "train/raw_reward_mean",
               "train/safe_frac")
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


def sample_metrics(samples: dict[str, torch.Tensor], num_generations: int,
                   scale_rewards: str = "group") -> dict[str, float]:
    """The step's reward, advantage and length statistics over `samples` (window_samples, gathered from every
    process), as TRL's over its gathered generation batch. frac_reward_zero_std is TRL's too: the share of rewards
    whose scaling std is 0 (torch.isclose), so with scale_rewards batch 1 or 0 (the whole batch's std), not the share
    of groups."""
    r, adv, lengths, truncated = (samples[k] for k in ("rewards", "advantages", "lengths", "truncated"))
    unscorable = int(samples["unscorable"].sum())
    group_std = nanstd(r.view(-1, num_generations), dim=1)
    scaling_std = nanstd(r).view(1) if scale_rewards == "batch" else group_std
    finite = r[~r.isnan()]
    ended = lengths[truncated == 0] if (truncated == 0).any() else torch.zeros(1)  # 0 when none ended, as TRL
    metrics = {
        "train/reward_mean": r.nanmean(), "train/reward_std": nanstd(r),  # TRL's: over all rewards
        "train/reward_group_std": group_std.nanmean(),
        "train/reward_min": finite.min() if finite.numel() else math.nan,
        "train/reward_max": finite.max() if finite.numel() else math.nan,
        "train/frac_reward_zero_std": torch.isclose(scaling_std, torch.zeros_like(scaling_std)).float().mean(),
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


def loss_metrics(stats: Sequence[dict[str, torch.Tensor | PooledMean]],
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
    """Each loss (or sampling/*) statistic as TRL logs it: one value per micro-batch over processes (`gather`: a
    tensor stacked from every process, [W, ...]; None: one process): a PooledMean's totals and counts summed, then
    divided (TRL's global_masked_mean), a value reduced by its rank_reduction; then those values averaged leaving
    NaNs out, as GRPOTrainer.log does (NaN if all are). Taking min/max over micro-batches, letting a NaN micro-batch
    (all its sequences masked) through, or averaging per-process means is not TRL's number."""
    keys = list(stats[0])
    pooled = [isinstance(stats[0][key], PooledMean) for key in keys]
    local = torch.tensor([[[float(s[key].total), float(s[key].count)] if is_pooled else [float(s[key]), 1.0]
                           for s in stats] for key, is_pooled in zip(keys, pooled)], dtype=torch.float64)  # [K, A, 2]
    every = gather(local) if gather is not None else local.unsqueeze(0)  # [W, K, A, 2]
    out = {}
    for i, (key, is_pooled) in enumerate(zip(keys, pooled)):
        if is_pooled:
            values = every[:, i, :, 0].sum(0) / every[:, i, :, 1].sum(0).clamp(min=1.0)
        else:
            values = over_processes(every[:, i, :, 0], rank_reduction(key))
        out[f"train/{key}"] = float(values.nanmean())
    return out


def over_processes(values: torch.Tensor, reduce_fx: str) -> torch.Tensor:
    """[W, A] -> [A]: the mean over processes, or min / max leaving NaNs out (trl.trainer.utils.nanmin / nanmax:
    NaN if all are)."""
    if reduce_fx == "mean":
        return values.mean(0)
    fill = math.inf if reduce_fx == "min" else -math.inf
    kept = torch.where(values.isnan(), fill, values)
    out = kept.amin(0) if reduce_fx == "min" else kept.amax(0)
    return torch.where(values.isnan().all(0), math.nan, out)


def window_sampling_metrics(rollouts: Sequence[RolloutBatch],
                            gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
    """With the vLLM correction, TRL's sampling/* metrics once over the window's rollouts (TRL's generation batch),
    not micro-batch values averaged; without it none."""
    if not rollouts[0].is_values:
        return {}
    return loss_metrics([sampling_stats([x.is_values for x in rollouts])], gather)
