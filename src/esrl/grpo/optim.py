"""GRPO's default optimizer and LR schedule, as TRL 1.16's: plain torch, no Lightning."""

from __future__ import annotations

import math
from typing import Iterable

import torch

from esrl.errors import ConfigError
from esrl.grpo.config import GRPOConfig


def default_adamw(named_params: Iterable[tuple[str, torch.nn.Parameter]], cfg: GRPOConfig) -> torch.optim.AdamW:
    """AdamW as TRL's: weight decay on matrices only, none on 1-D tensors (biases and norms)."""
    params = [p for _, p in named_params]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.learning_rate,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)


def default_schedule(optimizer: torch.optim.Optimizer, cfg: GRPOConfig,
                     total_steps: float) -> torch.optim.lr_scheduler.LambdaLR | None:
    """transformers' schedule of cfg.lr_scheduler's name, per optimizer step: linear warmup, then linear decay to 0
    (get_linear_schedule_with_warmup) or constant (get_constant_schedule_with_warmup); None when the lr never
    changes (`constant`) or the run has no known length."""
    if not math.isfinite(total_steps) or cfg.lr_scheduler == "constant":
        return None
    total = max(1, int(total_steps))
    warmup = math.ceil(cfg.warmup_ratio * total)
    linear = cfg.lr_scheduler == "linear"

    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup)) if linear else 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def built(flag: str, factory, *args):
    """A command line's optimizer or schedule, built: the arguments torch refuses (a negative lr) are one line
    naming the flag."""
    try:
        return factory(*args)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{flag}: {e}") from None
