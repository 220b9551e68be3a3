"""The GRPO objective, term for term as TRL 1.16's GRPOTrainer._compute_loss.

Defaults are TRL 1.16's GRPOConfig ones: loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=None (->
epsilon), importance_sampling_level="token", use_bias_correction_kl=True (the k3 KL term is multiplied by the
importance ratio, which changes the KL gradient even on-policy). Loss types: grpo, bnpo, dr_grpo, dapo, cispo,
sapo, luspo, vespo (per-token objectives: esrl.grpo.objectives; aggregation, gradient accumulation and
processes included: esrl.grpo.reductions); the vLLM importance-sampling ratio (esrl.grpo.importance) comes in
as an argument. Not ported: off-policy sequence masks (off_policy_mask_threshold), the high-entropy token mask
(top_entropy_quantile), the entropy bonus, tool masks and the MoE auxiliary loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
from torch import nn

from esrl.grpo import objectives
from esrl.grpo.reductions import GLOBAL_TOKEN_LOSSES, LOSS_TYPES, reduce_loss

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
CLIPPED_LOSSES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")

__all__ = ["CLIPPED_LOSSES", "GLOBAL_TOKEN_LOSSES", "LOSS_TYPES", "GRPOLoss", "LossType", "PooledMean"]


class PooledMean(NamedTuple):
    """A mean over tokens (or sequences) that processes pool before dividing, as TRL's global_masked_mean sums each
    process's numerator and count first: the mean of per-process means would weigh a process with 10 tokens as one
    with 1,000. `item()`: this process's own mean."""

    total: torch.Tensor
    count: torch.Tensor

    def item(self) -> float:
        return float(self.total / self.count.clamp(min=1.0))


