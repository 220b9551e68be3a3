"""How GRPO's step metrics combine over processes (Lightning's sync_dist reduce_fx), as TRL logs them."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from esrl.grpo.advantages import nanstd
from esrl.grpo.rollout_batch import RolloutBatch

COUNTS = {"train/bad_rewards", "train/unscorable"}
"""Step metrics that count samples: summed over processes, so the logged number is the step's, as ES logs it."""


def rank_reduction(key: str) -> str:
    """How a step metric combines over processes: "sum" for COUNTS, "min" for a ..._min or .../min key, "max"
    likewise, else "mean"."""
    if key in COUNTS:
        return "sum"
    for reduce_fx in ("min", "max"):
        if key.endswith((f"_{reduce_fx}", f"/{reduce_fx}")):
            return reduce_fx
    return "mean"


def window_metrics(rollouts: Sequence[RolloutBatch], stats: Sequence[dict[str, torch.Tensor]],
                   num_generations: int) -> dict[str, torch.Tensor | float | int]:
    """One optimizer step's metrics on this process, over its window's micro-batches (TRL's generation batch):
    reward, advantage and length statistics over all their samples; each loss stat (and sampling/* stat) over the
    micro-batches by its rank_reduction (mean, as TRL averages them; min of mins, max of maxes)."""
    r = torch.cat([x.rewards for x in rollouts])
    adv = torch.cat([x.advantages for x in rollouts]).float().cpu()
    lengths = torch.cat([x.lengths for x in rollouts]).float()
    truncated = torch.cat([x.truncated for x in rollouts]).cpu()
    ended = lengths[~truncated] if (~truncated).any() else torch.zeros(1)
    unscorable = sum(x.unscorable for x in rollouts)
    group_std = nanstd(r.view(-1, num_generations), dim=1)
    finite = r[~r.isnan()]  # empty on a rank whose samples all failed while the others' kept the step usable
    metrics: dict[str, torch.Tensor | float | int] = {
        "train/reward_mean": r.nanmean(), "train/reward_std": nanstd(r),  # TRL's: over all rewards
        "train/reward_group_std": group_std.nanmean(),
        # empty: the identities of the min and max over ranks (rank_reduction), so the others' values stand
        "train/reward_min": finite.min() if finite.numel() else math.inf,
        "train/reward_max": finite.max() if finite.numel() else -math.inf,
        "train/frac_reward_zero_std": (group_std < 1e-6).float().mean(),
        "train/bad_rewards": r.isnan().sum() - unscorable,  # left out of the advantages for a NaN/inf reward
        "train/unscorable": unscorable,  # no reward function applied: left out too, as TRL
        "train/advantage_abs_mean": adv.abs().mean(), "train/advantage_std": adv.std(unbiased=False),
        "train/advantage_min": adv.min(), "train/advantage_max": adv.max(),
        "train/completion_length_mean": lengths.mean(), "train/completion_length_min": lengths.min(),
        "train/completion_length_max": lengths.max(),
        "train/truncated_frac": truncated.float().mean(),
        # those that ended (an end token or a stop string); 0 when none did, as TRL
        "train/terminated_length_mean": ended.mean(), "train/terminated_length_min": ended.min(),
        "train/terminated_length_max": ended.max(),
    }
    for name in rollouts[0].rewards_per_function:  # TRL's rewards/<function>/mean and /std, None left out
        values = torch.cat([x.rewards_per_function[name] for x in rollouts]).float()
        metrics[f"train/rewards/{name}/mean"], metrics[f"train/rewards/{name}/std"] = values.nanmean(), nanstd(values)
    per_micro_batch = [{**s, **x.is_stats} for x, s in zip(rollouts, stats)]
    combine = {"mean": torch.mean, "min": torch.min, "max": torch.max, "sum": torch.sum}
    for key in per_micro_batch[0]:
        values = torch.stack([torch.as_tensor(m[key], dtype=torch.float64).cpu() for m in per_micro_batch])
        metrics[f"train/{key}"] = combine[rank_reduction(f"train/{key}")](values)
    return metrics
