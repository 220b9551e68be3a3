"""ES on an engine that generates with the policy module itself (HF): members live in the policy's weights.

A member of a sequential mode perturbs the policy's tensors in place and is restored from a backup (bit-exact);
a chunk of a batched mode runs as the mode's forward hooks on the policy, one row per (member, prompt). On an
engine with static shapes (compiled decoding) the hooks are the mode's StaticPopulation, installed at the first
chunk and kept for the run, so every compiled graph carries them (esrl.es.static_population); modes whose static
population is also the faster eager one (lora) use it on every engine.
"""

from __future__ import annotations

from typing import Sequence

from esrl.es.engines.base import ESBackend
from esrl.es.noise import Member
from esrl.rollout import RowWeights


class InPlaceES(ESBackend):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.static = None  # the mode's StaticPopulation, once the engine decodes compiled

    def close(self) -> None:
        if self.static is not None:
            self.static.remove()
            self.static = None

    def row_weights(self, members: Sequence[Member]) -> RowWeights:
        if self.engine.capabilities.static_shapes or self.mode.static_population_eager:
            if self.static is None:
                self.static = self.mode.static_population(self.policy, self.selection, self.spec)
            self.static.load(members)
            return self.static.population
        return lambda row_member: self.mode.population(self.policy, self.selection, self.spec, members, row_member)
