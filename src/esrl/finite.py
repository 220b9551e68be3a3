"""Weights never become non-finite: the checks ES and GRPO run around every update (plain torch).

Before the step the gradient is checked (free: no copy, and a refused step leaves the weights exactly as they
were); after it the updated weights are checked too (one min/max reduction per tensor, one host sync), since a
finite step can still overflow a low-precision weight. Either failure stops the run (NonFiniteUpdateError): no
`final/` is written, and the last checkpoint holds the weights from before the step.
"""

from __future__ import annotations

from typing import Iterable

import torch

from esrl.errors import NonFiniteUpdateError


@torch.no_grad()
def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when every element of every tensor is finite (one reduction per tensor, one sync).

    A tensor's min and max are both finite exactly when all its elements are (torch.aminmax propagates NaN, and an
    inf is an extreme): one read of the tensor, no bool copy of it (isfinite().all() was 20x slower on a CPU and
    37% of a 135M model's ES update)."""
    extremes = [torch.stack(torch.aminmax(t.detach())).float() for t in tensors
                if t.is_floating_point() and t.numel()]
    if not extremes:
        return True
    return bool(torch.isfinite(torch.cat([e.to(extremes[0].device) for e in extremes])).all())


def check_gradient(grads: Iterable[torch.Tensor], *, algo: str, step: int) -> None:
    if not all_finite(grads):
        raise NonFiniteUpdateError(f"{algo} step {step}: the update is not finite (NaN/inf gradient); refused, "
                                   "the weights are unchanged; stopped without final/")


def check_weights(params: Iterable[torch.Tensor], *, algo: str, step: int) -> None:
    if not all_finite(params):
        raise NonFiniteUpdateError(f"{algo} step {step}: the update made weights non-finite (overflow in their "
                                   "dtype); stopped without final/ (the last checkpoint holds the weights from "
                                   "before this step)")