def _nan_reduce(x: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """min/max ignoring NaNs; NaN if all are (trl.trainer.utils.nanmin/nanmax)."""
    keep = ~torch.isnan(x)
    return reduce(x[keep]) if keep.any() else x.new_tensor(float("nan"))


class GRPOLoss(nn.Module):
    """Per-token objective of loss_type (+ beta * k3 KL to a reference), reduced over tokens per loss_type
    (esrl.grpo.reductions: the returned value is the micro-batch loss before Lightning's division by
    accumulate_grad_batches, i.e. TRL's value times accumulate_grad_batches)."""

    def __init__(self, beta: float = 0.0, epsilon_low: float = 0.2, epsilon_high: float | None = None,
                 loss_type: LossType = "dapo", max_completion_length: int | None = None,
                 use_bias_correction_kl: bool = True, delta: float | None = None,
                 importance_sampling_level: Literal["token", "sequence"] = "token",
                 sapo_temperature_neg: float = 1.05, sapo_temperature_pos: float = 1.0,
                 vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0,
                 vespo_lambda_neg: float = 2.0) -> None:
        super().__init__()
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
        if loss_type == "dr_grpo" and max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' normalizes by max_completion_length; pass it")
        if importance_sampling_level not in objectives.IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"unknown importance_sampling_level {importance_sampling_level!r}")
        self.beta = beta
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
        self.loss_type = loss_type
        self.max_completion_length = max_completion_length
        self.use_bias_correction_kl = use_bias_correction_kl
        self.delta = delta  # INTELLECT-2 two-sided clipping: caps the unclipped ratio at delta
        self.importance_sampling_level = importance_sampling_level
        self.sapo_temperatures = (sapo_temperature_pos, sapo_temperature_neg)
        self.vespo_params = dict(k_pos=vespo_k_pos, lambda_pos=vespo_lambda_pos, k_neg=vespo_k_neg,
                                 lambda_neg=vespo_lambda_neg)

    @classmethod
    def from_config(cls, cfg, max_completion_length: int) -> GRPOLoss:
        """The loss a GRPOConfig (model.grpo) describes, from its fields of the same names."""
        return cls(beta=cfg.beta, epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high, loss_type=cfg.loss_type,
                   max_completion_length=max_completion_length, use_bias_correction_kl=cfg.use_bias_correction_kl,
                   delta=cfg.delta, importance_sampling_level=cfg.importance_sampling_level,
                   sapo_temperature_neg=cfg.sapo_temperature_neg, sapo_temperature_pos=cfg.sapo_temperature_pos,
                   vespo_k_pos=cfg.vespo_k_pos, vespo_lambda_pos=cfg.vespo_lambda_pos, vespo_k_neg=cfg.vespo_k_neg,
                   vespo_lambda_neg=cfg.vespo_lambda_neg)

    def forward(self, per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor | None,
                advantages: torch.Tensor, completion_mask: torch.Tensor,
                ref_per_token_logps: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | float | None = None, num_processes: int = 1,
                accumulate_grad_batches: int = 1, importance_sampling_ratio: torch.Tensor | None = None,
                entropies: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor | PooledMean]]:
        """Logps and mask are [B, T], advantages [B] or [B, T]. Old logps None means on-policy (as in TRL:
        the ratio is 1 but still carries the gradient). num_items_in_batch: active tokens of the whole
        generation batch (all micro-batches of the optimizer step, all processes; dapo, cispo and vespo
        divide by it, see esrl.grpo.reductions). importance_sampling_ratio: the vLLM correction
        (esrl.grpo.importance), [B, T] or [B, 1]; multiplies the per-token loss, or enters vespo's weight.
        entropies: the policy's per-token entropies [B, T] (esrl.models.logps), a metric only.

        Returns the scalar loss and detached stats named like TRL's metrics (token means as PooledMean): entropy
        (given entropies: their token mean over the mask); kl (beta != 0 only; the mean
        bias-corrected per-token KL); clipped losses: clip_ratio/{low,high,region}_mean (token means),
        clip_ratio/low_min and clip_ratio/high_max (over per-sequence means); cispo: cispo_clip_ratio; vespo:
        vespo/phi_seq_mean.
        """
        mask = completion_mask.to(per_token_logps.dtype)
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        if old_per_token_logps is None:
            old_per_token_logps = per_token_logps.detach()

        log_ratio = per_token_logps - old_per_token_logps
        coef_1 = torch.exp(objectives.log_importance_weights(log_ratio, mask, self.importance_sampling_level))
        per_token_kl = None
        if self.beta != 0.0:
            if ref_per_token_logps is None:
                raise ValueError("beta != 0 needs ref_per_token_logps")
            diff = ref_per_token_logps - per_token_logps
            per_token_kl = torch.exp(diff) - diff - 1  # k3 estimator of KL(pi || ref)
            if self.use_bias_correction_kl:
                per_token_kl = per_token_kl * coef_1

        phi = None
        if self.loss_type == "cispo":
            per_token_loss = objectives.cispo(coef_1, advantages, per_token_logps, self.epsilon_high)
        elif self.loss_type == "sapo":
            per_token_loss = objectives.sapo(coef_1, advantages, *self.sapo_temperatures)
        elif self.loss_type == "vespo":
            phi = objectives.vespo_weights(advantages, log_ratio, mask, importance_sampling_ratio,
                                           **self.vespo_params)
            per_token_loss = objectives.vespo(phi, advantages, per_token_logps)
        else:
            per_token_loss = objectives.clipped(coef_1, advantages, self.epsilon_low, self.epsilon_high,
                                                self.delta)
        if importance_sampling_ratio is not None and self.loss_type != "vespo":
            per_token_loss = per_token_loss * importance_sampling_ratio
        if per_token_kl is not None:
            per_token_loss = per_token_loss + self.beta * per_token_kl

        loss = reduce_loss(per_token_loss, mask, self.loss_type, self.max_completion_length,
                           num_items_in_batch, num_processes, accumulate_grad_batches)
        if self.loss_type in CLIPPED_LOSSES and self.delta is not None:  # TRL counts clipping on the capped ratio
            coef_1 = torch.clamp(coef_1, max=self.delta)
        stats = self._stats(coef_1, advantages, mask, per_token_kl, phi)
        if entropies is not None:
            stats["entropy"] = PooledMean((entropies * mask).sum().detach(), mask.sum())
        return loss, stats

    @torch.no_grad()
    def _stats(self, coef_1: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               per_token_kl: torch.Tensor | None, phi: torch.Tensor | None) -> dict[str, torch.Tensor | PooledMean]:
        """This process's parts of TRL's metrics: token means as PooledMean (pooled over processes, then divided),
        the per-sequence min and max as values."""
        def mean(x: torch.Tensor) -> PooledMean:  # token mean; one value per sequence: sequence mean
            if x.size(-1) == 1:  # as TRL: also when the batch is one token wide
                return PooledMean(x.sum(), x.new_tensor(float(x.size(0))))
            return PooledMean((x * mask).sum(), mask.sum())

        def seq_mean(x: torch.Tensor) -> torch.Tensor:  # NaN for empty sequences, skipped by _nan_reduce
            if x.size(-1) == 1:  # as TRL: also when the batch is one token wide
                return x.squeeze(-1)
            return (x * mask).sum(-1) / mask.sum(-1)

        stats: dict[str, torch.Tensor] = {}
        if per_token_kl is not None:
            stats["kl"] = mean(per_token_kl)
        if self.loss_type in CLIPPED_LOSSES:
            low = ((coef_1 < 1 - self.epsilon_low) & (advantages < 0)).to(mask.dtype)
            high = ((coef_1 > 1 + self.epsilon_high) & (advantages > 0)).to(mask.dtype)
            stats.update({
                "clip_ratio/low_mean": mean(low),
                "clip_ratio/high_mean": mean(high),
                "clip_ratio/region_mean": mean(torch.maximum(low, high)),
                "clip_ratio/low_min": _nan_reduce(seq_mean(low), torch.min),
                "clip_ratio/high_max": _nan_reduce(seq_mean(high), torch.max),
            })
        elif self.loss_type == "cispo":
            stats["cispo_clip_ratio"] = mean(((coef_1 > self.epsilon_high) & (advantages > 0)).to(mask.dtype))
        elif self.loss_type == "vespo":
            stats["vespo/phi_seq_mean"] = mean(phi)
        return stats
