"""A fingerprint of the base model's weights, kept in the seed log's header so `esrl export` can tell whether the
`--base` it is given is the model the run started from (replaying seeds on another model gives plausible but
wrong weights). Exact and device-independent: integer sums of the weights' bit patterns, plus a hash of the
parameter names, shapes and dtypes; computed in chunks, so it needs no copy of a whole tensor."""

from __future__ import annotations

import hashlib

import torch

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24  # elements converted to int64 at a time


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> str:
    """'<names/shapes/dtypes hash>-<bit checksum>' of every parameter of `model`, in its own dtype."""
    layout = hashlib.sha256()
    total = 0
    for k, (name, p) in enumerate(model.named_parameters()):
        layout.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        bits = p.detach().reshape(-1).view(_INT[p.element_size()])
        s = torch.zeros((), dtype=torch.int64, device=bits.device)
        for start in range(0, bits.numel(), _CHUNK):
            s += bits[start:start + _CHUNK].to(torch.int64).sum()
        total = (total + int(s) * (k + 1)) % (1 << 64)
    return f"{layout.hexdigest()[:12]}-{total:016x}"
