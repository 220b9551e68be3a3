"""ES noise on a GPU (esrl.es.philox), checked on the CPU through Triton's interpreter (TRITON_INTERPRET=1).

On CUDA esrl draws noise with Triton's counter-based Philox so that a chunk's factors for one matrix are one launch;
that is only correct if the draws made together equal the same draws made one by one (the member-by-member reference,
the seed-log replay and the update each ask for other subsets). The kernel source runs here in Triton's interpreter in
a child process (the variable must be set before Triton is imported); tests/test_gpu.py runs ES fits with it on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="Triton not installed (CUDA runs then keep torch's generator)")

CHILD = """
import sys, torch
from esrl.es import philox
from esrl.es.noise import (drawn_once, factor_groups, factor_stacks, gaussian, gaussian_groups, gaussian_stack,
                           lowrank_factors)
assert philox.available("cpu")
seeds = [11, 2**62 + 5, 11, 7]  # a 63-bit seed, and one listed twice (an antithetic pair)
shape, rank = (70, 1030), 5  # B: 5,150 numbers, two of the kernel's chunks, neither a multiple of its block
a, b = factor_stacks(seeds, 4, shape, rank)
singles = [lowrank_factors(s, 4, shape, rank) for s in seeds]
with drawn_once():
    kept = factor_stacks(seeds[:2], 4, shape, rank)
    served = factor_stacks(seeds[::-1], 4, shape, rank)
group = factor_groups(seeds, (9, 4, 2), shape, rank)  # three same-shape tensors in one launch
group_singles = [factor_stacks(seeds, j, shape, rank) for j in (9, 4, 2)]
out = {"a": a, "b": b, "singles": singles, "group": group, "group_singles": group_singles,
       "g_group": gaussian_groups([11, 12], (4, 5), (300, 70)), "kept": kept, "served": served,
       "g": gaussian(11, 4, (300, 70)), "g_again": gaussian(11, 4, (300, 70)), "g_next": gaussian(11, 5, (300, 70)),
       "g_key": gaussian(12, 4, (300, 70)), "big": gaussian(3, 0, (200_000,)),
       "g_stack": gaussian_stack([11, 12, 11], 4, (300, 70))}
torch.save(out, sys.argv[1])
"""


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    path = tmp_path_factory.mktemp("philox") / "out.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", CHILD, str(path)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(path)


def test_draws_made_together_equal_the_same_draws_made_one_by_one(drawn):
    a, b = drawn["a"], drawn["b"]
    assert a.shape == (4, 70, 5) and b.shape == (4, 1030, 5) and a.dtype == torch.float32
    for k, (sa, sb) in enumerate(drawn["singles"]):
        assert torch.equal(a[k], sa) and torch.equal(b[k], sb)  # bit for bit
    assert torch.equal(a[0], a[2]) and not torch.equal(a[0], a[1])  # a seed's factors, and only its
    served_a, served_b = drawn["served"]  # the block's kept pairs, asked for in another order and with a new seed
    assert torch.equal(served_a, a.flip(0)) and torch.equal(served_b, b.flip(0))
    assert torch.equal(drawn["kept"][0], a[:2])
    assert torch.equal(drawn["g_stack"], torch.stack([drawn["g"], drawn["g_key"], drawn["g"]]))  # lora's adapter noise


def test_a_group_of_tensors_drawn_in_one_launch_equals_each_tensor_drawn_alone(drawn):
    """factor_groups (a load's and an update's draw for same-shape matrices) must give every tensor the factors it
    gets alone (the member-by-member reference and the seed-log replay draw one tensor at a time)."""
    a, b = drawn["group"]
    assert a.shape == (4, 3, 70, 5) and b.shape == (4, 3, 1030, 5)
    for g, (sa, sb) in enumerate(drawn["group_singles"]):
        assert torch.equal(a[:, g], sa) and torch.equal(b[:, g], sb), g
    assert torch.equal(a[:, 1], drawn["a"])  # tensor 4, as factor_stacks drew it above
    g_group = drawn["g_group"]  # lora's adapter noise: seeds 11, 12 on tensors 4, 5
    assert torch.equal(g_group[0, 0], drawn["g"]) and torch.equal(g_group[0, 1], drawn["g_next"])
    assert torch.equal(g_group[1, 0], drawn["g_key"])


def test_the_streams_are_standard_normal_and_independent(drawn):
    g = drawn["g"].flatten()
    assert torch.equal(drawn["g"], drawn["g_again"])
    big = drawn["big"]
    assert abs(float(big.mean())) < 0.01 and abs(float(big.std()) - 1) < 0.01  # 200k draws: 4-5 standard errors
    assert abs(float((big > 1.96).float().mean()) - 0.025) < 0.002  # the tail too, not only two moments
    for other in (drawn["g_next"], drawn["g_key"], drawn["b"][1]):  # next tensor, next key, a factor stream
        other = other.flatten()[:g.numel()]
        corr = float(torch.corrcoef(torch.stack([g[:other.numel()], other]))[0, 1])
        assert abs(corr) < 4 / other.numel() ** 0.5, corr  # 4 standard errors of an independent pair's
