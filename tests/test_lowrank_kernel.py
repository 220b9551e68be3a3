"""esrl.es.lowrank_kernel's Triton kernel, checked on the CPU through Triton's interpreter (TRITON_INTERPRET=1).

On a GPU the kernel adds every row's member term in lowrank and lora decoding; tests/test_gpu.py checks it there. Here
the same kernel source runs in Triton's interpreter, in a child process (the variable must be set before Triton is
imported): its sums must lie within one rounding of the fp64 answer (the interpreter's bf16 rounding truncates),
repeat bit for bit, and agree with the torch path that CPU runs use. Masks are exercised: n_in and n_out are not
multiples of the kernel's blocks, and rank 3 pads to 4. This checks the math, not the speed (benchmarks/gpu/).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="Triton not installed (the kernel then never runs)")

# (rank, activation dtype, factor dtype, rows per member): factors in the model's dtype (lowrank; lora's static
# buffers), and fp32 factors on a bf16 model; rank 3 pads to 4 (masked rank lanes); 2 and 20 rows per member
CASES = [(1, torch.bfloat16, torch.bfloat16, 2), (3, torch.bfloat16, torch.bfloat16, 2),
         (8, torch.float32, torch.float32, 2), (8, torch.bfloat16, torch.bfloat16, 20),
         (8, torch.bfloat16, torch.float32, 20), (4, torch.bfloat16, torch.bfloat16, 20)]

CHILD = """
import sys, torch
from esrl.es.lowrank_kernel import INTERPRETED, lowrank_add_
assert INTERPRETED
cases = torch.load(sys.argv[1])
out = []
for ys, xs, a_t, b_t in cases:
    got, again = ys.clone(), ys.clone()
    lowrank_add_(got, xs, a_t, b_t)
    lowrank_add_(again, xs, a_t, b_t)
    out.append((got, again))
torch.save(out, sys.argv[2])
"""


def _inputs(rank, dtype, factor_dtype, m=3, n=2, n_in=300, n_out=1100):
    g = torch.Generator().manual_seed(rank)
    return (torch.randn(m, n, n_out, generator=g).to(dtype), torch.randn(m, n, n_in, generator=g).to(dtype),
            (torch.randn(m, rank, n_out, generator=g) * 0.1).to(factor_dtype),
            (torch.randn(m, rank, n_in, generator=g) * 0.1).to(factor_dtype))


def test_the_triton_kernel_in_the_interpreter_equals_the_fp64_sum_and_the_torch_path(tmp_path):
    from esrl.es.lowrank_kernel import INTERPRETED, lowrank_add_

    assert not INTERPRETED  # this process takes the torch path
    cases = [_inputs(*c) for c in CASES]
    torch.save(cases, tmp_path / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], env=env,
                   check=True, timeout=300)
    for (rank, dtype, _, _), (ys, xs, a_t, b_t), (got, again) in zip(CASES, cases, torch.load(tmp_path / "out.pt")):
        assert got.dtype == dtype and torch.equal(got, again), rank  # no atomics: bit for bit
        want = ys.double() + torch.bmm(torch.bmm(xs.double(), b_t.double().transpose(1, 2)), a_t.double())
        # summed in fp32, rounded once: the interpreter rounds to bf16 by truncation (within 2^-7; a GPU rounds to
        # nearest, 2^-8 in tests/test_gpu.py); fp32 sums of 300 products in another order stay within 1e-5
        tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
        assert ((got.double() - want).abs() <= want.abs() * tol + 1e-6).all(), rank
        torch_path = ys.clone()
        lowrank_add_(torch_path, xs, a_t, b_t)
        # the torch path rounds x.B to the activations' dtype first: both within a few roundings of the magnitudes
        scale = ys.double().abs() + torch.bmm(torch.bmm(xs.double().abs(), b_t.double().abs().transpose(1, 2)),
                                              a_t.double().abs())
        assert ((got.double() - torch_path.double()).abs() <= 3 * tol * scale + 1e-6).all(), rank
        assert not torch.equal(got, ys)  # the term was added


LINEARS_CHILD = """
import sys, torch
from esrl.es.lowrank_kernel import lowrank_add_, lowrank_add_linears_
xs, terms = torch.load(sys.argv[1])
one_by_one = [ys.clone() for ys, _, _ in terms]
for ys, (_, a_t, b_t) in zip(one_by_one, terms):
    lowrank_add_(ys, xs, a_t, b_t)
