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


def optimizers(named_params: list[tuple[str, torch.nn.Parameter]], cfg: GRPOConfig, optimizer_factory=None,
               lr_scheduler_factory=None, total_steps: int | float = 1) -> dict | torch.optim.Optimizer:
    """GRPO's optimizer and schedule, as Lightning's configure_optimizers returns them: TRL's AdamW and LR schedule,
    or LightningCLI's `--optimizer` / `--lr_scheduler` (callables) built over the trainable parameters configure_model
    created; `--optimizer` without `--lr_scheduler` keeps its lr, as in LightningCLI. A schedule steps after every
    optimizer step, as TRL's does (LightningCLI's own would step once an epoch, and an epoch here is one pass over the
    prompts, however many steps the run takes)."""
    if optimizer_factory is None:
        optimizer = default_adamw(named_params, cfg)
    else:
        optimizer = built("--optimizer", optimizer_factory, [p for _, p in named_params])
    if lr_scheduler_factory is not None:
        scheduler = built("--lr_scheduler", lr_scheduler_factory, optimizer)
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):  # Lightning wants a monitor
            raise ConfigError("--lr_scheduler ReduceLROnPlateau: steps on a monitored metric, which esrl does "
                              "not name for it; use a schedule by step (StepLR, CosineAnnealingLR, ...)")
    else:
        scheduler = None if optimizer_factory is not None else default_schedule(optimizer, cfg, total_steps)
    if scheduler is None:
        return optimizer
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
