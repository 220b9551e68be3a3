"""`lowrank` (EGGROLL, arXiv 2511.16652): rank-r noise on every perturbed nn.Linear weight, members batched.

For every perturbed 2-D weight W_j (out x in) of an nn.Linear, eps_ij = A_ij B_ij^T / sqrt(r)
(esrl.es.noise.lowrank_direction). 1-D tensors (biases, norm weights) are frozen (`lowrank_vectors: frozen`, the
default) or get full Gaussian noise (`lowrank_vectors: full`).

What lowrank perturbs: only weights of nn.Linear modules. Embedding lookups are not linear layers, so the
embedding matrix stays frozen; with tied embeddings (SmolLM2: lm_head.weight IS embed_tokens.weight) the
shared tensor is frozen too, because perturbing lm_head alone would no longer be a perturbation of the
model's parameters. With the default (empty) include filter such tensors are skipped silently; a filter
that explicitly names one is a config error.

Population batching: all members of a chunk run in ONE batched generate, rows member-major. Every perturbed
Linear gets a forward hook adding the row's own low-rank term, y = x W^T + s_j/sqrt(r) (x B_i) A_i^T, so no
weight is copied or modified. 1-D tensors with full noise ride per row too (Linear biases directly; other
modules, e.g. RMSNorm, are re-run with each row's member weight, which works for modules whose forward
multiplies or adds the weight elementwise). On an engine with its own weights, member i is the LoRA adapter
lora_A = B_i^T, lora_B = sign_i s_j / sqrt(r) A_i: the same factors, so the same completions.
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

from esrl.errors import ConfigError, require
from esrl.es.lowrank_kernel import lowrank_add_, row_major
from esrl.es.modes.base import Adapter, NoiseMode
from esrl.es.noise import (Member, NoiseSpec, factor_groups, factor_stacks, gaussian, gaussian_stack, generator_on,
                           lowrank_direction, lowrank_gradient, lowrank_gradients, member_weights, noise_groups,
                           scaled_factor, tensor_scale)
from esrl.es.params import ParamSelection, linear_weight_only, param_owners, select_params
from esrl.es.population_hooks import PopulationHooks
from esrl.es.static_population import StaticPopulation
from esrl.rollout.base import AdapterSpec

VECTORS_AS_ADAPTERS = ("model.es.lowrank_vectors: full perturbs 1-D tensors, which LoRA adapters (rollout.engine: "
                       "vllm) cannot carry; use lowrank_vectors: frozen, or rollout.engine: hf")


class LowRankMode(NoiseMode):
    name = "lowrank"
    batched = True

    def validate(self, cfg) -> None:
        require(cfg.rank >= 1, "model.es.rank", f"must be >= 1, got {cfg.rank}")
        require(cfg.lowrank_vectors in ("frozen", "full"), "model.es.lowrank_vectors",
                f"choose frozen or full, got {cfg.lowrank_vectors!r}")

    def select(self, model, selection, cfg) -> ParamSelection:
        try:
            return lowrank_selection(model, selection, NoiseSpec.from_config(cfg), cfg.include)
        except ValueError as e:
            raise ConfigError(f"model.es.include: {e}") from None

    def direction(self, seed, tensor_index, p, spec, generator=None) -> torch.Tensor:
        if p.dim() == 2:
            return lowrank_direction(seed, tensor_index, p.shape, spec.rank, p.device, generator)
        return gaussian(seed, tensor_index, p.shape, p.device, generator)

    def gradient(self, coef, n, tensor_index, p, spec, generator=None) -> torch.Tensor:
        if p.dim() == 2:
            return lowrank_gradient(coef, n, tensor_index, p.shape, spec.rank, p.device, generator)
        return super().gradient(coef, n, tensor_index, p, spec, generator)

    def gradients(self, coef, n, selection, spec):
        """One batched product per group of same-shape matrices (esrl.es.noise.lowrank_gradients); 1-D tensors
        one by one."""
        for group in noise_groups(selection):
            p = group.params[0]
            if p.dim() != 2:
                yield from super().gradients(coef, n, group, spec)
                continue
            yield group.params, lowrank_gradients(coef, n, group.indices, p.shape, spec.rank, p.device)

    def population(self, model, selection, spec, members, row_member) -> PopulationHooks:
        return PopulationPerturbation(model, selection, spec, members, row_member)

    def static_population(self, model, selection, spec) -> StaticPopulation:
        if any(p.dim() != 2 for p in selection.params):
            raise ConfigError("model.es.lowrank_vectors: full is not supported with compiled decoding; use "
                              "lowrank_vectors: frozen, or model.rollout.compile: off")
        return StaticLowRank(model, selection, spec)

    def adapter_spec(self, cfg, model) -> AdapterSpec:
        if cfg.lowrank_vectors == "full":
            raise ConfigError(VECTORS_AS_ADAPTERS)
        targets = ()
        if model is not None:
            selection = self.select(model, select_params(model, cfg.include, cfg.exclude, cfg.layers), cfg)
            targets = tuple(sorted({n.rsplit(".", 2)[-2] for n in selection.names}))
        return AdapterSpec(int(cfg.rank), targets, "model.es.rank")

    @torch.no_grad()
    def member_adapters(self, model, selection, spec, members) -> list[Adapter]:
        adapters: list[Adapter] = [{} for _ in members]
        generator = None
        for j, name, p in selection:
            if p.dim() != 2:
                raise ConfigError(VECTORS_AS_ADAPTERS)
            generator = generator_on(p.device, generator)
            a, b = _member_factors(members, j, p, spec, generator)
            for k, adapter in enumerate(adapters):
                adapter[name.removesuffix(".weight")] = (b[k].T.contiguous(), a[k])
        return adapters


def lowrank_selection(model: torch.nn.Module, selection: ParamSelection, spec: NoiseSpec,
                      include: Sequence[str] = ()) -> ParamSelection:
    """The tensors lowrank mode perturbs, out of `selection`.

    2-D tensors: only weights held by nn.Linear modules alone (not an embedding, not tied to one).
    1-D tensors: with `lowrank_vectors: full` only. Anything else is dropped; when an explicit include
    pattern names a dropped tensor the filter is contradictory and this raises ValueError.
    """
    owners = param_owners(model)
    out = ParamSelection([], [], [])
    dropped: list[str] = []
    for j, name, p in selection:
        if p.dim() == 2:
            ok = linear_weight_only(owners[id(p)])
        else:
            ok = p.dim() == 1 and spec.lowrank_vectors == "full"
        if ok:
            out.indices.append(j)
            out.names.append(name)
            out.params.append(p)
        else:
            dropped.append(name)
    inc = [re.compile(x) for x in include]
    named = [n for n in dropped if any(r.search(n) for r in inc)]
    if named:
        raise ValueError(f"lowrank mode cannot perturb {', '.join(named[:5])}{' ...' if len(named) > 5 else ''} "
                         "(only nn.Linear weights, not embeddings or weights tied to them; 1-D tensors need "
                         "lowrank_vectors: full); remove it from the include filter")
    if not out.params:
        raise ValueError("lowrank mode: the parameter filter selects no nn.Linear weight")
    return out


class StaticLowRank(StaticPopulation):
    """lowrank for compiled decoding: per hooked Linear, A^T (M, r, out) and B^T (M, r, in) in persistent buffers,
    applied by esrl.es.lowrank_kernel (one kernel per linear on a GPU). The buffers of same-shape matrices are slices
    of one (G, M, r, n) tensor per group, so a chunk's load is a few launches per group (the draw, the scaled A, the
    B copy) instead of per matrix (a 1.5B model: 7 groups, 196 matrices)."""

    def _targets(self):
        owners = param_owners(self.model)
        return [(name, module) for _, name, p in self.selection for module, _ in owners[id(p)]]

    def _fill(self, members):
        m, rank = len(members), self.spec.rank
        groups, buffers = [], {}
        for group in noise_groups(self.selection):
            p = group.params[0]
            a_t, b_t = (p.new_empty(len(group), m, rank, n) for n in p.shape)
            groups.append((group, a_t, b_t))
            for g, name in enumerate(group.names):
                buffers[name] = (a_t[g], b_t[g])
        self._storage[m] = groups  # (group, A^T storage, B^T storage)
        self._refill(buffers, members)
        return buffers

    def _refill(self, buffers, members):
        """The chunk's factors written straight into each group's buffers (scaled A^T and B^T in the weights' dtype,
        as _member_factors rounds them): no stacked, cast or transposed copies in between."""
        seeds, signs = [m.seed for m in members], [m.sign for m in members]
        for group, a_t, b_t in self._storage[len(members)]:
            p = group.params[0]
            a, b = factor_groups(seeds, group.indices, p.shape, self.spec.rank, p.device)  # (M, G, out|in, r)
            scales = [tensor_scale(q, self.spec) for q in group.params]
            scaled_factor(a, signs, scales, self.spec.rank, out=a_t.permute(1, 0, 3, 2))
            b_t.permute(1, 0, 3, 2).copy_(b)


def _member_factors(members: Sequence[Member], j: int, p: torch.Tensor, spec: NoiseSpec,
                    generator: torch.Generator | None, out: Sequence[torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A (M, out, r) with sign_i s_j / sqrt(r) folded in (in fp32, then rounded once), and B (M, in, r), both in the
    weights' dtype (`out`: written into these two tensors instead, e.g. transposed views of persistent buffers)."""
    a, b = factor_stacks([m.seed for m in members], j, p.shape, spec.rank, p.device, generator)
    if out is None:
        return scaled_factor(a, [m.sign for m in members], tensor_scale(p, spec), spec.rank).to(p.dtype), b.to(p.dtype)
    scaled_factor(a, [m.sign for m in members], tensor_scale(p, spec), spec.rank, out=out[0])
    return out[0], out[1].copy_(b)


