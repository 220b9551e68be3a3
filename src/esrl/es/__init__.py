"""Evolution strategies: plain-torch math (noise, modes, shaping, update) and the Lightning glue."""

from esrl.es.modes import MODES, NoiseMode, get_mode
from esrl.es.modes.lowrank import PopulationPerturbation, lowrank_selection
from esrl.es.noise import (Member, NoiseSpec, lowrank_direction, lowrank_factors, member_seed, population,
                           tensor_noise)
from esrl.es.params import ParamSelection, select_params
from esrl.es.population_hooks import member_chunks
from esrl.es.shaping import shape_fitness
from esrl.es.update import Perturber, es_gradient, es_step, set_es_grads, weights_checksum

__all__ = ["MODES", "Member", "NoiseMode", "NoiseSpec", "ParamSelection", "Perturber", "PopulationPerturbation",
           "es_gradient", "es_step", "get_mode", "lowrank_direction", "lowrank_factors", "lowrank_selection",
           "member_chunks", "member_seed", "population", "select_params", "set_es_grads", "shape_fitness",
           "tensor_noise", "weights_checksum"]
