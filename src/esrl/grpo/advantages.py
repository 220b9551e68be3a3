"""Group-relative advantages, as TRL 1.16's GRPOTrainer computes them from summed rewards."""

from __future__ import annotations

from typing import Literal

import torch

RewardScale = Literal["group", "batch", "none"]


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased (Bessel) std ignoring NaNs, NaN below 2 values: trl.trainer.utils.nanstd, line for line."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    return std if keepdim else (std.squeeze(dim) if dim is not None else std.squeeze())


def group_advantages(rewards: torch.Tensor, num_generations: int, scale: RewardScale = "group",
                     eps: float = 1e-4, batch_std: torch.Tensor | None = None) -> torch.Tensor:
    """A_i = r_i - mean(group), divided by (std + eps) unless scale == "none".

    rewards is flat, [B * G], the G completions of one prompt contiguous (TRL's layout). As in TRL:
    "group" uses each group's std, "batch" the std of the whole batch (the baseline stays the group mean;
    `batch_std`: that of a larger batch these rewards are part of, TRL's generation batch over processes),
    the std is the unbiased one (like torch.std), eps is 1e-4, and NaN rewards (unscorable completions) are
    left out of mean and std and get advantage 0. A group of equal rewards gets zeros, not NaN.
    """
    if rewards.dim() != 1 or rewards.numel() % num_generations != 0:
        raise ValueError(f"rewards must be flat, a multiple of {num_generations}: {tuple(rewards.shape)}")
    grouped = rewards.view(-1, num_generations)
    advantages = rewards - torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale == "group":
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
        if num_generations == 1:
            std = torch.zeros_like(rewards)
        advantages = advantages / (std + eps)
    elif scale == "batch":
        if batch_std is not None:
            std = torch.as_tensor(batch_std, dtype=rewards.dtype).expand_as(rewards)
        else:
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = advantages / (std + eps)
    elif scale != "none":
        raise ValueError(f"unknown reward scale {scale!r}; expected 'group', 'batch' or 'none'")
    return torch.nan_to_num(advantages, nan=0.0)
