"""ys[i] += A_m (B_m^T x[i]) for member-major rows: one GPU kernel per perturbed linear (Triton), torch elsewhere.

A recorded (CUDA-graph) decode step still pays ~2-4 us per kernel however small its work. The torch ops for this
term (then a product, a sum and an addcmul at rank 1; two batched GEMMs else) were 2-3 launches per perturbed linear,
and a 1.5B model has 196 of them: +37% on the decode step (H100, benchmarks/gpu/decode_profile.py). The kernel reads x,
the member's factors and ys once, accumulates in fp32 and rounds once; it has no atomics, so it repeats bit for bit.
ES lowrank (A, B: the member's noise factors) and lora (A: lora_A, B^T: scaling * lora_B of the member's adapter)
use it. Linears that read the same x (an attention's q, k and v) can share one launch (`lowrank_add_linears_`;
esrl.es.shared_inputs says when a model allows it): the grid's second axis picks the linear, each program is the
one-linear program, so the sums are the same bit for bit, and a layer pays one launch for the three.

One program per row and block of outputs: x.B by elementwise products, then the rank's outputs. At lora's rank 8 a
tiled kernel (one program per member and block of rows, both products by tl.dot, each factor read once per block of
rows) was 4-12x slower per gate_proj call on an H100 in every variant tried (fp32, 3xTF32, broadcast FMA; with fp32,
lora's decode step took 4.3x as long), and a kernel taking 4 or 8 rows of a member per program (its factors read
once for them) 2x slower over a decode step's 196 calls (RESULTS, session 18): the factors re-read per row come
from L2, and these kernels' fewer programs or fp32 tile products cost more. Session 22 tried two more at rank 8 (bf16):
a [rows, rank, in] product for 4-16 rows of a member per program (2.9 ms a step at best against 1.3 ms), and this
kernel looping over 2-8 rows of a member per program so later rows find the factors in L1 (1.57 ms at best): a
decode step's program is latency-bound, and a longer chain per program costs more than the L2 reads it saves.
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
    def _lowrank_rows(xs_ptr, rows_per_member, n_in, xs_stride, blocks,
                      ys0, bt0, at0, n_out0, ys_stride0, ys1, bt1, at1, n_out1, ys_stride1,
                      ys2, bt2, at2, n_out2, ys_stride2,
                      RANK: tl.constexpr, RANKS: tl.constexpr, BLOCK_IN: tl.constexpr, BLOCK_OUT: tl.constexpr,
                      LINEARS: tl.constexpr, ADD: tl.constexpr):
        """One program: one row, one block of outputs of one of LINEARS (1-3) linears that read the same x (q, k
        and v: one launch for three; esrl.es.shared_inputs). c = B^T x for all r at once (a [RANKS, BLOCK_IN] tile
        per step over `in`), then ys[cols] += sum_r c_r A[r, cols], or with ADD false ys[cols] = the sum (fp32 ys: the
        term alone, for an add after the base GEMM). RANKS: RANK rounded up to a power of two."""
        row = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        ys_ptr, bt_ptr, at_ptr, n_out, ys_stride = ys0, bt0, at0, n_out0, ys_stride0
        if LINEARS > 1:
            which = block // blocks
            block = block % blocks
            if which == 1:
                ys_ptr, bt_ptr, at_ptr, n_out, ys_stride = ys1, bt1, at1, n_out1, ys_stride1
            if LINEARS > 2:
                if which == 2:
                    ys_ptr, bt_ptr, at_ptr, n_out, ys_stride = ys2, bt2, at2, n_out2, ys_stride2
        factor = (row // rows_per_member) * RANK + tl.arange(0, RANKS)
        rank_ok = tl.arange(0, RANKS) < RANK
        cols = block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        col_ok = cols < n_out
        a_ptrs, a_ok = at_ptr + factor[:, None] * n_out + cols[None, :], rank_ok[:, None] & col_ok[None, :]
        ys_row = ys_ptr + row * ys_stride
        dots = tl.zeros([RANKS, BLOCK_IN], dtype=tl.float32)
        for start in range(0, n_in, BLOCK_IN):
            k = start + tl.arange(0, BLOCK_IN)
            k_ok = k < n_in
            x = tl.load(xs_ptr + row * xs_stride + k, mask=k_ok, other=0.0).to(tl.float32)
            b = tl.load(bt_ptr + factor[:, None] * n_in + k[None, :], mask=rank_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            dots += b * x[None, :]
        c = tl.sum(dots, axis=1)
        a = tl.load(a_ptrs, mask=a_ok, other=0.0)
        if ADD:
            y = tl.load(ys_row + cols, mask=col_ok, other=0.0)
            acc = y.to(tl.float32) + tl.sum(a.to(tl.float32) * c[:, None], axis=0)
        else:
            acc = tl.sum(a.to(tl.float32) * c[:, None], axis=0)
        tl.store(ys_row + cols, acc.to(ys_ptr.dtype.element_ty), mask=col_ok)

    @triton.jit
    def _add_terms(ys0, ts0, n0, ys1, ts1, n1, ys2, ts2, n2, BLOCK: tl.constexpr, LINEARS: tl.constexpr):
        """ys[i] += ts[i] (fp32) for one of LINEARS (1-3) contiguous outputs, the grid's second axis picking it: the
        kernel's last step (y + term in fp32, rounded once), for terms computed apart (add_terms_)."""
        ys_ptr, ts_ptr, n = ys0, ts0, n0
        if LINEARS > 1:
            which = tl.program_id(1)
            if which == 1:
                ys_ptr, ts_ptr, n = ys1, ts1, n1
            if LINEARS > 2:
                if which == 2:
                    ys_ptr, ts_ptr, n = ys2, ts2, n2
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        y = tl.load(ys_ptr + offs, mask=ok, other=0.0)
        t = tl.load(ts_ptr + offs, mask=ok, other=0.0)
        tl.store(ys_ptr + offs, (y.to(tl.float32) + t).to(ys_ptr.dtype.element_ty), mask=ok)


