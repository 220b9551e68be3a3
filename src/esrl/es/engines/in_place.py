"""ES on an engine that generates with the policy module itself (HF): members live in the policy's weights.

A member of a sequential mode perturbs the policy's tensors in place and is restored from a backup (bit-exact);
a chunk of a batched mode runs as the mode's forward hooks on the policy, one row per (member, prompt). On an
engine with static shapes (compiled decoding) the hooks are the mode's StaticPopulation, installed at the first
chunk and kept for the run, so every compiled graph carries them (esrl.es.static_population).
"""

from __future__ import annotations

from typing import Sequence

import torch

from esrl.es.modes.base import NoiseMode
from esrl.es.noise import Member, NoiseSpec
from esrl.es.params import ParamSelection
from esrl.es.update import Perturber
from esrl.rollout import RolloutEngine, RowWeights


class InPlaceES:
    def __init__(self, engine: RolloutEngine, policy: torch.nn.Module, selection: ParamSelection, spec: NoiseSpec,
                 mode: NoiseMode):
        self.engine, self.policy, self.selection, self.spec, self.mode = engine, policy, selection, spec, mode
        self.perturber = Perturber(selection, spec)
        self.static = None  # the mode's StaticPopulation, once the engine decodes compiled

    def perturb(self, member: Member) -> None:
        self.perturber.perturb(member)

    def restore(self) -> None:
        self.perturber.restore()

    @property
    def is_perturbed(self) -> bool:
        return self.perturber.is_perturbed

    def free(self) -> None:
        """Drop the perturbation backup before the update allocates its gradients."""
        self.perturber.free()

    def row_weights(self, members: Sequence[Member]) -> RowWeights:
        if self.engine.capabilities.static_shapes:
            if self.static is None:
                self.static = self.mode.static_population(self.policy, self.selection, self.spec)
            self.static.load(members)
            return self.static.population
        return lambda row_member: self.mode.population(self.policy, self.selection, self.spec, members, row_member)

    def after_update(self) -> None:
        """Nothing to do: the engine generates with the updated policy itself."""

    def sync(self) -> None:
        """Nothing to do: the engine generates with the (restored) policy itself."""
