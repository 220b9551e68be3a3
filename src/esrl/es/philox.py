"""ES noise on a GPU: standard normals as a pure function of (key, stream, element), many draws in one launch.

torch's CUDA generator makes one draw per seeded launch, and an ES iteration makes thousands of small seeded draws
(lowrank factors: 196 matrices x 30 members x 2 on a 1.5B model): each a launch plus host work, 0.31 s per lowrank
iteration's load on an H100, 15% of the recorded floor's 2.0 s generate (RESULTS, session 13; 0.09 s with this). Triton's counter-based Philox
(`tl.randn(key, counter)`) makes element k of stream s under a key a function of (key, s, k) alone (counter =
s * 2^32 + k), so the draws of many keys and streams made in one launch equal the same draws made one by one, on
any chunking. esrl.es.noise uses it on CUDA (and under Triton's interpreter, which is how the CPU tests check it);
CPU runs keep torch's generator. Plain torch + Triton.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from esrl.es.lowrank_kernel import INTERPRETED, triton

if triton is not None:
    import triton.language as tl

    # the sizes and streams change with every matrix: one compile for all of them, not one per divisibility class
    @triton.jit(do_not_specialize=["n_keys", "stream0", "size0", "stream1", "size1"])
    def _normal_draws(out_ptr, keys_ptr, n_keys, stream0, size0, stream1, size1, CHUNK: tl.constexpr,
                      BLOCK: tl.constexpr):
        """Program (c, i, p): chunk c of part p's row i = randn(keys[i], stream_p * 2^32 + k) for k in the chunk;
        part 0's slab (n_keys x size0 numbers) first, then part 1's."""
        c = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1).to(tl.int64)
        p = tl.program_id(2)
        key = tl.load(keys_ptr + i)
        size = tl.where(p == 0, size0, size1).to(tl.int64)
        stream = tl.where(p == 0, stream0, stream1).to(tl.int64)
        start = p * n_keys * size0 + i * size
        for s in range(0, CHUNK, BLOCK):
            k = c * CHUNK + s + tl.arange(0, BLOCK).to(tl.int64)
            tl.store(out_ptr + start + k, tl.randn(key, (stream << 32) + k), mask=k < size)


_CHUNK = 4096  # numbers per program
LAUNCH = {"CHUNK": _CHUNK, "BLOCK": 1024, "enable_fp_fusion": True}
"""The draw kernel's constants and options. FP fusion (multiply-adds fused in tl.randn's Box-Muller) is pinned, not
left to Triton's default, which Triton 3.10 turns off: the same seed must give the same noise after an upgrade, or a
seed log would replay other updates."""


def available(device: torch.device | str) -> bool:
    """True where esrl's noise is these draws: CUDA devices with Triton, or any device under Triton's interpreter."""
    return triton is not None and (torch.device(device).type == "cuda" or INTERPRETED)


def normal_slabs(keys: Sequence[int], parts: Sequence[tuple[int, int]], device: torch.device | str
                 ) -> list[torch.Tensor]:
    """One fp32 slab (len(keys), size) per (stream, size) part (one or two), row i under keys[i]: one launch."""
    if not 1 <= len(parts) <= 2 or any(not 0 <= s < 2**32 or not 0 <= n < 2**32 for s, n in parts):
        raise ValueError(f"one or two (stream, size) parts, each below 2^32, got {parts}")
    (s0, n0), (s1, n1) = parts[0], parts[-1]
    rows = len(keys)
    out = torch.empty(rows * sum(n for _, n in parts), dtype=torch.float32, device=device)
    if rows and out.numel():
        grid = (triton.cdiv(max(n0, n1), _CHUNK), rows, len(parts))  # a whole-tensor draw spreads over the GPU
        _normal_draws[grid](out, _keys_on(tuple(keys), torch.device(device)), rows, s0, n0, s1, n1, **LAUNCH)
    return [out[:rows * n0].view(rows, n0)] + ([out[rows * n0:].view(rows, n1)] if len(parts) == 2 else [])


@functools.lru_cache(maxsize=16)
def _keys_on(keys: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The keys as int64 on `device`, copied once per distinct tuple (a chunk's member seeds serve every matrix)."""
    return torch.tensor(keys, dtype=torch.int64, device=device)