class PopulationPerturbation(PopulationHooks):
    """Forward hooks that give every batch row its member's perturbation during one batched generate.

    Factors of all the chunk's members are generated on entry (M x (in + out) x r floats per matrix) and
    freed on exit (see esrl.es.population_hooks for `members`, `row_member` and the member-major fast path).
    """

    mode = "lowrank"

    def __init__(self, model: torch.nn.Module, selection: ParamSelection, spec: NoiseSpec,
                 members: Sequence[Member], row_member: torch.Tensor):
        super().__init__(model, selection, spec, members, row_member)
        self._inside = False

    @torch.no_grad()
    def _install(self) -> None:
        spec, members = self.spec, self.members
        owners = param_owners(self.model)
        generator: torch.Generator | None = None
        linear: dict[int, dict[str, torch.Tensor]] = {}  # id(module) -> {"A", "B", "bias"}
        other: dict[int, dict[str, torch.Tensor]] = {}  # id(module) -> {attr: (M, dim) member weights}
        modules: dict[int, torch.nn.Module] = {}
        names: dict[int, str] = {}  # id(module) -> its name, for the error below
        for j, name, p in self.selection:
            generator = generator_on(p.device, generator)
            if p.dim() == 2:
                a, b = _member_factors(members, j, p, spec, generator)
                for module, attr in owners[id(p)]:
                    modules[id(module)] = module
                    linear.setdefault(id(module), {}).update(A=a, B=b)
                continue
            scale = tensor_scale(p, spec)  # 1-D tensor with full noise: each member's own weight
            eps = gaussian_stack([m.seed for m in members], j, p.shape, p.device, generator)
            weights = member_weights(p, eps, [m.sign for m in members], scale)
            for module, attr in owners[id(p)]:
                modules[id(module)] = module
                if isinstance(module, torch.nn.Linear) and attr == "bias":
                    linear.setdefault(id(module), {})["bias"] = weights - p
                else:
                    other.setdefault(id(module), {})[attr] = weights
                    names[id(module)] = name.rpartition(".")[0]
        for key, factors in linear.items():
            self._handles.append(modules[key].register_forward_hook(self._linear_hook(factors)))
        for key, weights in other.items():
            self._handles.append(modules[key].register_forward_hook(self._vector_hook(weights, names[key]),
                                                                    with_kwargs=True))

    def _linear_hook(self, factors: dict[str, torch.Tensor]):
        a, b, bias = factors.get("A"), factors.get("B"), factors.get("bias")
        a_t = row_major(a.transpose(1, 2)) if a is not None else None  # (M, r, out)
        b_t = row_major(b.transpose(1, 2)) if a is not None else None  # (M, r, in)

        def hook(module, args, out):
            x = args[0]
            idx = self._rows(x)
            rows = x.shape[0]
            if a is not None:
                if self.per_member and not torch.is_grad_enabled() and out.is_contiguous():
                    # (M, P * seq, in) @ (M, in, r), then one fused out += (x B) A^T in place: no per-row
                    # copies and no (rows, seq, out) temporary (the decode loop runs this 100s of times).
                    m = a_t.shape[0]
                    lowrank_add_(out.view(m, -1, out.shape[-1]), x.reshape(m, -1, x.shape[-1]), a_t, b_t)
                else:
                    xs = x.reshape(rows, -1, x.shape[-1])
                    delta = torch.bmm(torch.bmm(xs, b_t[idx].transpose(1, 2)), a_t[idx])  # (rows, seq, out)
                    out = out + delta.view(out.shape)
            if bias is not None:
                out = out + bias[idx].view(rows, *([1] * (out.dim() - 2)), -1)
            return out

        return hook

    def _vector_hook(self, weights: dict[str, torch.Tensor], name: str):
        def hook(module, args, kwargs, out):
            if self._inside:  # the re-run below calls the module again
                return None
            x = args[0] if args else next(iter(kwargs.values()))
            idx = self._rows(x)
            shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
            params = {attr: w[idx].view(shape) for attr, w in weights.items()}
            self._inside = True
            try:
                return torch.func.functional_call(module, params, args, kwargs)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as e:  # e.g. nn.LayerNorm: F.layer_norm takes one weight, not one per row
                raise ConfigError(f"model.es.lowrank_vectors: full cannot perturb {', '.join(weights)} of {name} "
                                  f"({type(module).__name__}), which takes one weight, not one per batch row "
                                  f"({str(e)[:120]}); use lowrank_vectors: frozen, or model.es.exclude") from None
            finally:
                self._inside = False

        return hook
