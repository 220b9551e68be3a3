"""Noise modes and the population-batched perturbation (plain torch, no Lightning).

Modes
-----
- `full`: eps_ij ~ N(0, I) on the whole tensor j of member i (the paper's algorithm), applied member by member.
- `lowrank` (EGGROLL, arXiv 2511.16652): for every perturbed 2-D weight W_j (out x in) of an nn.Linear,
  eps_ij = A_ij B_ij^T / sqrt(r) with A_ij (out x r) and B_ij (in x r) standard normal, regenerated from seeds
  derived from (member seed, tensor index, "A" / "B"). 1-D tensors (biases, norm weights) are frozen
  (`lowrank_vectors: frozen`, the default) or get full Gaussian noise (`lowrank_vectors: full`).

Noise scale: the perturbation of tensor j is s_j * eps_ij with s_j = sigma (`sigma_scaling: global`) or
s_j = sigma * RMS(theta_j) (`rms`, RMS of the unperturbed tensor at the start of the iteration). The update
ascends g_j = (1/N) sum_i z_i (s_j / sigma) eps_ij, so `global` is exactly the paper's g = (1/N) sum z_i eps_i
and `rms` moves each tensor in proportion to its own scale.

What lowrank perturbs: only weights of nn.Linear modules. Embedding lookups are not linear layers, so the
embedding matrix stays frozen; with tied embeddings (SmolLM2: lm_head.weight IS embed_tokens.weight) the
shared tensor is frozen too, because perturbing lm_head alone would no longer be a perturbation of the
model's parameters. With the default (empty) include filter such tensors are skipped silently; a filter
that explicitly names one is a config error.

Population batching: all members of a chunk run in ONE batched generate, rows member-major. Every perturbed
Linear gets a forward hook adding the row's own low-rank term, y = x W^T + s_j/sqrt(r) (x B_i) A_i^T, so no
weight is copied or modified. 1-D tensors with full noise are added per row too (Linear biases directly; other
modules, e.g. RMSNorm, are re-run with a per-row weight of shape (rows, 1, ..., dim), which works for modules
whose forward multiplies or adds the weight elementwise).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator, Literal, Sequence

import torch

from esrl.es.noise import Member, tensor_noise
from esrl.es.params import ParamSelection
from esrl.es.population_hooks import PopulationHooks

_MASK63 = (1 << 63) - 1

Mode = Literal["full", "lowrank", "lora"]  # lora: full noise on the adapter (esrl.es.lora)


@dataclass(frozen=True)
class NoiseSpec:
    """Everything that defines a member's perturbation besides its seed."""

    mode: Mode = "full"
    sigma: float = 0.001
    rank: int = 1
    sigma_scaling: Literal["global", "rms"] = "global"
    lowrank_vectors: Literal["frozen", "full"] = "frozen"

    @classmethod
    def from_config(cls, cfg) -> "NoiseSpec":
        return cls(mode=cfg.mode, sigma=cfg.sigma, rank=cfg.rank, sigma_scaling=cfg.sigma_scaling,
                   lowrank_vectors=cfg.lowrank_vectors)

    def is_lowrank(self, p: torch.Tensor) -> bool:
        return self.mode == "lowrank" and p.dim() == 2


