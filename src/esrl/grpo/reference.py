"""The frozen reference policy of GRPO's KL term, held outside the LightningModule's module tree."""

from __future__ import annotations

import torch
from torch import nn

from esrl.models.loading import like_policy


class FrozenReference:
    """The base policy, frozen, for the reference log-probs of the KL penalty (beta > 0).

    A plain holder on purpose: an `nn.Module` assigned to a LightningModule attribute becomes its child, so the
    reference would be saved in every checkpoint, counted in the model summary, and wrapped, moved or sharded by
    the strategy (DDP, FSDP, DeepSpeed ZeRO) as if it trained. Held here it is none of those: GRPOModule loads it
    from the base weights at fit start and moves it to the policy's device and dtype itself (a whole copy on each
    rank, also under ZeRO-3).
    """

    def __init__(self, model: nn.Module):
        self.model = model.eval().requires_grad_(False)

    def to(self, policy: nn.Module, device: torch.device) -> FrozenReference:
        """On `device`, in the precision the policy runs in (esrl.models.loading.like_policy)."""
        like_policy(self.model, policy, device)
        return self
