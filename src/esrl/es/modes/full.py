"""`full`: Gaussian noise on whole tensors, member by member, weights perturbed in place (the paper's algorithm)."""

from __future__ import annotations

from esrl.es.modes.base import NoiseMode


class FullMode(NoiseMode):
    """Every default of NoiseMode: eps ~ N(0, I) on each selected tensor, one member at a time."""

    name = "full"
