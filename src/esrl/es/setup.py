"""What ES trains and how it steps, shared by training and seed-log replay so both are identical."""

from __future__ import annotations

import torch

from esrl.errors import ConfigError
from esrl.es.config import ESConfig
from esrl.es.lowrank import NoiseSpec, PopulationPerturbation, lowrank_selection
from esrl.es.noise import Member
from esrl.es.params import ParamSelection, select_params


def build_policy(model: torch.nn.Module, cfg: ESConfig, seed: int) -> torch.nn.Module:
    """The model ES trains: `model` itself, or in lora mode `model` wrapped in a LoRA adapter built from `seed`."""
    if cfg.mode != "lora":
        return model
    from esrl.es.lora import wrap_lora

    return wrap_lora(model, cfg, seed)


def build_selection(model: torch.nn.Module, cfg: ESConfig) -> tuple[ParamSelection, NoiseSpec]:
    """The perturbed tensors (with requires_grad set accordingly) and the noise spec."""
    spec = NoiseSpec.from_config(cfg)
    selection = select_params(model, cfg.include, cfg.exclude, cfg.layers)
    if cfg.mode == "lowrank":
        try:
            selection = lowrank_selection(model, selection, spec, cfg.include)
        except ValueError as e:
            raise ConfigError(f"model.es.include: {e}") from None
    elif cfg.mode == "lora":
        from esrl.es.lora import lora_selection

        try:
            selection = lora_selection(selection, cfg.include)
        except ValueError as e:
            raise ConfigError(f"model.es.include: {e}") from None
    for p in model.parameters():
        p.requires_grad_(False)
    for p in selection.params:
        p.requires_grad_(True)
    return selection, spec


def build_optimizer(params: list[torch.nn.Parameter], cfg: ESConfig) -> torch.optim.Optimizer:
    """SGD with lr=alpha on the gradient -g is the paper's update theta += alpha * g."""
    if cfg.optimizer == "adam":
        return torch.optim.AdamW(params, lr=cfg.alpha, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.alpha, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def population_perturbation(model: torch.nn.Module, selection: ParamSelection, spec: NoiseSpec,
                            members: list[Member], row_member: torch.Tensor):
    """The context giving every row of one batched generate its member's perturbation (lowrank or lora)."""
    if spec.mode == "lora":
        from esrl.es.lora import LoraPopulation

        return LoraPopulation(model, selection, spec, members, row_member)
    return PopulationPerturbation(model, selection, spec, members, row_member)
