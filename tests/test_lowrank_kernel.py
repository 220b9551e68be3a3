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
from esrl.es.lowrank_kernel import add_terms_, lowrank_add_, lowrank_add_linears_
xs, terms = torch.load(sys.argv[1])
one_by_one = [ys.clone() for ys, _, _ in terms]
for ys, (_, a_t, b_t) in zip(one_by_one, terms):
    lowrank_add_(ys, xs, a_t, b_t)
together = [ys.clone() for ys, _, _ in terms]
lowrank_add_linears_([(ys, a_t, b_t) for ys, (_, a_t, b_t) in zip(together, terms)], xs)
alone = [torch.full(ys.shape, float("nan")) for ys, _, _ in terms]  # fp32, NaN: written, never read
lowrank_add_linears_([(t, a_t, b_t) for t, (_, a_t, b_t) in zip(alone, terms)], xs, add=False)
added = [ys.clone() for ys, _, _ in terms]
add_terms_(added, alone)
torch.save((one_by_one, together, alone, added), sys.argv[2])
"""


@pytest.mark.parametrize("rank,dtype", [(1, torch.bfloat16), (8, torch.float32)])
def test_one_launch_for_linears_sharing_an_input_equals_one_launch_each(tmp_path, rank, dtype):
    """q, k and v in one launch (the grid's second axis picks the linear): each output is the one-launch-per-linear
    kernel's bit for bit, for widths that differ, one wider than a block of outputs at rank 8 (4096) and a fourth
    linear (a second launch). Written alone (`add=False`, StaticPopulation.overlap's fp32 buffers) each term is the
    fp64 sum's within fp32 rounding, and added by add_terms_ (three outputs a launch, then the fourth) the outputs are
    the in-place kernel's bit for bit (in fp32 torch's add's too)."""
    g = torch.Generator().manual_seed(rank)
    m, n, n_in = 3, 2, 300
    xs = torch.randn(m, n, n_in, generator=g).to(dtype)
    randn = lambda *shape: torch.randn(*shape, generator=g)
    terms = [(randn(m, n, n_out).to(dtype), (randn(m, rank, n_out) * 0.1).to(dtype),
              (randn(m, rank, n_in) * 0.1).to(dtype)) for n_out in (1100, 70, 5000, 33)]
    torch.save((xs, terms), tmp_path / "in.pt")
    subprocess.run([sys.executable, "-c", LINEARS_CHILD, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   env={**os.environ, "TRITON_INTERPRET": "1"}, check=True, timeout=300)
    one_by_one, together, alone, added = torch.load(tmp_path / "out.pt")
    for (ys, a_t, b_t), want, got, term, after in zip(terms, one_by_one, together, alone, added):
        assert torch.equal(got, want) and not torch.equal(got, ys) and torch.equal(after, got), ys.shape
        exact = torch.bmm(torch.bmm(xs.double(), b_t.double().transpose(1, 2)), a_t.double())
        scale = torch.bmm(torch.bmm(xs.double().abs(), b_t.double().abs().transpose(1, 2)), a_t.double().abs())
        assert term.dtype == torch.float32 and ((term.double() - exact).abs() <= 1e-5 * scale + 1e-7).all()
        if dtype == torch.float32:  # bf16 outputs: the interpreter rounds by truncation, torch's add to nearest
            assert torch.equal(ys + term, got), ys.shape


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
