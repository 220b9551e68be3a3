"""What ES trains and how it steps, shared by training and seed-log replay so both are identical."""

from __future__ import annotations

import torch

from esrl.es.config import ESConfig
from esrl.es.modes import get_mode
from esrl.es.noise import NoiseSpec
from esrl.es.params import ParamSelection, select_params


def build_policy(model: torch.nn.Module, cfg: ESConfig, seed: int) -> torch.nn.Module:
    """The model ES trains: `model` itself, or what the mode wraps it in (lora: a LoRA adapter built from `seed`)."""
    return get_mode(cfg.mode).wrap_policy(model, cfg, seed)


def build_selection(model: torch.nn.Module, cfg: ESConfig) -> tuple[ParamSelection, NoiseSpec]:
    """The perturbed tensors (with requires_grad set accordingly) and the noise spec."""
    spec = NoiseSpec.from_config(cfg)
    selection = get_mode(cfg.mode).select(model, select_params(model, cfg.include, cfg.exclude, cfg.layers), cfg)
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
