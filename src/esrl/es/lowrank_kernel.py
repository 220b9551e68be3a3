"""ys[i] += A_m (B_m^T x[i]) for member-major rows: one GPU kernel per perturbed linear (Triton), torch elsewhere.

A recorded (CUDA-graph) decode step still pays ~2-4 us per kernel however small its work. The torch ops for this
term (then a product, a sum and an addcmul at rank 1; two batched GEMMs else) were 2-3 launches per perturbed linear,
and a 1.5B model has 196 of them: +37% on the decode step (H100, benchmarks/gpu/decode_profile.py). The kernel reads x,
the member's factors and ys once, accumulates in fp32 and rounds once; it has no atomics, so it repeats bit for bit.
ES lowrank (A, B: the member's noise factors) and lora (A: lora_A, B^T: scaling * lora_B of the member's adapter) use it.

Two kernels, one sum. Rank 1-3 (lowrank's): one program per row and block of outputs, x.B by elementwise products.
Rank >= 4 (lora's 8): one program per member, block of its rows and block of outputs, both products by tl.dot: the
per-row kernel re-read the member's factors for every row (rank 8, fp32 factors: a 1.5B model's down_proj read B,
287 kB, 480 times per decode step; 2.33 ms of lora's decode step on an H100, RESULTS session 13), the tile reads them
once per block of rows.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch ops below
    triton = None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter runs the kernel on CPU tensors too (slowly): how the CPU tests check the GPU kernel's math."""

