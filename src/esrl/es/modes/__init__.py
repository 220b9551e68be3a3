"""The noise mode registry: a mode is one file under esrl.es.modes plus one line here.

To add a mode: subclass esrl.es.modes.base.NoiseMode in a new file (its selection, direction, gradient,
population hooks and, for engines with their own weights, member adapters; all numbers from esrl.es.noise),
then add `"name": YourMode` to MODES. `model.es.mode: name` then selects it; nothing else changes.
"""

from __future__ import annotations

from esrl.es.modes.base import NoiseMode
from esrl.es.modes.full import FullMode
from esrl.es.modes.lora import LoraMode
from esrl.es.modes.lowrank import LowRankMode

MODES: dict[str, type[NoiseMode]] = {
    "full": FullMode,
    "lowrank": LowRankMode,
    "lora": LoraMode,
}


def get_mode(name: str) -> NoiseMode:
    """The mode registered as `name` (ValueError naming the known modes otherwise)."""
    if name not in MODES:
        raise ValueError(f"unknown ES noise mode {name!r}; choose one of {', '.join(MODES)}")
    return MODES[name]()


__all__ = ["MODES", "NoiseMode", "get_mode"]
