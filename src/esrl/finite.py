"""Weights never become non-finite: the checks ES and GRPO run around every update (plain torch).

Before the step the gradient is checked (free: no copy, and a refused step leaves the weights exactly as they
were); after it the updated weights are checked too (one fused isfinite-all per tensor, one host sync), since a
finite step can still overflow a low-precision weight. Either failure stops the run (NonFiniteUpdateError): no
`final/` is written, and the last checkpoint holds the weights from before the step.
"""

from __future__ import annotations

from typing import Iterable

import torch

from esrl.errors import NonFiniteUpdateError


@torch.no_grad()
def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when every element of every tensor is finite (one reduction per tensor, one sync)."""
    flags = [torch.isfinite(t).all() for t in tensors if t.is_floating_point()]
    if not flags:
        return True
    return bool(torch.stack([f.to(flags[0].device) for f in flags]).all())


def check_gradient(grads: Iterable[torch.Tensor], *, algo: str, step: int) -> None:
    if not all_finite(grads):
        raise NonFiniteUpdateError(f"{algo} step {step}: the update is not finite (NaN/inf gradient); refused, "
                                   "the weights are unchanged; stopped without final/")


def check_weights(params: Iterable[torch.Tensor], *, algo: str, step: int) -> None:
    if not all_finite(params):
        raise NonFiniteUpdateError(f"{algo} step {step}: the update made weights non-finite (overflow in their "
                                   "dtype); stopped without final/ (the last checkpoint holds the weights from "
                                   "before this step)")
