"""ESBackend: how ES reaches an engine's weights, whatever the engine (the interface ESModule uses).

The HF policy always takes a member's perturbation in place (Perturber, restored bit-exactly from a backup);
subclasses say how the engine sees it (`_weights_changed`) and how a chunk of a batched mode runs (`row_weights`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from esrl.es.modes.base import NoiseMode
from esrl.es.noise import Member, NoiseSpec
from esrl.es.params import ParamSelection
from esrl.es.update import Perturber
from esrl.rollout import RolloutEngine, RowWeights


class ESBackend:
    def __init__(self, engine: RolloutEngine, policy: torch.nn.Module, selection: ParamSelection, spec: NoiseSpec,
                 mode: NoiseMode):
        self.engine, self.policy, self.selection, self.spec, self.mode = engine, policy, selection, spec, mode
        self.perturber = Perturber(selection, spec)

    def perturb(self, member: Member) -> None:
        self.perturber.perturb(member)
        self._weights_changed()

    def restore(self) -> None:
        self.perturber.restore()
        self._weights_changed()

    @property
    def is_perturbed(self) -> bool:
        return self.perturber.is_perturbed

    def free(self) -> None:
        """Drop the perturbation backup before the update allocates its gradients."""
        self.perturber.free()

    def close(self) -> None:
        """The fit is over: what the backend installed on the policy (a static population's hooks) comes off."""

    def row_weights(self, members: Sequence[Member]) -> RowWeights:
        """A chunk's per-row weights for one `generate_population`."""
        raise NotImplementedError

    def after_update(self) -> None:
        """The engine sees the updated policy."""
        self._weights_changed()

    def sync(self) -> None:
        """The engine sees the policy's current weights (after a checkpoint was loaded into it)."""
        self._weights_changed()

    def _weights_changed(self) -> None:
        """The policy's weights changed in place: bring the engine along (nothing when it generates with them)."""