MAX_LINEARS = 3
"""Linears one launch takes (q, k and v of an attention layer)."""
KERNEL_ROWS = 64
"""Rows per member up to which a GPU adds the terms with the kernel at ranks above 1: a decode step's (one a prompt).
A prefill's (prompts x tokens) take the torch ops there: at lora's rank 8 (bf16) a 1.5B prefill's terms at 64 tokens
took the per-row kernel 74 ms and the batched GEMMs 29 ms, which read a member's factors once (H100, session 22). At
rank 1 the kernel's per-row factor reads cost no more than the row's own x and y: 25.5 ms against the torch ops'
43 ms, so rank 1 takes the kernel at any rows."""


def kernel_takes(rank: int, rows_per_member: int) -> bool:
    """Whether a GPU adds terms of this rank with the kernel (else the torch ops): KERNEL_ROWS' rule."""
    return rows_per_member <= KERNEL_ROWS or rank == 1


def launch_plan(rank: int, rows_per_member: int, n_outs: tuple[int, ...], tiles: dict | None = None,
                add: bool = True):
    """(kernel, grid as a function of the member count, compile-time constants, launch options) for one launch over
    the linears whose output sizes are `n_outs` (1 to MAX_LINEARS, one input). The one definition of the block
    sizes: lowrank_add_ launches it, tests/test_kernel_build.py compiles it for sm_80 and sm_90 (no spills),
    benchmarks/gpu/lowrank_tiles.py times overrides: `tiles` may set BLOCK_IN, BLOCK_OUT and num_warps. The grid's
    second axis: each linear's blocks of outputs (as many as the widest one's), linear by linear."""
    # the fastest without spills on an H100 at decode, rank 1 (lowrank) and 8 (lora); RESULTS, session 18. The A tile
    # is RANKS x BLOCK_OUT fp32 values in registers: at most 32k (256 threads, 128 each) at higher ranks
    ranks = max(2, triton.next_power_of_2(rank))
    t = {"BLOCK_IN": min(2048, 8192 // ranks), "BLOCK_OUT": min(4096, 32768 // ranks),
         "num_warps": 8 if ranks >= 8 else 4, **(tiles or {})}
    warps = t.pop("num_warps")
    blocks = triton.cdiv(max(n_outs), t["BLOCK_OUT"])
    grid = lambda m: (m * rows_per_member, len(n_outs) * blocks)
    return _lowrank_rows, grid, {"RANK": rank, "RANKS": ranks, "LINEARS": len(n_outs), "ADD": add, **t}, {
        "num_warps": warps}


def row_major(factors: torch.Tensor) -> torch.Tensor:
    """A copy of factors (M, r, n) with row-major strides, the layout lowrank_add_ reads. At r = 1 the transpose of
    an (M, n, 1) tensor already counts as contiguous (a size-1 dim's stride is ignored), so `.contiguous()` keeps
    it, and lowrank_add_'s transpose of that sends the CPU's batched GEMV down BLAS's untransposed route: 3.5-7x
    slower per hook call (RESULTS, session 12)."""
    return factors.clone(memory_format=torch.contiguous_format)


def lowrank_add_(ys: torch.Tensor, xs: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor,
                 tiles: dict | None = None) -> None:
    """ys (M, n, out) += (xs (M, n, in) b_t^T) a_t in place, with a_t (M, r, out) and b_t (M, r, in) row-major
    (`row_major`). `tiles`: block sizes for benchmarks (launch_plan); given, the kernel runs at any n."""
    lowrank_add_linears_([(ys, a_t, b_t)], xs, tiles)


def lowrank_add_linears_(terms: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], xs: torch.Tensor,
                         tiles: dict | None = None, add: bool = True) -> None:
    """lowrank_add_ for linears that read the same xs, each (ys, a_t, b_t) of one rank and dtypes: one kernel launch
    for up to MAX_LINEARS of them on a GPU (the same sums as one launch each) up to KERNEL_ROWS rows per member (at
    rank 1 at any rows), the torch ops one linear at a time elsewhere. A torch.compile'd step calls the kernel as it is
    (products and sums for Inductor to fuse instead were slower for lora on an H100, 1.87x the fused floor against the
    kernel's 1.34x, and not bit-repeatable: RESULTS, session 28). `add` false: each ys (fp32) gets the term alone,
    written, not added (StaticPopulation.overlap adds it to the base output later: the kernel's sums, one rounding)."""
    if len({(ys.dtype, a_t.dtype, b_t.dtype, a_t.shape[1]) for ys, a_t, b_t in terms}) > 1:  # one kernel build each
        for term in terms:
            lowrank_add_linears_([term], xs, tiles, add)
        return
    m, n = terms[0][0].shape[:2]
    rank = terms[0][1].shape[1]
    on_kernel = triton is not None and (terms[0][0].is_cuda or INTERPRETED) and (
        kernel_takes(rank, n) or tiles is not None)
    if on_kernel and all(t[0].is_contiguous() for t in terms):
        xs = xs.reshape(m * n, xs.shape[-1])
        if xs.stride(-1) != 1:
            xs = xs.contiguous()
        for start in range(0, len(terms), MAX_LINEARS):
            part = terms[start:start + MAX_LINEARS]
            n_outs = tuple(ys.shape[-1] for ys, _, _ in part)
            kernel, grid, consts, options = launch_plan(rank, n, n_outs, tiles, add)
            # unused slots: None (a compile-time constant), not a used tensor again: under torch.compile an aliased
            # argument that Inductor takes as mutated could be copied back over the kernel's result
            slots = [(ys, b_t, a_t, ys.shape[-1], ys.shape[-1]) for ys, a_t, b_t in part]
            slots += [(None,) * len(slots[0])] * (MAX_LINEARS - len(part))
            per_linear = [v for slot in slots for v in slot]
            blocks = grid(1)[1] // len(part)  # of outputs per linear
            kernel[grid(m)](xs, n, xs.shape[-1], xs.stride(0), blocks, *per_linear, **consts, **options)
        return
    for ys, a_t, b_t in terms:
        if add:
            _torch_add_(ys, xs, a_t, b_t)
        else:  # the term alone in fp32 (a CPU's tests of the overlap's bookkeeping; a GPU takes the kernel)
            torch.bmm(torch.bmm(xs.to(a_t.dtype), b_t.transpose(1, 2)).float(), a_t.float(), out=ys)


