"""Fitness shaping: from raw member rewards to the weights of the update."""

from __future__ import annotations

from typing import Literal

import torch

Shaping = Literal["zscore", "centered_rank", "raw"]


def zscore(fitness: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(f - mean) / (std + eps) with the population std, as the paper's code does. All equal: zeros, exactly (the
    mean of equal values can be off by a rounding step, which the tiny std would turn into a random update)."""
    f = fitness.double()
    if f.numel() == 0 or bool(f.max() == f.min()):
        return torch.zeros_like(f)
    return (f - f.mean()) / (f.std(unbiased=False) + eps)


def centered_rank(fitness: torch.Tensor) -> torch.Tensor:
    """Ranks mapped to [-0.5, 0.5]; tied values share their average rank, so ties get equal weight."""
    f = fitness.double()
    n = f.numel()
    if n < 2:
        return torch.zeros_like(f)
    order = torch.argsort(f, stable=True)
    ranks = torch.empty_like(f)
    ranks[order] = torch.arange(n, dtype=f.dtype)
    for value in torch.unique(f):  # average ranks over ties
        tied = f == value
        ranks[tied] = ranks[tied].mean()
    return ranks / (n - 1) - 0.5


def _shape(f: torch.Tensor, method: Shaping) -> torch.Tensor:
    if method == "zscore":
        return zscore(f)
    if method == "centered_rank":
        return centered_rank(f)
    if method == "raw":
        return f.double().clone()
    raise ValueError(f"unknown fitness shaping {method!r}")


def shape_fitness(fitness: torch.Tensor, method: Shaping = "zscore") -> torch.Tensor:
    """Shaped fitness of the members with a finite fitness, 0 for the others: a member with a NaN/inf reward is
    left out of the statistics and out of the update (the policy: esrl.tasks.reward_values)."""
    usable = torch.isfinite(fitness)
    if bool(usable.all()):
        return _shape(fitness, method)
    shaped = torch.zeros(fitness.shape, dtype=torch.float64)
    shaped[usable] = _shape(fitness[usable], method)
    return shaped