if triton is not None:
    @triton.jit
    def _lowrank_rows(ys_ptr, xs_ptr, bt_ptr, at_ptr, rows_per_member, n_in, n_out, ys_stride, xs_stride,
                      RANK: tl.constexpr, RANKS: tl.constexpr, BLOCK_IN: tl.constexpr, BLOCK_OUT: tl.constexpr):
        """One program: one row, one block of outputs. c = B^T x for all r at once (a [RANKS, BLOCK_IN] tile per
        step over `in`), then ys[cols] += sum_r c_r A[r, cols]. RANKS: RANK rounded up to a power of two."""
        row = tl.program_id(0).to(tl.int64)
        factor = (row // rows_per_member) * RANK + tl.arange(0, RANKS)
        rank_ok = tl.arange(0, RANKS) < RANK
        dots = tl.zeros([RANKS, BLOCK_IN], dtype=tl.float32)
        for start in range(0, n_in, BLOCK_IN):
            k = start + tl.arange(0, BLOCK_IN)
            k_ok = k < n_in
            x = tl.load(xs_ptr + row * xs_stride + k, mask=k_ok, other=0.0).to(tl.float32)
            b = tl.load(bt_ptr + factor[:, None] * n_in + k[None, :], mask=rank_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            dots += b * x[None, :]
        c = tl.sum(dots, axis=1)
        cols = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        col_ok = cols < n_out
        a = tl.load(at_ptr + factor[:, None] * n_out + cols[None, :], mask=rank_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        ys_row = ys_ptr + row * ys_stride
        acc = tl.load(ys_row + cols, mask=col_ok, other=0.0).to(tl.float32) + tl.sum(a * c[:, None], axis=0)
        tl.store(ys_row + cols, acc.to(ys_ptr.dtype.element_ty), mask=col_ok)


    @triton.jit
    def _lowrank_tiles(ys_ptr, xs_ptr, bt_ptr, at_ptr, rows_per_member, n_in, n_out, ys_stride, xs_stride,
                       RANK: tl.constexpr, RANKS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_IN: tl.constexpr,
                       BLOCK_OUT: tl.constexpr):
        """One program: one member, BLOCK_ROWS of its rows, BLOCK_OUT outputs. C = X B (BLOCK_ROWS x RANKS) over `in`,
        then Y[:, cols] += C A[:, cols]; fp32 products (input_precision ieee: no TF32), one rounding per output.
        RANKS: RANK rounded up to a power of two >= 16, tl.dot's smallest side."""
        member = tl.program_id(0).to(tl.int64)
        local = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = local < rows_per_member
        rows = member * rows_per_member + local
        rank_ok = tl.arange(0, RANKS) < RANK
        factor = member * RANK + tl.arange(0, RANKS)
        c = tl.zeros([BLOCK_ROWS, RANKS], dtype=tl.float32)
        for start in range(0, n_in, BLOCK_IN):
            k = start + tl.arange(0, BLOCK_IN)
            k_ok = k < n_in
            x = tl.load(xs_ptr + rows[:, None] * xs_stride + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            b = tl.load(bt_ptr + factor[None, :] * n_in + k[:, None], mask=k_ok[:, None] & rank_ok[None, :],
                        other=0.0).to(tl.float32)
            c = tl.dot(x, b, c, input_precision="ieee")
        cols = tl.program_id(2) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        col_ok = cols < n_out
        a = tl.load(at_ptr + factor[:, None] * n_out + cols[None, :], mask=rank_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        where = ys_ptr + rows[:, None] * ys_stride + cols[None, :]
        ok = row_ok[:, None] & col_ok[None, :]
        acc = tl.dot(c, a, tl.load(where, mask=ok, other=0.0).to(tl.float32), input_precision="ieee")
        tl.store(where, acc.to(ys_ptr.dtype.element_ty), mask=ok)


TILED_FROM_RANK = 4
"""Ranks from here take the tiled kernel (tl.dot pads the rank to 16, so ranks 1-3 would mostly multiply zeros)."""


def launch_plan(rank: int, rows_per_member: int, n_out: int, tiles: dict | None = None):
    """(kernel, grid as a function of the member count, compile-time constants, launch options) for one product.
    The one definition of the block sizes: lowrank_add_ launches it, tests/test_kernel_build.py compiles it for
    sm_80 and sm_90 (no spills), benchmarks/gpu/lowrank_tiles.py times overrides: `tiles` may set "tiled" (which
    kernel) and its BLOCK_* sizes and num_warps."""
    t = dict(tiles or {})
    if t.pop("tiled", rank >= TILED_FROM_RANK):
        t = {"BLOCK_ROWS": 16, "BLOCK_IN": 128, "BLOCK_OUT": 512, "num_warps": 8, **t}
        grid = lambda m: (m, triton.cdiv(rows_per_member, t["BLOCK_ROWS"]), triton.cdiv(n_out, t["BLOCK_OUT"]))
        kernel, ranks = _lowrank_tiles, max(16, triton.next_power_of_2(rank))
    else:
        ranks = max(2, triton.next_power_of_2(rank))  # tiles of <= 8k fp32 values:
        t = {"BLOCK_IN": max(128, 4096 // ranks), "BLOCK_OUT": max(256, 8192 // ranks), "num_warps": 4, **t}
        grid = lambda m: (m * rows_per_member, triton.cdiv(n_out, t["BLOCK_OUT"]))
        kernel = _lowrank_rows
    warps = t.pop("num_warps")
    return kernel, grid, {"RANK": rank, "RANKS": ranks, **t}, {"num_warps": warps}


def row_major(factors: torch.Tensor) -> torch.Tensor:
    """A copy of factors (M, r, n) with row-major strides, the layout lowrank_add_ reads. At r = 1 the transpose of
    an (M, n, 1) tensor already counts as contiguous (a size-1 dim's stride is ignored), so `.contiguous()` keeps
    it, and lowrank_add_'s transpose of that sends the CPU's batched GEMV down BLAS's untransposed route: 3.5-7x
    slower per hook call (RESULTS, session 12)."""
    return factors.clone(memory_format=torch.contiguous_format)


def lowrank_add_(ys: torch.Tensor, xs: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor,
                 tiles: dict | None = None) -> None:
    """ys (M, n, out) += (xs (M, n, in) b_t^T) a_t in place, with a_t (M, r, out) and b_t (M, r, in) row-major
    (`row_major`). `tiles`: block sizes for benchmarks (launch_plan)."""
    if triton is not None and (ys.is_cuda or INTERPRETED) and ys.is_contiguous():
        m, n, n_out = ys.shape
        xs = xs.reshape(m * n, xs.shape[-1])
        if xs.stride(-1) != 1:
            xs = xs.contiguous()
        kernel, grid, consts, options = launch_plan(a_t.shape[1], n, n_out, tiles)
        kernel[grid(m)](ys, xs, b_t, a_t, n, xs.shape[-1], n_out, n_out, xs.stride(0), **consts, **options)
        return
    if a_t.dtype != ys.dtype:  # factors kept in fp32 (lora adapters): compute there, add once
        ys.add_(torch.bmm(torch.bmm(xs.to(a_t.dtype), b_t.transpose(1, 2)), a_t).to(ys.dtype))
    elif a_t.shape[1] == 1:  # rank 1: x.b as a batched GEMV, then one broadcast multiply-add, no (M, n, in) product
        # (b_t's transposed view, not a reshaped (M, in, 1) copy: BLAS's transposed path is 2.6-7x faster on a CPU
        # for these shapes and closer to the fp64 sum; RESULTS, Session 11)
        ys.addcmul_(torch.bmm(xs, b_t.transpose(1, 2)), a_t)
    else:
        ys.baddbmm_(torch.bmm(xs, b_t.transpose(1, 2)), a_t)
