"""One config describes both algorithms; `algo` picks which module trains."""

from __future__ import annotations

from typing import Literal

from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from esrl.errors import ConfigError
from esrl.es.config import ESConfig
from esrl.grpo.config import GRPOConfig
from esrl.policy import PolicyConfig, PolicyModule
from esrl.rollout import RolloutConfig


def build_module(algo: Literal["es", "grpo"] = "es", policy: PolicyConfig | None = None,
                 rollout: RolloutConfig | None = None, es: ESConfig | None = None,
                 grpo: GRPOConfig | None = None, optimizer: OptimizerCallable | None = None,
                 lr_scheduler: LRSchedulerCallable | None = None) -> PolicyModule:
    """The LightningModule for `algo`, with the shared policy and rollout settings.

    Args:
        algo: es or grpo (set it with the top-level `--algo`).
        policy: the model being trained.
        rollout: generation settings shared by both algorithms and by evaluation.
        es: ES hyperparameters (used when algo is es).
        grpo: GRPO hyperparameters (used when algo is grpo).
        optimizer: GRPO's optimizer instead of the default AdamW (set it with the top-level `--optimizer`).
        lr_scheduler: GRPO's LR schedule instead of the default (set it with the top-level `--lr_scheduler`).
    """
    if algo == "es" and (optimizer is not None or lr_scheduler is not None):
        flag = "--optimizer" if optimizer is not None else "--lr_scheduler"
        raise ConfigError(f"{flag}: applies to --algo grpo; ES steps with model.es.optimizer at lr model.es.alpha")
    if algo == "es":
        from esrl.es.module import ESModule

        return ESModule(policy=policy, rollout=rollout, es=es)
    if algo == "grpo":
        from esrl.grpo.module import GRPOModule

        return GRPOModule(policy=policy, rollout=rollout, grpo=grpo, optimizer=optimizer, lr_scheduler=lr_scheduler)
    raise ValueError(f"algo {algo!r}: choose es or grpo")
