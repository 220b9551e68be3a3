"""ES noise on a GPU: standard normals as a pure function of (key, stream, element), many draws in one launch.

torch's CUDA generator makes one draw per seeded launch, and an ES iteration makes thousands of small seeded draws
(lowrank factors: 196 matrices x 30 members x 2 on a 1.5B model): each a launch plus host work, 0.31 s per lowrank
iteration's load on an H100, 15% of the recorded floor's 2.0 s generate (RESULTS, session 13; 0.09 s with this).
Triton's counter-based Philox (`tl.randn(key, counter)`) makes element k of stream s under a key a function of
(key, s, k) alone (counter = s * 2^32 + k), so the draws of many keys and streams made in one launch equal the same
draws made one by one, on any chunking: a chunk's members on a whole group of same-shape matrices (streams offset by
their tensor indices) are one launch (a 1.5B model's load: 13 launches, not 196). esrl.es.noise uses it on CUDA
(and under Triton's interpreter, which is how the CPU tests check it); CPU runs keep torch's generator. Plain torch +
Triton.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from esrl.es.lowrank_kernel import INTERPRETED, triton

if triton is not None:
    import triton.language as tl

    # the sizes and streams change with every matrix: one compile for all of them, not one per divisibility class
    @triton.jit(do_not_specialize=["n_keys", "n_groups", "stream0", "size0", "stream1", "size1"])
    def _normal_draws(out_ptr, keys_ptr, offsets_ptr, n_keys, n_groups, stream0, size0, stream1, size1,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Program (c, i, q), q = p * n_groups + g: chunk c of part p's row (i, g) = randn(keys[i], (stream_p +
        offsets[g]) * 2^32 + k) for k in the chunk; part 0's slab (n_keys x n_groups x size0 numbers) first, then
        part 1's."""
        c = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1).to(tl.int64)
        q = tl.program_id(2)
        p = (q // n_groups).to(tl.int64)
        g = (q % n_groups).to(tl.int64)
        key = tl.load(keys_ptr + i)
        size = tl.where(p == 0, size0, size1).to(tl.int64)
        stream = tl.where(p == 0, stream0, stream1).to(tl.int64) + tl.load(offsets_ptr + g)
        start = p * n_keys * n_groups * size0 + (i * n_groups + g) * size
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


def normal_slabs(keys: Sequence[int], parts: Sequence[tuple[int, int]], device: torch.device | str,
                 offsets: Sequence[int] = (0,)) -> list[torch.Tensor]:
    """One fp32 slab (len(keys), len(offsets) * size) per (stream, size) part (one or two), in one launch: row i,
    block g under keys[i] and stream + offsets[g] (a group of same-shape tensors, offsets their tensor indices)."""
    streams = [s + o for s, _ in parts for o in offsets]
    if not 1 <= len(parts) <= 2 or not offsets or any(not 0 <= s < 2**32 for s in streams) \
            or any(not 0 <= n < 2**32 for _, n in parts):
        raise ValueError(f"one or two (stream, size) parts, each stream + offset and size below 2^32, got {parts} "
                         f"with offsets {tuple(offsets)[:4]}")
    (s0, n0), (s1, n1) = parts[0], parts[-1]
    rows, groups = len(keys), len(offsets)
    out = torch.empty(rows * groups * sum(n for _, n in parts), dtype=torch.float32, device=device)
    if rows and out.numel():
        device = torch.device(device)
        grid = (triton.cdiv(max(n0, n1), _CHUNK), rows, len(parts) * groups)  # a whole-tensor draw spreads out
        _normal_draws[grid](out, _int64_on(tuple(keys), device), _int64_on(tuple(offsets), device), rows, groups,
                            s0, n0, s1, n1, **LAUNCH)
    first = rows * groups * n0
    return [out[:first].view(rows, groups * n0)] + ([out[first:].view(rows, groups * n1)] if len(parts) == 2 else [])


@functools.lru_cache(maxsize=64)
def _int64_on(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The keys or offsets as int64 on `device`, copied once per distinct tuple (a chunk's member seeds serve every
    group, a group's tensor indices every iteration)."""
    return torch.tensor(values, dtype=torch.int64, device=device)
