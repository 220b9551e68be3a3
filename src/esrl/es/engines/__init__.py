"""ES on a rollout engine (esrl.es.engines.base.ESBackend), chosen by the engine's declared capabilities, never
by its type: `perturb` / `restore` / `free` / `is_perturbed` (a member in place), `row_weights(members)` (a chunk's
per-row weights for one `generate_population`), `after_update()` and `sync()` (the engine sees the policy).
"""

from __future__ import annotations

from esrl.es.engines.base import ESBackend
from esrl.es.engines.in_place import InPlaceES
from esrl.es.engines.separate import SeparateES
from esrl.es.modes.base import NoiseMode
from esrl.es.noise import NoiseSpec
from esrl.es.params import ParamSelection
from esrl.rollout import RolloutEngine


def es_backend(engine: RolloutEngine, policy, selection: ParamSelection, spec: NoiseSpec,
               mode: NoiseMode) -> ESBackend:
    """InPlaceES when the engine generates with the policy module itself, else SeparateES."""
    cls = InPlaceES if engine.capabilities.shares_policy_weights else SeparateES
    return cls(engine, policy, selection, spec, mode)


__all__ = ["ESBackend", "InPlaceES", "SeparateES", "es_backend"]
