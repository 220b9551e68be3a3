"""NoiseMode: what an ES noise mode is, as one object; esrl.es.modes.MODES maps each name to its class.

A mode decides which tensors ES perturbs, the direction eps of a member on each of them, the gradient the
update ascends, and how a chunk of members runs in ONE batched generation: as per-row forward hooks on the
policy (engines that generate with the policy module itself) or as one LoRA adapter per member (engines with a
weight copy of their own). Everything numeric comes from esrl.es.noise, so modes differ only in which formula
they apply to which tensor. Plain torch: no Lightning, no engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Iterator, Sequence

import torch

from esrl.es.noise import Member, NoiseSpec, gaussian, gaussian_gradient, generator_on
from esrl.es.params import ParamSelection
from esrl.es.population_hooks import PopulationHooks
from esrl.models.lora import Adapter  # one member as a LoRA adapter: {HF module: (lora_A, scaling * lora_B)}
from esrl.rollout.base import AdapterSpec


class NoiseMode:
    """The defaults are `full`: Gaussian noise on whole tensors, member by member, weights changed in place."""

    name: ClassVar[str]
    batched: ClassVar[bool] = False
    """True: members run in chunks, each chunk one batched generation (`population` / `member_adapters`);
    False: member by member with the weights perturbed in place (`direction`)."""
    static_population_eager: ClassVar[bool] = False
    """True: its `static_population` also beats `population` without compiled decoding (the HF engine uses it
    whenever it generates with the policy itself)."""

    def validate(self, cfg) -> None:
        """Mode-specific checks of an ESConfig (raise esrl.errors.ConfigError naming the field)."""

    def wrap_policy(self, model: torch.nn.Module, cfg, seed: int) -> torch.nn.Module:
        """The model ES trains (lora: `model` wrapped in a seeded adapter)."""
        return model

    def select(self, model: torch.nn.Module, selection: ParamSelection, cfg) -> ParamSelection:
        """The tensors this mode perturbs, out of the config's include/exclude/layers selection."""
        return selection

    def direction(self, seed: int, tensor_index: int, p: torch.Tensor, spec: NoiseSpec,
                  generator: torch.Generator | None = None) -> torch.Tensor:
        """Unit-scale dense eps of one member on tensor p in fp32 (no sign, no sigma)."""
        return gaussian(seed, tensor_index, p.shape, p.device, generator)

    def gradient(self, coef: dict[int, float], n: int, tensor_index: int, p: torch.Tensor, spec: NoiseSpec,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """(1/N) sum_k c_k eps_k on tensor p in fp32 (c: esrl.es.noise.folded_coefficients), before s_j / sigma."""
        return gaussian_gradient(coef, n, tensor_index, p.shape, p.device, generator)

    def gradients(self, coef: dict[int, float], n: int, selection: ParamSelection, spec: NoiseSpec
                  ) -> Iterator[tuple[list[torch.Tensor], torch.Tensor]]:
        """`gradient` of every selected tensor, as (tensors, their gradients stacked on dim 0) pairs: one tensor
        each here; a mode may batch same-shape tensors (lowrank: one product per group)."""
        generator = None
        for j, _, p in selection:
            generator = generator_on(p.device, generator)
            yield [p], self.gradient(coef, n, j, p, spec, generator).unsqueeze(0)

    def population(self, model: torch.nn.Module, selection: ParamSelection, spec: NoiseSpec,
                   members: Sequence[Member], row_member: torch.Tensor) -> PopulationHooks:
        """Forward hooks giving every batch row its member's perturbation while the returned context is entered."""
        raise NotImplementedError(f"mode {self.name} runs member by member")

    def static_population(self, model: torch.nn.Module, selection: ParamSelection, spec: NoiseSpec):
        """An esrl.es.static_population.StaticPopulation for compiled decoding (hooks installed once, buffers
        refilled per chunk)."""
        raise NotImplementedError(f"mode {self.name} has no population for compiled decoding")

    def adapter_spec(self, cfg, model: torch.nn.Module) -> AdapterSpec | None:
        """The member adapters an engine with its own weights must be able to run; None: no adapters."""
        return None

    def member_adapters(self, model: torch.nn.Module, selection: ParamSelection, spec: NoiseSpec,
                        members: Sequence[Member]) -> list[Adapter]:
        """Each member as a LoRA adapter on the unperturbed weights, for engines that run adapters per row."""
        raise NotImplementedError(f"mode {self.name} runs member by member")

    def policy_adapter(self, model: torch.nn.Module) -> Adapter | None:
        """The trained policy as an adapter on an engine's base weights (lora); None: push the weights instead."""
        return None

    def save_final(self, policy: torch.nn.Module, tokenizer, out: str | Path) -> Path:
        """The trained model in Hugging Face format under `out`."""
        out = Path(out)
        policy.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        return out