together = [ys.clone() for ys, _, _ in terms]
lowrank_add_linears_([(ys, a_t, b_t) for ys, (_, a_t, b_t) in zip(together, terms)], xs)
torch.save((one_by_one, together), sys.argv[2])
"""


@pytest.mark.parametrize("rank,dtype", [(1, torch.bfloat16), (8, torch.float32)])
def test_one_launch_for_linears_sharing_an_input_equals_one_launch_each(tmp_path, rank, dtype):
    """q, k and v in one launch (the grid's second axis picks the linear): each output is the one-launch-per-linear
    kernel's bit for bit, for widths that differ, one wider than a block of outputs at rank 8 (4096) and a fourth
    linear (a second launch)."""
    g = torch.Generator().manual_seed(rank)
    m, n, n_in = 3, 2, 300
    xs = torch.randn(m, n, n_in, generator=g).to(dtype)
    randn = lambda *shape: torch.randn(*shape, generator=g)
    terms = [(randn(m, n, n_out).to(dtype), (randn(m, rank, n_out) * 0.1).to(dtype),
              (randn(m, rank, n_in) * 0.1).to(dtype)) for n_out in (1100, 70, 5000, 33)]
    torch.save((xs, terms), tmp_path / "in.pt")
    subprocess.run([sys.executable, "-c", LINEARS_CHILD, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   env={**os.environ, "TRITON_INTERPRET": "1"}, check=True, timeout=300)
    one_by_one, together = torch.load(tmp_path / "out.pt")
    for (ys, _, _), want, got in zip(terms, one_by_one, together):
        assert torch.equal(got, want) and not torch.equal(got, ys), ys.shape


DISPATCH_CHILD = """
import sys, torch
from esrl.es.lowrank_kernel import KERNEL_ROWS, _torch_add_, lowrank_add_
out = {}
for n, rank in ((KERNEL_ROWS, 2), (KERNEL_ROWS + 1, 2), (KERNEL_ROWS + 1, 1)):
    g = torch.Generator().manual_seed(n)
    randn = lambda *shape: torch.randn(*shape, generator=g)
    ys, xs, a_t, b_t = randn(2, n, 70).bfloat16(), randn(2, n, 50).bfloat16(), randn(2, rank, 70), randn(2, rank, 50)
    a_t, b_t = (a_t * 0.1).bfloat16(), (b_t * 0.1).bfloat16()
    got, kernel, torch_ops = ys.clone(), ys.clone(), ys.clone()
    lowrank_add_(got, xs, a_t, b_t)
    lowrank_add_(kernel, xs, a_t, b_t, tiles={})  # block sizes given: the kernel at any n
    _torch_add_(torch_ops, xs, a_t, b_t)
    out[n, rank] = (torch.equal(got, kernel), torch.equal(got, torch_ops), torch.equal(kernel, torch_ops))
print(repr(out))
"""


def test_the_kernel_adds_up_to_kernel_rows_per_member_and_the_torch_ops_beyond_except_at_rank_1():
    """A decode step's rows (one a prompt, up to KERNEL_ROWS a member) take the kernel; a prefill's (prompts x
    tokens) the batched GEMMs, which read a member's factors once instead of once a row, except at rank 1, where
    those reads cost no more than the row's own x and y. The two round differently (the torch ops round x.B to bf16
    first), so the result says which ran."""
    from esrl.es.lowrank_kernel import KERNEL_ROWS

    done = subprocess.run([sys.executable, "-c", DISPATCH_CHILD], env={**os.environ, "TRITON_INTERPRET": "1"},
                          check=True, timeout=300, capture_output=True, text=True)
    out = eval(done.stdout.strip().splitlines()[-1])
    assert out[KERNEL_ROWS, 2] == (True, False, False), out  # the kernel
    assert out[KERNEL_ROWS + 1, 2] == (False, True, False), out  # the torch ops
    assert out[KERNEL_ROWS + 1, 1] == (True, False, False), out  # rank 1: the kernel


@pytest.mark.parametrize("rank,factor_dtype", [(1, torch.bfloat16), (8, torch.bfloat16), (8, torch.float32)])
def test_the_fusable_terms_sum_in_fp32_and_round_once(rank, factor_dtype):
    """The products and sums a torch.compile'd step may take instead of the kernel (COMPILED_TERMS = "torch"): the
    kernel's math, so bf16 outputs lie within one rounding of the fp64 answer, and the fp32 ones (the term before
    that rounding) within fp32's error."""
    from esrl.es.lowrank_kernel import _fusable_add_

    ys, xs, a_t, b_t = _inputs(rank, torch.bfloat16, factor_dtype, n=5)
    want = ys.double() + torch.bmm(torch.bmm(xs.double(), b_t.double().transpose(1, 2)), a_t.double())
    got = ys.clone()
    _fusable_add_(got, xs, a_t, b_t)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-6).all()
    fp32 = ys.float()
    _fusable_add_(fp32, xs, a_t, b_t)
    assert ((fp32.double() - want).abs() <= want.abs() * 1e-5 + 1e-5).all()


