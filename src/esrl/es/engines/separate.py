"""ES on an engine that holds its own copy of the weights (vLLM): the HF policy stays the source of truth.

The policy takes every change first (perturbation, restore, update) and the engine receives the result with
`load_weights`, so the engine's weights are always bit-equal to the policy's, whatever the optimizer or sigma
scaling. A chunk of a batched mode runs as one LoRA adapter per member (the mode's `member_adapters`: the same
noise as its hooks), registered for one `generate_population` call and removed after it. Modes whose policy is
an adapter (lora) leave the engine's base weights alone and put the policy's adapter on every plain generate.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from esrl.es.engines.base import ESBackend
from esrl.es.noise import Member
from esrl.rollout import RowWeights


class SeparateES(ESBackend):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.mode.batched and not self.engine.capabilities.row_adapters:
            raise RuntimeError(f"esrl: ES mode {self.mode.name} needs an engine built with row adapters")
        if self.mode.policy_adapter(self.policy) is not None:
            self.sync()

    def row_weights(self, members: Sequence[Member]) -> RowWeights:
        @contextmanager
        def member_adapters(row_member: torch.Tensor) -> Iterator[list[int]]:
            ids = self.engine.add_adapters(self.mode.member_adapters(self.policy, self.selection, self.spec, members))
            try:
                yield ids
            finally:
                self.engine.remove_adapters(ids)

        return member_adapters

    def _weights_changed(self) -> None:
        """Bring the engine to the policy's current weights: its adapter (lora), else the selected tensors."""
        adapter = self.mode.policy_adapter(self.policy)
        if adapter is not None:
            self.engine.set_default_adapter(adapter)
        else:
            self.engine.load_weights(list(zip(self.selection.names, self.selection.params)))
