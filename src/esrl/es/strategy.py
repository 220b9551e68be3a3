"""ESStrategy: DDP's process group and launcher, without DDP's gradient all-reduce.

ES ranks never exchange weights: every rank applies the same update from the all-gathered fitness.
Every rank sees every prompt (all members are scored on the same prompts), so the sampler is not sharded.
The fitness and checksums live on the CPU; NCCL (DDP's backend on GPUs) takes CUDA tensors only ("No backend type
associated with device type cpu"), so the collectives below move them to the rank's device and back.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry


class ESStrategy(DDPStrategy):
    strategy_name = "es"

    def configure_ddp(self) -> None:
        pass  # no DistributedDataParallel wrapper: ES has no gradients to reduce

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    def sum_across_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """Exact sum (each entry has one non-zero contributor when gathering member fitness)."""
        if self.world_size == 1:
            return tensor
        out = tensor.to(self.root_device, copy=True)
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM)
        return out.to(tensor.device)

    def gather_all(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        return self.all_gather(tensor.to(self.root_device)).to(tensor.device)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Evolution strategies over DDP processes",
                                   start_method="popen")


if ESStrategy.strategy_name not in StrategyRegistry:
    ESStrategy.register_strategies(StrategyRegistry)