@pytest.mark.parametrize("factor_dtype", [torch.bfloat16, torch.float32])
def test_the_block_diagonal_gemm_terms_lie_within_the_torch_ops_rounding(factor_dtype):
    """`_gemm_add_` (GEMM_OUTS: every member's out-side factors in one dense GEMM, x.B on the diagonal blocks of
    zeros): each row sums its own member's products only, so bf16 outputs lie within the torch ops' two roundings of
    the fp64 answer, and fp32 ones within fp32's error."""
    from esrl.es.lowrank_kernel import _gemm_add_

    ys, xs, a_t, b_t = _inputs(8, torch.bfloat16, factor_dtype, m=4, n=5)
    want = ys.double() + torch.bmm(torch.bmm(xs.double(), b_t.double().transpose(1, 2)), a_t.double())
    scale = ys.double().abs() + torch.bmm(torch.bmm(xs.double().abs(), b_t.double().abs().transpose(1, 2)),
                                          a_t.double().abs())
    got = ys.clone()
    _gemm_add_(got, xs, a_t, b_t)
    assert got.dtype == torch.bfloat16 and not torch.equal(got, ys)
    assert ((got.double() - want).abs() <= (want.abs() + scale) * 2 ** -8).all()
    fp32 = ys.float()
    _gemm_add_(fp32, xs.float(), a_t.float(), b_t.float())
    assert ((fp32.double() - want).abs() <= scale * 1e-6).all()


def test_the_gemm_terms_reuse_one_buffer_of_blocks_whose_zeros_stay_zero():
    """One (M, n, M, r) buffer per shape serves every call: a call after others with other inputs (and another
    rank's) gives what a fresh buffer gives, bit for bit."""
    import esrl.es.lowrank_kernel as lk

    first, second = _inputs(8, torch.bfloat16, torch.bfloat16, m=4, n=5), _inputs(8, torch.bfloat16, torch.bfloat16,
                                                                                 m=4, n=5, n_in=200, n_out=90)
    lk._gemm_add_(first[0].clone(), *first[1:])
    lk._gemm_add_(torch.zeros(4, 5, 90).bfloat16(), *_inputs(2, torch.bfloat16, torch.bfloat16, m=4, n=5,
                                                              n_out=90)[1:])
    reused = second[0].clone()
    lk._gemm_add_(reused, *second[1:])
    lk._BLOCKS.clear()
    fresh = second[0].clone()
    lk._gemm_add_(fresh, *second[1:])
    assert torch.equal(reused, fresh) and not torch.equal(fresh, second[0])


def test_the_gemm_buffer_made_under_inference_mode_serves_a_step_outside_it():
    """Engines generate under torch.inference_mode, so a buffer made there is an inference tensor; a population step
    of the same shape outside it (an eager hooked forward under no_grad) once raised "Inplace update to inference
    tensor outside InferenceMode". Each mode keeps its own buffer, with the same sums."""
    import esrl.es.lowrank_kernel as lk

    lk._BLOCKS.clear()
    inputs = _inputs(8, torch.bfloat16, torch.bfloat16, m=4, n=5)
    inside = inputs[0].clone()
    with torch.inference_mode():
        lk._gemm_add_(inside, *inputs[1:])
    outside = inputs[0].clone()
    with torch.no_grad():
        lk._gemm_add_(outside, *inputs[1:])
    assert torch.equal(inside, outside) and not torch.equal(outside, inputs[0])


GEMM_CHILD = """
import torch
import esrl.es.lowrank_kernel as lk
calls = []
gemm = lk._gemm_add_
lk._gemm_add_ = lambda ys, *rest: (calls.append(ys.shape[-1]), gemm(ys, *rest))
lk.GEMM_OUTS = 100
out = {}
for rank in (8, 1):
    g = torch.Generator().manual_seed(rank)
    randn = lambda *shape: (torch.randn(*shape, generator=g) * 0.1).bfloat16()
    xs = randn(3, 2, 50)
    terms = [(randn(3, 2, w), randn(3, rank, w), randn(3, rank, 50)) for w in (70, 150)]
    got = [ys.clone() for ys, _, _ in terms]
    lk.lowrank_add_linears_([(y, a, b) for y, (_, a, b) in zip(got, terms)], xs)
    alone = [ys.clone() for ys, _, _ in terms]
    lk.lowrank_add_(alone[0], xs, *terms[0][1:], tiles={})  # the kernel
    gemm(alone[1], xs, *terms[1][1:])
    out[rank] = (list(calls), [torch.equal(a, b) for a, b in zip(got, alone)])
    calls.clear()
print(repr(out))
"""


def test_with_gemm_outs_wide_linears_above_rank_1_take_the_gemm_and_the_rest_the_kernel():
    """GEMM_OUTS = 100 in Triton's interpreter: of two linears sharing an input at rank 8, the 150-wide one takes the
    GEMM and the 70-wide one the kernel, each with the sums it gives alone; rank 1 keeps the kernel for both."""
    done = subprocess.run([sys.executable, "-c", GEMM_CHILD], env={**os.environ, "TRITON_INTERPRET": "1"},
                          check=True, timeout=300, capture_output=True, text=True)
    out = eval(done.stdout.strip().splitlines()[-1])
    assert out[8] == ([150], [True, True]), out
    assert out[1][0] == [] and out[1][1][0], out
