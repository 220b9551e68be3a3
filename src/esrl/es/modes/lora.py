"""`lora`: ES over the parameters of a PEFT LoRA adapter, and its population-batched generation.

The policy is wrapped in a LoRA adapter (PEFT): every targeted nn.Linear computes
y = x W^T + (alpha_lora / r) (x A^T) B^T with A (r x in) and B (out x r). ES perturbs and updates only the
adapter's A and B with full Gaussian noise, exactly as `full` mode does on whole tensors (same seeds, same
tensor_noise, same gradient and optimizer code): the ES search runs in adapter space, r (in + out) numbers
per adapted layer instead of in x out.

The adapter itself (wrapping, seeded initialization, the final save) is esrl.models.lora's, shared with GRPO's
`model.grpo.lora`; here its options come from ESConfig (lora_rank, lora_alpha, lora_target_modules, layers,
lora_init) and its seed from the run's noise seed, so every process (and `esrl export`) builds the identical
adapter. B starts at 0 (the identity adapter); with B = 0 the first iterations move B only to first
order (the perturbation of the product is s (eps_B A + B eps_A) + s^2 eps_B eps_A), as LoRA's gradient does.

Population batching: lora_A and lora_B are plain nn.Linear modules inside PEFT's LoRA layers. For a chunk of
M members each gets the stacked perturbed weights (M, r, in) / (M, out, r), A + s sign_i eps_i, and a forward
hook replaces the module's output by each row's own x A_i^T (then t B_i^T) through one bmm, so PEFT's own
forward (dtype casts, scaling, base layer) runs unchanged around the per-row factors. Rows are member-major
(all rows of member 0, then member 1, ...): x is then viewed as (M, rows_per_member * seq, in) with no
gather; any other row -> member map gathers per row. No weight is copied into the model or modified; hooks
are removed however the block exits. Memory: M x r (in + out) numbers per adapted layer while the block runs.

On an engine with its own weights (vLLM) the engine keeps the base weights; the policy's adapter rides on every
plain generate (`policy_adapter`) and each member is its perturbed copy of that adapter (`member_adapters`).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import torch

from esrl.errors import ConfigError, require
from esrl.es.modes.base import Adapter, NoiseMode
from esrl.es.noise import (gaussian_gradient, gaussian_gradients, gaussian_groups, gaussian_stack, generator_on,
                           member_weights, noise_groups, tensor_scale)
from esrl.es.params import ParamSelection, linear_weight_only, param_owners
from esrl.es.population_hooks import PopulationHooks
from esrl.es.static_population import StaticPopulation
from esrl.models import lora as shared
from esrl.models.lora import LoraFields, LoraOptions, init_adapter, peft_lora_modules, policy_adapter
from esrl.rollout.base import AdapterSpec

__all__ = ["ES_FIELDS", "LoraMode", "LoraPopulation", "StaticLora", "init_adapter", "lora_adapters", "lora_options",
           "lora_selection", "peft_lora_modules", "save_final", "wrap_lora", "write_member_adapters"]

_ADAPTER = re.compile(r"\.lora_[AB]\.")

ES_FIELDS = LoraFields(switch="model.es.mode: lora", rank="model.es.lora_rank", alpha="model.es.lora_alpha",
                       target_modules="model.es.lora_target_modules", layers="model.es.layers",
                       init="model.es.lora_init")


class LoraMode(NoiseMode):
    name = "lora"
    batched = True
    static_population_eager = True  # one adapter term per linear, PEFT's off: fewer ops (RESULTS, session 7)

    def validate(self, cfg) -> None:
        shared.validate_options(lora_options(cfg), ES_FIELDS)
        require(cfg.sigma_scaling == "global", "model.es.sigma_scaling",
                "lora mode needs global (the adapter's B starts at 0: sigma * RMS(B) = 0 would never perturb it)")

    def wrap_policy(self, model, cfg, seed) -> torch.nn.Module:
        return wrap_lora(model, cfg, seed)

    def select(self, model, selection, cfg) -> ParamSelection:
        try:
            return lora_selection(selection, cfg.include)
        except ValueError as e:
            raise ConfigError(f"model.es.include: {e}") from None

    def gradient(self, coef, n, tensor_index, p, spec, generator=None) -> torch.Tensor:
        # the adapter's noise is small (r (in + out) per layer): the update reuses the load's draws (drawn_once)
        return gaussian_gradient(coef, n, tensor_index, p.shape, p.device, generator, reuse=True)

    def gradients(self, coef, n, selection, spec):
        """One product per group of same-shape adapter tensors (esrl.es.noise.gaussian_gradients)."""
        for group in noise_groups(selection):
            p = group.params[0]
            yield group.params, gaussian_gradients(coef, n, group.indices, p.shape, p.device)

    def population(self, model, selection, spec, members, row_member) -> PopulationHooks:
        return LoraPopulation(model, selection, spec, members, row_member)

    def static_population(self, model, selection, spec) -> StaticPopulation:
        return StaticLora(model, selection, spec)

    def adapter_spec(self, cfg, model) -> AdapterSpec:
        return AdapterSpec(int(cfg.lora_rank), tuple(m.rsplit(".", 1)[-1] for m in cfg.lora_target_modules),
                           "model.es.lora_rank")

    def policy_adapter(self, model) -> Adapter:
        return policy_adapter(model)

    def member_adapters(self, model, selection, spec, members) -> list[Adapter]:
        return lora_adapters(model, selection, spec, members)

    def save_final(self, policy, tokenizer, out) -> Path:
        return save_final(policy, tokenizer, out)


def lora_options(cfg) -> LoraOptions:
    """The adapter options of an ESConfig (lora_rank, lora_alpha, lora_target_modules, layers, lora_init)."""
    return LoraOptions(rank=cfg.lora_rank, alpha=cfg.lora_alpha, target_modules=list(cfg.lora_target_modules),
                       layers=cfg.layers, init=cfg.lora_init)


def wrap_lora(model: torch.nn.Module, cfg, seed: int) -> torch.nn.Module:
    """The model wrapped in a fresh LoRA adapter (a peft PeftModel) with an ESConfig's options, initialized from
    `seed` (esrl.models.lora.wrap_lora: the adapter is injected into `model` in place)."""
    return shared.wrap_lora(model, lora_options(cfg), seed, ES_FIELDS)


def lora_selection(selection: ParamSelection, include: Sequence[str] = ()) -> ParamSelection:
    """The adapter's lora_A / lora_B weights out of `selection` (base weights are never perturbed in lora mode).

    Raises ValueError when none is left, or when an explicit include pattern names only base weights.
    """
    out = ParamSelection([], [], [])
    for j, name, p in selection:
        if _ADAPTER.search(name):
            out.indices.append(j)
            out.names.append(name)
            out.params.append(p)
    inc = [re.compile(x) for x in include]
    dead = [x.pattern for x in inc if not any(x.search(n) for n in out.names)]
    if dead:
        raise ValueError(f"lora mode perturbs only the adapter's lora_A / lora_B weights; {', '.join(dead)} "
                         "matches none of them")
    if not out.params:
        raise ValueError("lora mode: the parameter filter selects no lora_A / lora_B weight")
    return out


class LoraPopulation(PopulationHooks):
    """Forward hooks giving every batch row its member's perturbed adapter during one batched generate.

    The same interface as esrl.es.modes.lowrank.PopulationPerturbation (esrl.es.population_hooks). Every selected
    tensor must be the weight of an nn.Linear (PEFT's lora_A / lora_B are).
    """

    mode = "lora"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.member_weights: dict[str, torch.Tensor] = {}
        """While entered: parameter name -> (M, out, in) stacked member weights the hooks multiply with."""

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.member_weights = {}

    @torch.no_grad()
    def _install(self) -> None:
        owners = param_owners(self.model)
        generator: torch.Generator | None = None
        for j, name, p in self.selection:
            holders = owners[id(p)]
            if not linear_weight_only(holders):
                raise ValueError(f"lora population batching perturbs nn.Linear weights only, not {name}")
            generator = generator_on(p.device, generator)
            weights = _member_weights(self.members, j, p, self.spec, generator)  # (M, out, in)
            self.member_weights[name] = weights
            for module, _ in holders:
                self._handles.append(module.register_forward_hook(self._hook(weights)))

    def _hook(self, weights: torch.Tensor):
        m = weights.shape[0]

        def hook(module, args, out):
            x = args[0]
            idx = self._rows(x)
            if self.per_member:  # (M, rows/M * seq, in) @ (M, in, out)
                y = torch.bmm(x.reshape(m, -1, x.shape[-1]), weights.transpose(1, 2))
            else:
                y = torch.bmm(x.reshape(x.shape[0], -1, x.shape[-1]), weights[idx].transpose(1, 2))
            y = y.view(out.shape)
            return y if module.bias is None else y + module.bias

        return hook


def _member_weights(members, j: int, p: torch.Tensor, spec, generator) -> torch.Tensor:
    """(M, *p.shape): each member's perturbed copy of tensor p, exactly as the in-place perturbation writes it."""
    eps = gaussian_stack([m.seed for m in members], j, p.shape, p.device, generator)
    return member_weights(p, eps, [m.sign for m in members], tensor_scale(p, spec))


@torch.no_grad()
def lora_adapters(model: torch.nn.Module, selection: ParamSelection | None = None, spec=None,
                  members: Sequence = ()) -> list[Adapter]:
    """Adapters (lora_A, scaling * lora_B) of a PEFT policy: its current adapter when `members` is empty, else one
    per member with the selected lora_A / lora_B tensors perturbed exactly as LoraPopulation perturbs them.
    Engines such as vLLM fold the scaling into lora_B the same way (LoRALayerWeights.optimize); PEFT multiplies
    after lora_B instead, which is the same number when the scaling is a power of two (the default
    lora_alpha = 2 r) and may differ in the last bit else."""
    if not members:
        return [policy_adapter(model)]
    slots = AdapterSlots(model, selection, len(members))
    write_member_adapters(model, selection, spec, members, slots)
    return [{name: (a[i], b[i]) for name, (a, b) in slots.modules.items()} for i in range(len(members))]


class AdapterSlots:
    """Buffers for M members' adapters, per PEFT module: lora_A (M, r, in) and scaling * lora_B (M, out, r), or its
    transpose (M, r, out) with `b_transposed` (the layout esrl.es.lowrank_kernel reads). The selected tensors of one
    shape and factor are slices of one (G, M, ...) tensor, so write_member_adapters writes a group with a few launches,
    not each tensor (a 1.5B model: 392 adapter tensors, 5 groups). `dtype`: the buffers' dtype (default: the
    adapters', fp32 under PEFT's autocast); a member tensor is computed in the adapters' dtype and rounded to it once
    (lora_B's scaling, applied after, rounds again unless it is a power of two, as the default lora_alpha = 2 r)."""

    def __init__(self, model: torch.nn.Module, selection: ParamSelection, members: int, b_transposed: bool = False,
                 dtype: torch.dtype | None = None):
        self.peft = peft_lora_modules(model)  # name -> (lora_A, lora_B, scaling)
        where = {}
        for name, (a, b, _) in self.peft.items():
            where[id(a)], where[id(b)] = (name, 0), (name, 1)
        stored: dict[tuple[str, int], torch.Tensor] = {}
        self.groups: list[tuple[ParamSelection, list[str], torch.Tensor, torch.Tensor]] = []
        """(selected tensors, their modules, storage (G, M, stored shape), its view (M, G, tensor shape))"""
        for same_shape in noise_groups(selection):
            for kind in (0, 1):  # lora_A and lora_B tensors of one shape stay apart (their layouts differ)
                group, modules = ParamSelection([], [], []), []
                for j, pname, p in same_shape:
                    if id(p) not in where:
                        raise RuntimeError(f"esrl: {pname} is not a lora_A / lora_B weight of a PEFT LoRA layer")
                    if where[id(p)][1] == kind:
                        group.indices.append(j)
                        group.names.append(pname)
                        group.params.append(p)
                        modules.append(where[id(p)][0])
                if not group.params:
                    continue
                flip = kind == 1 and b_transposed
                p = group.params[0]
                storage = p.new_empty(len(group), members, *(p.shape[::-1] if flip else p.shape), dtype=dtype)
                for g, module in enumerate(modules):
                    stored[module, kind] = storage[g]
                view = storage.permute(1, 0, 3, 2) if flip else storage.transpose(0, 1)
                self.groups.append((group, modules, storage, view))
        self.copied = []  # (name, kind, tensor, its slots (M, *tensor.shape)): the factors not perturbed
        for name, (a, b, _) in self.peft.items():
            for kind, factor in enumerate((a, b)):
                if (name, kind) not in stored:
                    flip = kind == 1 and b_transposed
                    stored[name, kind] = factor.new_empty(members, *(factor.shape[::-1] if flip else factor.shape),
                                                          dtype=dtype)
                    self.copied.append((name, kind, factor, stored[name, kind].transpose(1, 2) if flip else
                                        stored[name, kind]))
        self.modules = {name: (stored[name, 0], stored[name, 1]) for name in self.peft}
        """name -> (lora_A slots, scaling * lora_B slots) in the stored layout"""


@torch.no_grad()
def write_member_adapters(model: torch.nn.Module, selection: ParamSelection, spec, members: Sequence,
                          slots: AdapterSlots) -> None:
    """Write each member's adapter into `slots` (made for this model, selection and number of members): the selected
    tensors perturbed by member_weights straight into their group's slots, the others copied, then lora_B scaled.
    The one definition of a member's adapter tensors."""
    if spec.sigma_scaling != "global":
        raise ValueError("lora members need sigma_scaling: global")
    seeds, signs = [m.seed for m in members], [m.sign for m in members]
    for group, _, _, view in slots.groups:
        p = group.params[0]
        eps = gaussian_groups(seeds, group.indices, p.shape, p.device)  # (M, G, *shape)
        stacked = torch.stack(group.params) if len(group) > 1 else p.unsqueeze(0)
        member_weights(stacked, eps, signs, tensor_scale(p, spec), out=view)
    for _, _, factor, target in slots.copied:
        target.copy_(factor)
    scaled = set()
    for group, modules, storage, _ in slots.groups:  # a group of lora_B tensors sharing one scaling: one launch
        scalings = {slots.peft[name][2] for name in modules}
        if group.params[0] is slots.peft[modules[0]][1] and len(scalings) == 1:
            if (scaling := scalings.pop()) != 1.0:
                storage.mul_(scaling)
            scaled.update(modules)
    for name, (_, b, scaling) in slots.peft.items():
        if name not in scaled and scaling != 1.0:
            slots.modules[name][1].mul_(scaling)


class StaticLora(StaticPopulation):
    """lora for compiled decoding: PEFT's own adapter path is switched off (its layers' enable_adapters) and a hook on
    each LoRA layer's base Linear adds the row's member adapter, (x A_i^T) (scaling B_i)^T, from persistent buffers
    (A_i (M, r, in), scaling B_i^T (M, r, out)): one esrl.es.lowrank_kernel launch per adapted linear on a GPU,
    instead of PEFT's adapter GEMMs plus per-member ones that replaced their outputs. The buffers hold the base
    weights' dtype, as lowrank's factors do: the kernel re-reads a member's factors for each of its rows (from L2), so
    lora's fp32 adapters doubled its traffic; the kernel still sums in fp32 and rounds the output once."""

    def _layers(self) -> list[tuple[str, torch.nn.Module]]:
        from peft.tuners.lora import LoraLayer

        return [(name.removeprefix("base_model.model."), module) for name, module in self.model.named_modules()
                if isinstance(module, LoraLayer) and "default" in module.lora_A]

    def _targets(self):
        return [(name, layer.base_layer) for name, layer in self._layers()]

    def _fill(self, members):
        dtypes = {layer.base_layer.weight.dtype for _, layer in self._layers()}  # one float dtype, else the adapters'
        dtype = dtypes.pop() if len(dtypes) == 1 else None
        slots = AdapterSlots(self.model, self.selection, len(members), b_transposed=True,
                             dtype=dtype if dtype is not None and dtype.is_floating_point else None)
        self._storage[len(members)] = slots
        write_member_adapters(self.model, self.selection, self.spec, members, slots)
        return {name: (b_t, a) for name, (a, b_t) in slots.modules.items()}

    def _refill(self, buffers, members):
        """The members' adapters written in place, a group of same-shape tensors at a time."""
        write_member_adapters(self.model, self.selection, self.spec, members, self._storage[len(members)])

    @contextmanager
    def _decoding(self) -> Iterator[None]:
        switched = [layer for _, layer in self._layers() if not layer.disable_adapters]
        for layer in switched:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in switched:
                layer.enable_adapters(True)


def save_final(policy: torch.nn.Module, tokenizer, out: str | Path) -> Path:
    """final/: the merged model, and the adapter in PEFT format under final/adapter/ (esrl.models.lora)."""
    return shared.save_final(policy, tokenizer, out)
