"""Importance-sampling correction for rollouts sampled by an engine with its own weights (vLLM), as TRL 1.16.

The engine samples from pi_sampler, whose log-probs differ from the trainer's pi_old (kernels, precision), so
the loss is reweighted by pi_old / pi_sampler (TRL's _generate_and_score_completions, computed once per rollout
without gradient): per token or per sequence (the product over its tokens), truncated to [clip_min, clip_max]
(`*_truncate`) or zeroed outside it (`*_mask`). Tokens without an engine log-prob (NaN) get ratio 1.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

IMPORTANCE_SAMPLING_MODES: tuple[str, ...] = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@torch.no_grad()
def importance_sampling_ratio(old_per_token_logps: torch.Tensor, sampling_per_token_logps: torch.Tensor,
                              mask: torch.Tensor, mode: str = "sequence_mask", clip_min: float | None = None,
                              clip_max: float | None = 3.0) -> torch.Tensor:
    """exp(log pi_old - log pi_sampler) per token [B, T] (token_*) or per sequence [B, 1] (sequence_*),
    truncated or masked to [clip_min, clip_max] (None: unbounded on that side)."""
    diff = torch.nan_to_num((old_per_token_logps - sampling_per_token_logps) * mask, nan=0.0)
    if mode.startswith("sequence_"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("token_truncate", "sequence_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode in ("token_mask", "sequence_mask"):
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"unknown vllm_importance_sampling_mode {mode!r}; expected one of {IMPORTANCE_SAMPLING_MODES}")


@torch.no_grad()
def importance_sampling_values(old_per_token_logps: torch.Tensor, sampling_per_token_logps: torch.Tensor,
                               mask: torch.Tensor, ratio: torch.Tensor, mode: str) -> dict[str, torch.Tensor]:
    """The values TRL's sampling metrics summarize, flat: |log pi_old - log pi_sampler| of the scored tokens (those
    without an engine log-prob left out) and the ratios (per token, or per sequence in sequence_* modes)."""
    keep = mask.bool()
    delta = (old_per_token_logps - sampling_per_token_logps).abs()
    flat = ratio.flatten() if mode.startswith("sequence_") else ratio[keep]
    return {"delta": delta[keep & ~torch.isnan(delta)], "ratio": flat}


@torch.no_grad()
def sampling_stats(values: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """TRL's sampling metrics on this process, once over a whole generation batch (a window's micro-batches, each
    importance_sampling_values'), as TRL computes them; it reduces them over processes (mean of means, min of mins,
    max of maxes). 0 where there is no value."""
    delta = torch.cat([v["delta"] for v in values])
    flat = torch.cat([v["ratio"] for v in values])
    zero = delta.new_zeros(())

    def stat(x: torch.Tensor, fn) -> torch.Tensor:
        return fn(x) if x.numel() > 0 else zero

    return {
        "sampling/sampling_logp_difference/mean": stat(delta, torch.mean),
        "sampling/sampling_logp_difference/max": stat(delta, torch.max),
        "sampling/importance_sampling_ratio/min": stat(flat, torch.min),
        "sampling/importance_sampling_ratio/mean": stat(flat, torch.mean),
        "sampling/importance_sampling_ratio/max": stat(flat, torch.max),
    }


@torch.no_grad()
def engine_correction(old_per_token_logps: torch.Tensor, engine_logprobs: Sequence[Sequence[float]],
                      mask: torch.Tensor, mode: str, clip_min: float | None,
                      clip_max: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A rollout's ratio and its sampling metrics' values (importance_sampling_values), from the engine's log-probs
    of each completion's tokens (padded with 0 to the rollout's width)."""
    sampling = torch.zeros_like(old_per_token_logps)
    for i, logprobs in enumerate(engine_logprobs):
        sampling[i, :len(logprobs)] = torch.tensor(logprobs, dtype=sampling.dtype)
    mask = mask.to(sampling.dtype)
    ratio = importance_sampling_ratio(old_per_token_logps, sampling, mask, mode, clip_min, clip_max)
    return ratio, importance_sampling_values(old_per_token_logps, sampling, mask, ratio, mode)
