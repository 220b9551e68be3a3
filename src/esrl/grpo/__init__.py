"""GRPO: plain-torch math (advantages, clipped loss) that matches TRL 1.16, and the glue on top.

The per-token log-probs it trains on are shared with evaluation: esrl.models.logps.
"""

from esrl.grpo.advantages import group_advantages, nanstd
from esrl.grpo.config import GRPOConfig
from esrl.grpo.loss import LOSS_TYPES, GRPOLoss

__all__ = ["LOSS_TYPES", "GRPOConfig", "GRPOLoss", "group_advantages", "nanstd"]