def factor_seed(seed: int, tensor_index: int, part: str) -> int:
    """Distinct 63-bit seeds for the A and B factors of (member seed, tensor index)."""
    digest = hashlib.blake2b(f"esrl-lowrank:{seed}:{tensor_index}:{part}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK63


def lowrank_factors(seed: int, tensor_index: int, shape: Sequence[int], rank: int,
                    device: torch.device | str = "cpu", generator: torch.Generator | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A (out x r) and B (in x r), standard normal in fp32, for a 2-D tensor of `shape` = (out, in)."""
    out_f, in_f = shape
    a = tensor_noise(factor_seed(seed, tensor_index, "A"), 0, (out_f, rank), device, generator)
    b = tensor_noise(factor_seed(seed, tensor_index, "B"), 0, (in_f, rank), device, generator)
    return a, b


def tensor_scale(p: torch.Tensor, spec: NoiseSpec, sigma: float | None = None) -> float:
    """s_j: sigma, or sigma times the RMS of the (unperturbed) tensor."""
    sigma = spec.sigma if sigma is None else sigma
    if spec.sigma_scaling == "global":
        return sigma
    if spec.sigma_scaling == "rms":
        return sigma * float(p.detach().float().pow(2).mean().sqrt())
    raise ValueError(f"unknown sigma_scaling {spec.sigma_scaling!r}")


def member_direction(member_seed: int, tensor_index: int, p: torch.Tensor, spec: NoiseSpec,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Unit-scale dense noise eps_ij in fp32 (no sign, no sigma): the member-by-member reference."""
    if spec.is_lowrank(p):
        a, b = lowrank_factors(member_seed, tensor_index, p.shape, spec.rank, p.device, generator)
        return (a @ b.T).div_(math.sqrt(spec.rank))
    return tensor_noise(member_seed, tensor_index, p.shape, p.device, generator)


# -- which tensors lowrank can perturb --------------------------------------------------------------------
def param_owners(model: torch.nn.Module) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """id(param) -> every (module, attribute name) that holds it directly (tied weights have several)."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = defaultdict(list)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            owners[id(p)].append((module, name))
    return owners


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
        holders = owners[id(p)]
        if p.dim() == 2:
            ok = all(isinstance(m, torch.nn.Linear) and attr == "weight" for m, attr in holders)
        elif p.dim() == 1:
            ok = spec.lowrank_vectors == "full"
        else:
            ok = False
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


# -- population-batched perturbation ---------------------------------------------------------------------
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
        sqrt_r = math.sqrt(spec.rank)
        generator: torch.Generator | None = None
        linear: dict[int, dict[str, torch.Tensor]] = {}  # id(module) -> {"A", "B", "bias"}
        other: dict[int, dict[str, torch.Tensor]] = {}  # id(module) -> {attr: (M, dim) deltas}
        modules: dict[int, torch.nn.Module] = {}
        for j, name, p in self.selection:
            if generator is None or generator.device != p.device:
                generator = torch.Generator(device=p.device)
            scale = tensor_scale(p, spec)
            signs = torch.tensor([m.sign for m in members], dtype=torch.float32, device=p.device)
            if spec.is_lowrank(p):
                fa, fb = zip(*(lowrank_factors(m.seed, j, p.shape, spec.rank, p.device, generator) for m in members))
                a = torch.stack(fa).mul_(signs.view(-1, 1, 1) * (scale / sqrt_r))  # (M, out, r), scale folded in
                b = torch.stack(fb)  # (M, in, r)
                for module, attr in owners[id(p)]:
                    modules[id(module)] = module
                    linear.setdefault(id(module), {}).update(A=a.to(p.dtype), B=b.to(p.dtype))
            else:  # 1-D tensor with full noise
                d = torch.stack([tensor_noise(m.seed, j, p.shape, p.device, generator) for m in members])
                d = d.mul_(signs.view(-1, 1) * scale).to(p.dtype)
                for module, attr in owners[id(p)]:
                    modules[id(module)] = module
                    if isinstance(module, torch.nn.Linear) and attr == "bias":
                        linear.setdefault(id(module), {})["bias"] = d
                    else:
                        other.setdefault(id(module), {})[attr] = d
        for key, factors in linear.items():
            self._handles.append(modules[key].register_forward_hook(self._linear_hook(factors)))
        for key, deltas in other.items():
            self._handles.append(modules[key].register_forward_hook(self._vector_hook(deltas), with_kwargs=True))

    def _linear_hook(self, factors: dict[str, torch.Tensor]):
        a, b, bias = factors.get("A"), factors.get("B"), factors.get("bias")
        a_t = a.transpose(1, 2).contiguous() if a is not None else None  # (M, r, out)
        b_row = b.transpose(1, 2).contiguous() if a is not None and a.shape[-1] == 1 else None  # (M, 1, in)

        def hook(module, args, out):
            x = args[0]
            idx = self._rows(x)
            rows = x.shape[0]
            if a is not None:
                if self.per_member and not torch.is_grad_enabled() and out.is_contiguous():
                    # (M, P * seq, in) @ (M, in, r), then one fused out += (x B) A^T in place: no per-row
                    # copies and no (rows, seq, out) temporary (the decode loop runs this 100s of times).
                    m = a_t.shape[0]
                    xs, ys = x.reshape(m, -1, x.shape[-1]), out.view(m, -1, out.shape[-1])
                    if b_row is not None:  # rank 1: two elementwise kernels beat tiny batched GEMMs 2-4x on CPU
                        ys.addcmul_((xs * b_row).sum(-1, keepdim=True), a_t)
                    else:
                        ys.baddbmm_(torch.bmm(xs, b), a_t)
                else:
                    xs = x.reshape(rows, -1, x.shape[-1])
                    delta = torch.bmm(torch.bmm(xs, b[idx]), a_t[idx])  # (rows, seq, out)
                    out = out + delta.view(out.shape)
            if bias is not None:
                out = out + bias[idx].view(rows, *([1] * (out.dim() - 2)), -1)
            return out

        return hook

    def _vector_hook(self, deltas: dict[str, torch.Tensor]):
        def hook(module, args, kwargs, out):
            if self._inside:  # the re-run below calls the module again
                return None
            x = args[0] if args else next(iter(kwargs.values()))
            idx = self._rows(x)
            shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
            params = {attr: getattr(module, attr) + d[idx].view(shape) for attr, d in deltas.items()}
            self._inside = True
            try:
                return torch.func.functional_call(module, params, args, kwargs)
            finally:
                self._inside = False

        return hook


def member_chunks(members: Sequence[Member], members_per_chunk: int) -> list[list[Member]]:
    """Fixed chunks of consecutive members: a member's batch companions never depend on the world size."""
    k = max(1, members_per_chunk)
    return [list(members[s:s + k]) for s in range(0, len(members), k)]


# -- the update ------------------------------------------------------------------------------------------
def folded_coefficients(members: Sequence[Member], weights: torch.Tensor) -> dict[int, float]:
    """seed -> sum of sign_i * w_i over members sharing that seed (antithetic pairs fold into one draw)."""
    if weights.numel() != len(members):
        raise ValueError(f"{weights.numel()} fitness weights for {len(members)} members")
    coef: dict[int, float] = defaultdict(float)
    for m, w in zip(members, weights.tolist()):
        coef[m.seed] += m.sign * w
    return {s: c for s, c in coef.items() if c != 0.0}


@torch.no_grad()
def lowrank_gradient(seeds_coef: dict[int, float], n: int, tensor_index: int, p: torch.Tensor, spec: NoiseSpec,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """g = (1/N) sum_i c_i A_i B_i^T / sqrt(r) as one (out x Kr) @ (Kr x in) matmul in fp32 (no per-member matrix)."""
    if not seeds_coef:
        return torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    fa, fb = zip(*(lowrank_factors(s, tensor_index, p.shape, spec.rank, p.device, generator) for s in seeds_coef))
    coef = torch.tensor(list(seeds_coef.values()), dtype=torch.float32, device=p.device)
    a = (torch.stack(fa) * coef.view(-1, 1, 1)).transpose(0, 1).reshape(p.shape[0], -1)  # (out, K r): diag(c) A
    b = torch.stack(fb).transpose(0, 1).reshape(p.shape[1], -1)  # (in, K r)
    return (a @ b.T).div_(math.sqrt(spec.rank) * n)


def iter_gradient(selection: ParamSelection, members: Sequence[Member], weights: torch.Tensor,
                  spec: NoiseSpec) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(param, g_j) with g_j = (1/N) sum_i w_i sign_i (s_j / sigma) eps_ij in fp32, one tensor at a time."""
    n = len(members)
    coef = folded_coefficients(members, weights)
    generator: torch.Generator | None = None
    for j, _, p in selection:
        if generator is None or generator.device != p.device:
            generator = torch.Generator(device=p.device)
        if spec.is_lowrank(p):
            g = lowrank_gradient(coef, n, j, p, spec, generator)
        else:
            g = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            for seed, c in coef.items():
                g.add_(tensor_noise(seed, j, p.shape, p.device, generator), alpha=c)
            g.div_(n)
        if spec.sigma_scaling != "global":
            g.mul_(tensor_scale(p, spec) / spec.sigma)
        yield p, g
