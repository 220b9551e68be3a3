"""Every formula of ES noise, written once: seeds, noise draws, scales, the member weight, the gradient.

The population is a list of integers, never a list of tensors. The seed of member i at iteration t depends on
(run seed, t, i) alone, so any process can regenerate any member's noise; tensor j adds its index, so noise is
independent across tensors (the reference code re-used one seed for every tensor, which correlates the noise of
same-shaped tensors). Every consumer (in-place perturbation, population hooks, LoRA members, engine adapters,
the update, seed-log replay) calls these functions, so their tensors are equal by construction.

Noise of tensor j of member i: s_j * sign_i * eps_ij, with
- eps_ij ~ N(0, I) on the whole tensor (`gaussian`), or
- eps_ij = A_ij B_ij^T / sqrt(r), A (out x r) and B (in x r) standard normal (`lowrank_direction`, EGGROLL);
- s_j = sigma (`sigma_scaling: global`) or sigma * RMS(theta_j) (`rms`, of the unperturbed tensor).
The update ascends g_j = (1/N) sum_i z_i sign_i (s_j / sigma) eps_ij, so `global` is exactly the paper's
g = (1/N) sum z_i eps_i; members sharing a seed (antithetic pairs) fold into one draw.

Draws: torch's generator on a CPU; on a GPU, draws of up to PHILOX_MAX_NUMBERS numbers are Triton's counter-based
Philox (esrl.es.philox), so the groups (`factor_groups`, `gaussian_groups`: a chunk's members on a group of same-shape
tensors, `noise_groups`) are one launch each, and the update reduces a group with one batched product.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator, Literal, Sequence

import torch

from esrl.es import philox
from esrl.seeding import MASK63, derive_seed


@dataclass(frozen=True)
class Member:
    """One population member: its noise seed and the sign it applies (antithetic pairs share a seed)."""

    index: int
    seed: int
    sign: float


@dataclass(frozen=True)
class NoiseSpec:
    """Everything that defines a member's perturbation besides its seed; `mode` names an esrl.es.modes mode."""

    mode: str = "full"
    sigma: float = 0.001
    rank: int = 1
    sigma_scaling: Literal["global", "rms"] = "global"
    lowrank_vectors: Literal["frozen", "full"] = "frozen"

    @classmethod
    def from_config(cls, cfg) -> "NoiseSpec":
        return cls(mode=cfg.mode, sigma=cfg.sigma, rank=cfg.rank, sigma_scaling=cfg.sigma_scaling,
                   lowrank_vectors=cfg.lowrank_vectors)


# -- seeds ---------------------------------------------------------------------------------------------------
def member_seed(run_seed: int, iteration: int, pair: int) -> int:
    """A 63-bit seed from (run seed, iteration, member or pair index), stable across machines and versions."""
    return derive_seed("esrl", run_seed, iteration, pair)