ADD_BLOCK = 2048
"""Elements per program of add_terms_ (8 per thread at 8 warps)."""


def add_plan(n_outs: tuple[int, ...]):
    """(kernel, grid, compile-time constants, launch options) of add_terms_ for outputs of `n_outs` elements (1 to
    MAX_LINEARS); tests/test_kernel_build.py compiles it."""
    grid = (triton.cdiv(max(n_outs), ADD_BLOCK), len(n_outs))
    return _add_terms, grid, {"BLOCK": ADD_BLOCK, "LINEARS": len(n_outs)}, {"num_warps": 8}


def add_terms_(outs: list[torch.Tensor], terms: list[torch.Tensor]) -> None:
    """outs[i] += terms[i] (fp32 terms, lowrank_add_linears_'s with add false): on a GPU one launch for up to
    MAX_LINEARS of them, the same numbers as the kernel's in-place add; torch's add_ elsewhere (the same rounding)."""
    if triton is None or not (outs[0].is_cuda or INTERPRETED) or not all(y.is_contiguous() for y in outs):
        for y, t in zip(outs, terms):
            y.add_(t.view(y.shape))
        return
    for start in range(0, len(outs), MAX_LINEARS):
        part = list(zip(outs[start:start + MAX_LINEARS], terms[start:start + MAX_LINEARS]))
        kernel, grid, consts, options = add_plan(tuple(y.numel() for y, _ in part))
        slots = [(y, t, y.numel()) for y, t in part] + [(None, None, None)] * (MAX_LINEARS - len(part))
        kernel[grid](*[v for slot in slots for v in slot], **consts, **options)


def _torch_add_(ys: torch.Tensor, xs: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor) -> None:
    if a_t.dtype != ys.dtype:  # fp32 factors (lora on base layers of mixed dtypes): compute there, add once
        ys.add_(torch.bmm(torch.bmm(xs.to(a_t.dtype), b_t.transpose(1, 2)), a_t).to(ys.dtype))
    elif a_t.shape[1] == 1:  # rank 1: x.b as a batched GEMV, then one broadcast multiply-add, no (M, n, in) product
        # (b_t's transposed view, not a reshaped (M, in, 1) copy: BLAS's transposed path is 2.6-7x faster on a CPU
        # for these shapes and closer to the fp64 sum; RESULTS, Session 11)
        ys.addcmul_(torch.bmm(xs, b_t.transpose(1, 2)), a_t)
    else:
        ys.baddbmm_(torch.bmm(xs, b_t.transpose(1, 2)), a_t)
