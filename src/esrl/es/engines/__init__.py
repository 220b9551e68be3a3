"""ES on a rollout engine, chosen by the engine's declared capabilities (never by its type).

Both backends have one interface, used by esrl.es.module.ESModule: `perturb` / `restore` / `free` /
`is_perturbed` (a member in place), `row_weights(members)` (a chunk's per-row weights for one
`generate_population`), `after_update()` (the engine sees the updated policy) and `sync()` (after a resume).
"""

from __future__ import annotations

from esrl.es.engines.in_place import InPlaceES
from esrl.es.engines.separate import SeparateES
from esrl.es.modes.base import NoiseMode
from esrl.es.noise import NoiseSpec
from esrl.es.params import ParamSelection
from esrl.rollout import RolloutEngine


def es_backend(engine: RolloutEngine, policy, selection: ParamSelection, spec: NoiseSpec,
               mode: NoiseMode) -> InPlaceES | SeparateES:
    """InPlaceES when the engine generates with the policy module itself, else SeparateES."""
    cls = InPlaceES if engine.capabilities.shares_policy_weights else SeparateES
    return cls(engine, policy, selection, spec, mode)


__all__ = ["InPlaceES", "SeparateES", "es_backend"]