def population(run_seed: int, iteration: int, size: int, antithetic: bool = False) -> list[Member]:
    """Members of one iteration; with antithetic pairs, members (2k, 2k+1) share noise with signs (+, -)."""
    if antithetic:
        return [Member(i, member_seed(run_seed, iteration, i // 2), 1.0 if i % 2 == 0 else -1.0) for i in range(size)]
    return [Member(i, member_seed(run_seed, iteration, i), 1.0) for i in range(size)]


def factor_seed(seed: int, tensor_index: int, part: str) -> int:
    """Distinct 63-bit seeds for the A and B factors of (member seed, tensor index)."""
    return derive_seed("esrl-lowrank", seed, tensor_index, part)


GROUP_NUMBERS = {"cuda": 2**27, "cpu": 2**13}
"""A group of same-shape tensors (noise_groups) holds at most this many of the tensors' numbers, per device type. On
a GPU the load and the update are launch-bound: big groups (2^27 fp32: a 512 MB gradient stack in the update; a
1.5B model's 196 projections make 13 groups). On a CPU they are memory-bound: small groups, so a 135M model's
matrices go one at a time (SmolLM2-135M, N=30, side by side, medians of 3: with whole groups lowrank's update took
0.376 s against 0.230 s, lora's load 0.804 s against 0.708 s; RESULTS, session 17), while the tests' tiny models
still run in groups."""


def noise_groups(selection) -> list:
    """The ParamSelection's same-shape groups whose noise is drawn, written and reduced together (GROUP_NUMBERS):
    the load and the update use the same ones, so the update finds the load's draws (drawn_once)."""
    if not selection.params:
        return []
    return selection.same_shape_groups(GROUP_NUMBERS.get(selection.params[0].device.type, GROUP_NUMBERS["cpu"]))


# -- draws -----------------------------------------------------------------------------------------------------
def generator_on(device: torch.device | str, generator: torch.Generator | None = None) -> torch.Generator:
    """`generator` when it lives on `device`, else a new one there (callers keep it to reuse across tensors)."""
    device = torch.device(device)
    if generator is None or generator.device != device:
        generator = torch.Generator(device=device)
    return generator


_DRAWN: ContextVar[dict | None] = ContextVar("esrl_drawn_once", default=None)


@contextmanager
def drawn_once(max_bytes: int = 2**30) -> Iterator[None]:
    """Inside the block a group's draws (factor_groups, gaussian_groups) are made once and served again (the same
    tensors, so the same numbers): an ES iteration needs every member's low-rank factors (or lora adapter noise) for
    its chunk's generate and again for the update, and antithetic pairs share theirs. Memory: the kept draws until
    the block exits (N=30: lowrank rank 1 35 MB for SmolLM2-135M, 138 MB for a 1.5B model; lora rank 8 292 MB for
    SmolLM2-135M); past `max_bytes` a draw is made again, as without the block. Callers must not modify them."""
    token = _DRAWN.set({"bytes": 0, "max_bytes": max_bytes, "draws": {}})
    try:
        yield
    finally:
        _DRAWN.reset(token)


def gaussian(seed: int, tensor_index: int, shape: Sequence[int], device: torch.device | str = "cpu",
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Standard normal noise in fp32 for tensor `tensor_index` of the member with `seed` (a new draw each call; the
    stacks below keep theirs inside `drawn_once`)."""
    if _batched(device, math.prod(shape)):  # GPU: key seed, stream tensor_index (below the factors' streams)
        return philox.normal_slabs([seed], [(tensor_index, math.prod(shape))], device)[0].view(tuple(shape))
    generator = generator_on(device, generator)
    generator.manual_seed((seed + tensor_index) & MASK63)
    return torch.randn(tuple(shape), generator=generator, device=generator.device, dtype=torch.float32)


def noise_source(device: torch.device | str) -> str:
    """What, besides the seeds, decides the noise drawn on `device`: on a GPU, torch's generator (draws above
    PHILOX_MAX_NUMBERS) spreads its counters over a grid sized by the chip (its SM count), so another GPU model draws
    other numbers from one seed. Recorded in the seed log and the checkpoint; 'cpu' on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    props = torch.cuda.get_device_properties(device)
    return (f"cuda: {props.name}, {props.multi_processor_count} SMs, {props.max_threads_per_multi_processor} "
            "threads/SM")


def other_noise_source(recorded: str | None, here: str) -> str | None:
    """A warning when the noise was drawn on another kind of GPU than `here` (None: the same, or not recorded)."""
    if recorded is None or recorded == here:
        return None
    return (f"the noise was drawn on {recorded}; here {here}: torch's generator sizes its draws to the chip, so "
            "tensors above 2^18 numbers (full mode's matrices, large factors) get other noise from the same seeds")


PHILOX_MAX_NUMBERS = 2**18
"""Draws up to this size (factors, adapter noise, vectors) use esrl.es.philox on a GPU, so a chunk's are one launch;
larger ones (full mode's whole matrices, one launch each anyway) keep torch's curand kernel, which makes four numbers
per counter where tl.randn makes one (full mode per member on an H100: 1.33x a member's generate with every draw by
Philox, a unit that may hold the kernel's compile; 1.04x in session 6 with torch's generator; RESULTS, session 13)."""


def _batched(device: torch.device | str, numbers: int) -> bool:
    return numbers <= PHILOX_MAX_NUMBERS and philox.available(device)


def _keep(drawn: dict, key: tuple, value, nbytes: int) -> None:
    """Serve `value` again for `key` inside this drawn_once block, while its memory budget lasts."""
    if drawn["bytes"] + nbytes <= drawn["max_bytes"]:
        drawn["draws"][key] = value
        drawn["bytes"] += nbytes


def _stacks_of(keys: list[tuple], draw: Callable[[list[tuple]], tuple[torch.Tensor, ...]],
               nbytes: int) -> tuple[torch.Tensor, ...]:
    """The draws of `keys` stacked on dim 0, one tensor per part (A and B, or eps). Kept ones come from the drawn_once
    block; the others from `draw(missing keys)`, slabs with one row per key (each key once: antithetic pairs draw
    once), kept as (slabs, row). When the keys are one slab's rows in order (an update asking for its load's draws) or
    each of them twice (a load's antithetic pairs), no per-key view is made: the slab itself, or one copy of it. The
    result may be a kept slab: callers must not modify it."""
    drawn = _DRAWN.get()
    kept = drawn["draws"] if drawn is not None else {}
    missing = list(dict.fromkeys(k for k in keys if k not in kept))
    fresh = {}
    if missing:
        slabs = draw(missing)
        fresh = {k: (slabs, row) for row, k in enumerate(missing)}
        if drawn is not None:
            for k, where in fresh.items():
                _keep(drawn, k, where, nbytes)
    where = [fresh[k] if k in fresh else kept[k] for k in keys]
    slabs = where[0][0]
    if all(w[0] is slabs for w in where):
        rows, size = [w[1] for w in where], slabs[0].shape[0]
        if rows == list(range(size)):
            return slabs
        if rows == [i // 2 for i in range(2 * size)]:
            return tuple(t.unsqueeze(1).expand(size, 2, *t.shape[1:]).reshape(2 * size, *t.shape[1:]) for t in slabs)
    return tuple(torch.stack([w[0][part][w[1]] for w in where]) for part in range(len(slabs)))


tensor_noise = gaussian  # the name the rest of the code base and the tests know


def gaussian_stack(seeds: Sequence[int], tensor_index: int, shape: Sequence[int],
                   device: torch.device | str = "cpu", generator: torch.Generator | None = None) -> torch.Tensor:
    """gaussian of every seed on one tensor, stacked (K, *shape); do not modify it (it may be kept)."""
    return gaussian_groups(seeds, (tensor_index,), shape, device, generator)[:, 0]


def gaussian_groups(seeds: Sequence[int], tensor_indices: Sequence[int], shape: Sequence[int],
                    device: torch.device | str = "cpu", generator: torch.Generator | None = None) -> torch.Tensor:
    """gaussian of every seed on a group of same-shape tensors, (K, G, *shape), [k, g] that of seeds[k] on
    tensor_indices[g]; do not modify it (it may be kept). On a GPU the draws not kept by `drawn_once` are one launch
    for the group, each seed once; inside the block they are kept for the next ask."""
    device, indices, numbers = torch.device(device), tuple(tensor_indices), math.prod(shape)

    def draw(missing):
        if _batched(device, numbers):
            slab = philox.normal_slabs([k[0] for k in missing], [(0, numbers)], device, indices)[0]
            return (slab.view(-1, len(indices), *shape),)
        gen = generator_on(device, generator)
        eps = torch.stack([gaussian(k[0], j, shape, device, gen) for k in missing for j in indices])
        return (eps.view(len(missing), len(indices), *shape),)

    keys = [(seed, indices, tuple(shape), device) for seed in seeds]
    return _stacks_of(keys, draw, 4 * len(indices) * numbers)[0]


FACTOR_STREAMS = (2**30, 2**31)
"""On the GPU (esrl.es.philox) the A and B factors of tensor j are streams 2^30 + j and 2^31 + j under the member's
seed, apart from its full-noise streams j: no per-factor seed to hash, and one launch draws a chunk's factors."""


def lowrank_factors(seed: int, tensor_index: int, shape: Sequence[int], rank: int,
                    device: torch.device | str = "cpu", generator: torch.Generator | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A (out x r) and B (in x r), standard normal in fp32, for a 2-D tensor of `shape` = (out, in); reused inside
    `drawn_once`."""
    a, b = factor_stacks([seed], tensor_index, shape, rank, device, generator)
    return a[0], b[0]


def factor_stacks(seeds: Sequence[int], tensor_index: int, shape: Sequence[int], rank: int,
                  device: torch.device | str = "cpu", generator: torch.Generator | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """lowrank_factors of every seed, stacked: A (K, out, r) and B (K, in, r); do not modify them (they may be kept)."""
    a, b = factor_groups(seeds, (tensor_index,), shape, rank, device, generator)
    return a[:, 0], b[:, 0]


def factor_groups(seeds: Sequence[int], tensor_indices: Sequence[int], shape: Sequence[int], rank: int,
                  device: torch.device | str = "cpu", generator: torch.Generator | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """factor_stacks of a group of same-shape tensors: A (K, G, out, r) and B (K, G, in, r), [k, g] the factors of
    seeds[k] on tensor_indices[g]; do not modify them (they may be kept). On a GPU the missing ones are drawn in one
    launch for the whole group; inside `drawn_once` each seed's are kept for the next ask (the update), and a seed
    listed twice (antithetic pairs) is drawn once."""
    out_f, in_f = shape
    device, indices = torch.device(device), tuple(tensor_indices)

    def draw(missing):
        if _batched(device, rank * max(out_f, in_f)):
            a, b = philox.normal_slabs([k[0] for k in missing], [(FACTOR_STREAMS[0], out_f * rank),
                                                                 (FACTOR_STREAMS[1], in_f * rank)], device, indices)
            return a.view(-1, len(indices), out_f, rank), b.view(-1, len(indices), in_f, rank)
        gen = generator_on(device, generator)
        return tuple(torch.stack([gaussian(factor_seed(k[0], j, part), 0, (n, rank), device, gen)
                                  for k in missing for j in indices]).view(len(missing), len(indices), n, rank)
                     for part, n in (("A", out_f), ("B", in_f)))

    keys = [(seed, indices, tuple(shape), rank, device) for seed in seeds]
    return _stacks_of(keys, draw, 4 * len(indices) * rank * (out_f + in_f))


def lowrank_direction(seed: int, tensor_index: int, shape: Sequence[int], rank: int,
                      device: torch.device | str = "cpu", generator: torch.Generator | None = None) -> torch.Tensor:
    """Dense eps = A B^T / sqrt(r) in fp32: the member-by-member reference of the low-rank noise."""
    a, b = lowrank_factors(seed, tensor_index, shape, rank, device, generator)
    return (a @ b.T).div_(math.sqrt(rank))


# -- scales and the member weight -------------------------------------------------------------------------------
def tensor_scale(p: torch.Tensor, spec: NoiseSpec, sigma: float | None = None) -> float:
    """s_j: sigma, or sigma times the RMS of the (unperturbed) tensor."""
    sigma = spec.sigma if sigma is None else sigma
    if spec.sigma_scaling == "global":
        return sigma
    if spec.sigma_scaling == "rms":
        return sigma * float(p.detach().float().pow(2).mean().sqrt())
    raise ValueError(f"unknown sigma_scaling {spec.sigma_scaling!r}")


def _scaled_in_dtype(eps: torch.Tensor, alpha: float, dtype: torch.dtype) -> torch.Tensor:
    """alpha * eps, eps first rounded to `dtype`: a new tensor (eps may be a kept draw), one rounding per step."""
    step = eps.to(dtype)
    return step.mul_(alpha) if step is not eps else step * alpha


def member_weight(p: torch.Tensor, eps: torch.Tensor, sign: float, scale: float, *,
                  in_place: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """theta + sign * (s * eps) in the weights' dtype: eps rounded to that dtype, scaled (one rounding), added (one
    rounding), as the paper's code adds `scale * noise`. Every consumer of a member's weight shares it (`out`: written
    into that tensor, e.g. a member's slot of a persistent buffer), and `member_weights` gives the same numbers for a
    stack of members: each step is one exactly rounded elementwise op. (A fused p + alpha * eps is not batch-invariant:
    written into alternate slots of a (30, 7, 333) bf16 stack on a CPU, 2 elements differed from single calls.)"""
    step = _scaled_in_dtype(eps, sign * scale, p.dtype)
    if in_place:
        return p.add_(step)
    return torch.add(p, step, out=out)


def member_weights(p: torch.Tensor, eps: torch.Tensor, signs: Sequence[float], scale: float, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """member_weight of K members at once: eps (K, *p.shape) -> (K, *p.shape), equal to K member_weight calls (the
    sign, +-1, multiplies exactly), in three launches instead of 2K (`out`: written there, e.g. persistent slots)."""
    step = _scaled_in_dtype(eps, scale, p.dtype)
    if any(s != 1.0 for s in signs):
        step.mul_(on_device(signs, p.device).to(p.dtype).view(-1, *([1] * p.dim())))
    return torch.add(p, step, out=out)


def scaled_factor(a: torch.Tensor, signs: Sequence[float], scales: float | Sequence[float], rank: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """A factors (M, out, r) with each member's sign and s / sqrt(r) folded in, a new fp32 tensor (`out`: written
    there instead, rounded to its dtype, e.g. a transposed view of a persistent buffer). A group's factors
    (M, G, out, r) take one scale per tensor."""
    per_tensor = [scales] if isinstance(scales, (int, float)) else list(scales)
    if len(set(per_tensor)) == 1:  # one scale (global sigma): the same M numbers for every group, copied once
        per_tensor = per_tensor[:1]
    alphas = on_device([sign * (scale / math.sqrt(rank)) for sign in signs for scale in per_tensor], a.device)
    return torch.mul(a, alphas.view(len(signs), *([len(per_tensor)] if a.dim() == 4 else []), 1, 1), out=out)


def on_device(values: Sequence[float], device: torch.device | str) -> torch.Tensor:
    """These numbers as an fp32 tensor on `device`, copied there once per distinct list: a host-to-GPU copy of a
    Python list waits for the GPU to finish its queue, and a load or an update used one per matrix (196 syncs each
    on a 1.5B model). The tensor is shared: do not modify it."""
    return _on_device(tuple(float(v) for v in values), torch.device(device))


@functools.lru_cache(maxsize=16)
def _on_device(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


# -- the gradient ---------------------------------------------------------------------------------------------
def folded_coefficients(members: Sequence[Member], weights: torch.Tensor) -> dict[int, float]:
    """seed -> sum of sign_i * w_i over members sharing that seed (antithetic pairs fold into one draw)."""
    if weights.numel() != len(members):
        raise ValueError(f"{weights.numel()} fitness weights for {len(members)} members")
    coef: dict[int, float] = defaultdict(float)
    for m, w in zip(members, weights.reshape(-1).tolist()):
        coef[m.seed] += m.sign * w
    return {s: c for s, c in coef.items() if c != 0.0}


def gaussian_gradient(coef: dict[int, float], n: int, tensor_index: int, shape: Sequence[int],
                      device: torch.device | str, generator: torch.Generator | None = None, *,
                      reuse: bool = False) -> torch.Tensor:
    """(1/N) sum_k c_k eps_k for full Gaussian noise in fp32. Whole weights (full mode) are drawn and accumulated seed
    by seed, one tensor in memory; small ones (`reuse`: lora's adapters) as gaussian_gradients does."""
    if reuse:
        return gaussian_gradients(coef, n, (tensor_index,), shape, device, generator)[0]
    g = torch.zeros(tuple(shape), dtype=torch.float32, device=device)
    for seed, c in coef.items():
        g.add_(gaussian(seed, tensor_index, shape, device, generator), alpha=c)
    return g.div_(n)


def gaussian_gradients(coef: dict[int, float], n: int, tensor_indices: Sequence[int], shape: Sequence[int],
                       device: torch.device | str, generator: torch.Generator | None = None) -> torch.Tensor:
    """gaussian_gradient of a group of small same-shape tensors (lora's adapters, whose draws drawn_once kept since
    the load), (G, *shape): one (K) @ (K, G numel) product, not K launches per tensor (lora on a 1.5B model: 392 x
    15 before)."""
    if not coef:
        return torch.zeros(len(tensor_indices), *shape, dtype=torch.float32, device=device)
    eps = gaussian_groups(list(coef), tensor_indices, shape, device, generator)
    c = on_device(list(coef.values()), device)
    return (c @ eps.reshape(len(coef), -1)).view(len(tensor_indices), *shape).div_(n)


def lowrank_gradient(coef: dict[int, float], n: int, tensor_index: int, shape: Sequence[int], rank: int,
                     device: torch.device | str, generator: torch.Generator | None = None) -> torch.Tensor:
    """(1/N) sum_k c_k A_k B_k^T / sqrt(r) in fp32, as one (out x Kr) @ (Kr x in) matmul (no per-member matrix)."""
    return lowrank_gradients(coef, n, (tensor_index,), shape, rank, device, generator)[0]


def lowrank_gradients(coef: dict[int, float], n: int, tensor_indices: Sequence[int], shape: Sequence[int],
                      rank: int, device: torch.device | str, generator: torch.Generator | None = None) -> torch.Tensor:
    """lowrank_gradient of a group of same-shape tensors, (G, out, in) fp32: one batched product (on a GPU a handful
    of launches for the group, not per tensor). The factors are drawn as the load drew them (the same group)."""
    if not coef:
        return torch.zeros(len(tensor_indices), *shape, dtype=torch.float32, device=device)
    fa, fb = factor_groups(list(coef), tensor_indices, shape, rank, device, generator)  # (K, G, out|in, r)
    c = on_device(list(coef.values()), device).view(-1, 1, 1, 1)
    a = (fa * c).permute(1, 2, 0, 3).flatten(2)  # (G, out, K r): diag(c) A
    b = fb.permute(1, 2, 0, 3).flatten(2)  # (G, in, K r)
    return torch.bmm(a, b.transpose(1, 2)).div_(math.sqrt(rank) * n)
