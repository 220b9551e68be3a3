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

from esrl.es.modes.base import NoiseMode
from esrl.es.noise import Member, NoiseSpec
from esrl.es.params import ParamSelection
from esrl.es.update import Perturber
from esrl.rollout import RolloutEngine, RowWeights


class SeparateES:
    def __init__(self, engine: RolloutEngine, policy: torch.nn.Module, selection: ParamSelection, spec: NoiseSpec,
                 mode: NoiseMode):
        if mode.batched and not engine.capabilities.row_adapters:
            raise RuntimeError(f"esrl: ES mode {mode.name} needs an engine built with row adapters")
        self.engine, self.policy, self.selection, self.spec, self.mode = engine, policy, selection, spec, mode
        self.perturber = Perturber(selection, spec)
        if mode.policy_adapter(policy) is not None:
            self.sync()

    def _push(self) -> None:
        self.engine.load_weights(list(zip(self.selection.names, self.selection.params)))

    def perturb(self, member: Member) -> None:
        self.perturber.perturb(member)
        self._push()

    def restore(self) -> None:
        self.perturber.restore()
        self._push()

    @property
    def is_perturbed(self) -> bool:
        return self.perturber.is_perturbed

    def free(self) -> None:
        self.perturber.free()

    def row_weights(self, members: Sequence[Member]) -> RowWeights:
        @contextmanager
        def member_adapters(row_member: torch.Tensor) -> Iterator[list[int]]:
            ids = self.engine.add_adapters(self.mode.member_adapters(self.policy, self.selection, self.spec, members))
            try:
                yield ids
            finally:
                self.engine.remove_adapters(ids)

        return member_adapters

    def after_update(self) -> None:
        self.sync()

    def sync(self) -> None:
        """Bring the engine to the policy's current weights (after an update, or a checkpoint loaded into it)."""
        adapter = self.mode.policy_adapter(self.policy)
        if adapter is not None:
            self.engine.set_default_adapter(adapter)
        else:
            self._push()
