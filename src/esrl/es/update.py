"""Perturb, restore and the ES update, tensor by tensor (plain torch).

Memory: one backup copy of the perturbed tensors, plus one noise tensor at a time.
Restore copies the backup back, so it is bit-exact whatever the dtype (subtracting the noise is not).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from esrl.es.modes import get_mode
from esrl.es.noise import (Member, NoiseSpec, folded_coefficients, generator_on, member_weight, on_device,
                           tensor_scale)
from esrl.es.params import ParamSelection
from esrl.finite import check_gradient, check_weights


class Perturber:
    """Applies one member's noise in place and restores the exact previous weights.

    The noise is the `spec`'s mode direction (default: full Gaussian with one global sigma, the paper's); in
    lowrank mode it materializes A B^T, the member-by-member reference of the batched hooks.
    """

    def __init__(self, selection: ParamSelection, spec: NoiseSpec | None = None):
        self.selection = selection
        self.spec = spec or NoiseSpec()
        self.mode = get_mode(self.spec.mode)
        self._backup: list[torch.Tensor] | None = None
        self._perturbed = 0  # how many tensors currently differ from the backup
        self._generator: torch.Generator | None = None

    @torch.no_grad()
    def perturb(self, member: Member, sigma: float | None = None) -> None:
        if self._perturbed:
            raise RuntimeError("perturb() called while the weights are already perturbed")
        if self._backup is None:
            self._backup = [torch.empty_like(p) for p in self.selection.params]
        for k, (j, _, p) in enumerate(self.selection):
            scale = tensor_scale(p, self.spec, sigma)  # from the unperturbed tensor
            self._backup[k].copy_(p)
            self._perturbed = k + 1
            self._generator = generator_on(p.device, self._generator)
            eps = self.mode.direction(member.seed, j, p, self.spec, self._generator)
            member_weight(p, eps, member.sign, scale, in_place=True)

    @torch.no_grad()
    def restore(self) -> None:
        assert self._backup is not None or not self._perturbed
        for k in range(self._perturbed):
            self.selection.params[k].copy_(self._backup[k])
        self._perturbed = 0

    @property
    def is_perturbed(self) -> bool:
        return self._perturbed > 0

    @contextmanager
    def perturbed(self, member: Member, sigma: float | None = None) -> Iterator[None]:
        """Weights carry the member's noise inside the block and are restored however it exits."""
        try:
            self.perturb(member, sigma)
            yield
        finally:
            self.restore()

    def free(self) -> None:
        """Drop the backup (it is as large as the perturbed weights) before the update allocates grads."""
        self._backup = None


@torch.no_grad()
def es_gradient_groups(selection: ParamSelection, members: Sequence[Member], weights: torch.Tensor,
                       spec: NoiseSpec | None = None) -> Iterator[tuple[list[torch.Tensor], torch.Tensor]]:
    """Yield (tensors, their g_j stacked on dim 0), g_j = (1/N) sum_i w_i sign_i (s_j / sigma) eps_ij in fp32: one
    tensor, or a group the mode batches (lowrank: same-shape matrices), at a time.

    Members that share a seed (antithetic pairs) are folded into one noise draw; eps is the spec's mode's.
    """
    spec = spec or NoiseSpec()
    coef = folded_coefficients(members, weights)
    for params, g in get_mode(spec.mode).gradients(coef, len(members), selection, spec):
        if spec.sigma_scaling != "global":
            ratios = on_device([tensor_scale(p, spec) / spec.sigma for p in params], g.device)
            g.mul_(ratios.view(-1, *([1] * (g.dim() - 1))))
        yield params, g


def es_gradient(selection: ParamSelection, members: Sequence[Member], weights: torch.Tensor,
                spec: NoiseSpec | None = None) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Yield (param, g_j) one tensor at a time (es_gradient_groups, unstacked)."""
    for params, g in es_gradient_groups(selection, members, weights, spec):
        yield from zip(params, g.unbind(0))


@torch.no_grad()
def set_es_grads(selection: ParamSelection, members: Sequence[Member], weights: torch.Tensor,
                 spec: NoiseSpec | None = None) -> None:
    """Store -g in .grad so that any torch optimizer, minimizing, ascends the fitness (one negation and one cast per
    group; each .grad a view of its group's).

    SGD(lr=alpha) then gives theta += alpha * g, the paper's update.
    """
    for params, g in es_gradient_groups(selection, members, weights, spec):
        for p, grad in zip(params, g.neg_().to(params[0].dtype).unbind(0)):
            p.grad = grad


def es_step(optimizer: torch.optim.Optimizer, selection: ParamSelection, members: Sequence[Member],
            weights: torch.Tensor, spec: NoiseSpec | None = None, step=None, iteration: int = 0) -> None:
    """grad = -g on every perturbed tensor, then ONE optimizer step, then the grads are dropped.

    `step` (Lightning's LightningOptimizer.step in training, so the precision and strategy plugins see the
    step) defaults to optimizer.step (seed-log replay): both make the same elementwise update. Memory: one
    gradient in the weights' dtype per perturbed tensor during the step, as for any optimizer. A non-finite g
    is refused before the step and non-finite weights after it stop the run (esrl.finite; `iteration` names it).
    """
    try:  # a failure part way through the gradient (an OOM drawing its noise) drops the grads set so far too
        set_es_grads(selection, members, weights, spec)
        check_gradient([p.grad for p in selection.params], algo="ES", step=iteration)
        (step or optimizer.step)()
    finally:
        for p in selection.params:
            p.grad = None
    check_weights(selection.params, algo="ES", step=iteration)


def weights_checksum(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """A bit-sensitive int64 checksum of the weights: any one-ulp drift between ranks changes it."""
    total = torch.zeros((), dtype=torch.int64)
    for k, p in enumerate(params):
        bits = p.detach().reshape(-1).view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[p.element_size()])
        total += (bits.sum() * (k + 1)).cpu()  # an integer sum is int64 (torch promotes it): no int64 copy
    return total
