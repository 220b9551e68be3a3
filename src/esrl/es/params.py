"""Which tensors ES perturbs: all, regex include/exclude, and ranges of transformer layers."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch

from esrl.errors import ConfigError
from esrl.models.layers import LAYER, check_layers_exist, parse_layer_ranges

__all__ = ["ParamSelection", "check_filter", "linear_weight_only", "param_owners", "parse_layer_ranges",
           "select_params"]


@dataclass
class ParamSelection:
    """Perturbed tensors with their stable index in `model.named_parameters()` (the noise's tensor index)."""

    indices: list[int]
    names: list[str]
    params: list[torch.nn.Parameter]

    def __iter__(self):
        return iter(zip(self.indices, self.names, self.params))

    def __len__(self) -> int:
        return len(self.params)

    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def same_shape_groups(self, max_numbers: int | None = None) -> list["ParamSelection"]:
        """The selection split into groups of tensors with one shape, dtype and device, in order of first
        appearance, each cut into consecutive parts of at most `max_numbers` numbers (at least one tensor): a 1.5B
        model's 196 projections are 7 shapes, so work done per group (a draw, a scaled write, a batched product) is
        a few launches on a GPU instead of 196."""
        groups: dict[tuple, list[ParamSelection]] = {}
        for j, name, p in self:
            parts = groups.setdefault((tuple(p.shape), p.dtype, p.device), [ParamSelection([], [], [])])
            if parts[-1].params and max_numbers is not None and (len(parts[-1]) + 1) * p.numel() > max_numbers:
                parts.append(ParamSelection([], [], []))
            parts[-1].indices.append(j)
            parts[-1].names.append(name)
            parts[-1].params.append(p)
        return [part for parts in groups.values() for part in parts]


def select_params(model: torch.nn.Module, include: list[str] | None = None, exclude: list[str] | None = None,
                  layers: str | None = None) -> ParamSelection:
    """Filter parameters by name. Indices count all parameters, so a filter never changes other tensors' noise."""
    inc = [re.compile(p) for p in include or []]
    exc = [re.compile(p) for p in exclude or []]
    allowed_layers = parse_layer_ranges(layers)
    check_layers_exist(allowed_layers, model, "model.es.layers", layers)
    sel = ParamSelection([], [], [])
    for j, (name, p) in enumerate(model.named_parameters()):
        if inc and not any(r.search(name) for r in inc):
            continue
        if any(r.search(name) for r in exc):
            continue
        if allowed_layers is not None:
            m = LAYER.search(name)
            if m is None or int(m.group(1)) not in allowed_layers:
                continue
        sel.indices.append(j)
        sel.names.append(name)
        sel.params.append(p)
    if not sel.params:
        raise ConfigError(f"model.es.include / exclude / layers: the filter (include={include}, exclude={exclude}, "
                          f"layers={layers!r}) selects no parameter of {type(model).__name__}")
    return sel


def check_filter(include: list[str] | None, exclude: list[str] | None, layers: str | None) -> None:
    """The filter's patterns and layer ranges, checked when the config is read: one line naming the bad field."""
    for field, patterns in (("model.es.include", include), ("model.es.exclude", exclude)):
        for pattern in patterns or []:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as e:
                raise ConfigError(f"{field}: {pattern!r} is not a regular expression ({e})") from None
    try:
        parse_layer_ranges(layers)
    except ValueError:
        raise ConfigError(f"model.es.layers: expected layer ranges such as '0-5,20', got {layers!r}") from None


def param_owners(model: torch.nn.Module) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """id(param) -> every (module, attribute name) that holds it directly (tied weights have several)."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = defaultdict(list)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            owners[id(p)].append((module, name))
    return owners


def linear_weight_only(holders: list[tuple[torch.nn.Module, str]]) -> bool:
    """True when every holder of a tensor is an nn.Linear holding it as its weight (not an embedding, not tied)."""
    return bool(holders) and all(isinstance(m, torch.nn.Linear) and attr == "weight" for m, attr in holders)
