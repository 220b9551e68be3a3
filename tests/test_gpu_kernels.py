"""The GPU's kernels and device placement against plain torch (`pytest -m gpu`; skipped without CUDA): the lowrank
kernel's sums, shared launches, grouped draws, the batched finite check, a scorer's device. Split from test_gpu.py,
whose tests run fits and engines."""

from __future__ import annotations

import math
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("rank,factor_dtype", [(1, torch.bfloat16), (2, torch.bfloat16), (8, torch.bfloat16),
                                               (8, torch.float32)])
def test_lowrank_kernel_equals_the_fp32_product(rank, factor_dtype):
    """esrl.es.lowrank_kernel's Triton kernel: ys += (xs B) A^T per member, accumulated in fp32 and rounded once,
    so within one bf16 rounding of the fp64 answer; it repeats bit for bit. Shapes as Qwen2.5-1.5B's gate_proj."""
    from esrl.es.lowrank_kernel import lowrank_add_

    torch.manual_seed(rank)
    m, n, n_in, n_out = 6, 5, 1536, 8960
    ys = torch.randn(m, n, n_out, device="cuda").to(torch.bfloat16)
    xs = torch.randn(m, n, n_in, device="cuda").to(torch.bfloat16)
    a_t = (torch.randn(m, rank, n_out, device="cuda") * 0.1).to(factor_dtype)
    b_t = (torch.randn(m, rank, n_in, device="cuda") * 0.1).to(factor_dtype)
    want = ys.double() + torch.bmm(torch.bmm(xs.double(), b_t.double().transpose(1, 2)), a_t.double())
    got = ys.clone()
    lowrank_add_(got, xs, a_t, b_t)
    again = ys.clone()
    lowrank_add_(again, xs, a_t, b_t)
    assert torch.equal(got, again)
    # one bf16 rounding of the sum, plus fp32's error in sums of 1536 products (where they cancel, rounding is small)
    scale = ys.double().abs() + torch.bmm(torch.bmm(xs.double().abs(), b_t.double().abs().transpose(1, 2)),
                                          a_t.double().abs())
    assert ((got.double() - want).abs() <= want.abs() * 2 ** -8 + scale * 2 ** -16).all()


@pytest.mark.parametrize("rank", [1, 2, 8])
def test_a_prefills_rows_take_the_torch_ops_above_rank_1_repeatably_within_two_roundings(rank):
    """Above KERNEL_ROWS rows per member (a prefill) the terms of ranks above 1 are batched GEMMs: x.B is rounded to
    bf16 before the add (one rounding more than the kernel's), and cuBLAS repeats bit for bit for the same shapes.
    Rank 1 keeps the kernel at any rows (its per-row factor reads cost no more than the row's x and y)."""
    from esrl.es.lowrank_kernel import KERNEL_ROWS, _torch_add_, lowrank_add_

    torch.manual_seed(rank)
    m, n, n_in, n_out = 6, KERNEL_ROWS + 1, 1536, 8960
    ys = torch.randn(m, n, n_out, device="cuda").bfloat16()
    xs = torch.randn(m, n, n_in, device="cuda").bfloat16()
    a_t = (torch.randn(m, rank, n_out, device="cuda") * 0.1).bfloat16()
    b_t = (torch.randn(m, rank, n_in, device="cuda") * 0.1).bfloat16()
    got, again, torch_ops = ys.clone(), ys.clone(), ys.clone()
    lowrank_add_(got, xs, a_t, b_t)
    lowrank_add_(again, xs, a_t, b_t)
    if rank == 1:
        lowrank_add_(torch_ops, xs, a_t, b_t, tiles={})  # block sizes given: the kernel at any rows
    else:
        _torch_add_(torch_ops, xs, a_t, b_t)
    assert torch.equal(got, again) and torch.equal(got, torch_ops)
    want = ys.double() + torch.bmm(torch.bmm(xs.double(), b_t.double().transpose(1, 2)), a_t.double())
    scale = ys.double().abs() + torch.bmm(torch.bmm(xs.double().abs(), b_t.double().abs().transpose(1, 2)),
                                          a_t.double().abs())
    assert ((got.double() - want).abs() <= (want.abs() + scale) * 2 ** -8).all()


@pytest.mark.parametrize("rank", [1, 8])
@pytest.mark.parametrize("n_outs", [(1536, 256, 256), (8960, 8960)], ids=["q_k_v", "gate_up"])
def test_linears_in_one_launch_equal_one_launch_each(rank, n_outs):
    """lowrank_add_linears_: q, k and v's terms (or an MLP's gate and up) in one launch (the grid picks the linear;
    esrl.es.shared_inputs says when a model allows it) are the one-launch-per-linear kernel's, bit for bit. Shapes as
    Qwen2.5-1.5B's."""
    from esrl.es.lowrank_kernel import lowrank_add_, lowrank_add_linears_

    torch.manual_seed(rank)
    m, n, n_in = 30, 8, 1536
    xs = torch.randn(m, n, n_in, device="cuda").bfloat16()
    terms = [(torch.randn(m, n, n_out, device="cuda").bfloat16(),
              (torch.randn(m, rank, n_out, device="cuda") * 0.1).bfloat16(),
              (torch.randn(m, rank, n_in, device="cuda") * 0.1).bfloat16()) for n_out in n_outs]
    one_each = [ys.clone() for ys, _, _ in terms]
    for ys, (_, a_t, b_t) in zip(one_each, terms):
        lowrank_add_(ys, xs, a_t, b_t)
    together = [ys.clone() for ys, _, _ in terms]
    lowrank_add_linears_([(ys, a_t, b_t) for ys, (_, a_t, b_t) in zip(together, terms)], xs)
    for (ys, _, _), want, got in zip(terms, one_each, together):
        assert torch.equal(got, want) and not torch.equal(got, ys)


def test_a_group_of_matrices_drawn_in_one_launch_equals_each_drawn_alone():
    """A load and an update draw a group of same-shape matrices' factors (lora: adapter noise) in one launch
    (esrl.es.noise.factor_groups, gaussian_groups); each matrix must get the numbers it gets drawn alone (the
    member-by-member reference and the seed-log replay draw one at a time). Shapes as Qwen2.5-1.5B's k_proj."""
    from esrl.es.noise import factor_groups, factor_stacks, gaussian_groups, gaussian_stack

    seeds, indices = [5, 2**62 + 1, 5, 9], (3, 10, 17)
    a, b = factor_groups(seeds, indices, (256, 1536), 2, "cuda")
    eps = gaussian_groups(seeds, indices, (8, 1536), "cuda")
    for g, j in enumerate(indices):
        alone_a, alone_b = factor_stacks(seeds, j, (256, 1536), 2, "cuda")
        assert torch.equal(a[:, g], alone_a) and torch.equal(b[:, g], alone_b), j
        assert torch.equal(eps[:, g], gaussian_stack(seeds, j, (8, 1536), "cuda")), j
    assert not torch.equal(a[:, 0], a[:, 1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_the_batched_finite_check_on_cuda_finds_one_bad_element(bad):
    """esrl.finite on CUDA: fp64 sums of |x| by torch._foreach_norm over 400 bf16 tensors (several multi-tensor
    launches) and fp32 ones; one bad element in the last tensor is found, the largest finite values are not one."""
    from esrl.finite import all_finite, batched_on

    assert batched_on(torch.device("cuda"))
    tensors = [torch.randn(64, 96, device="cuda").bfloat16() for _ in range(400)] + [torch.randn(7, device="cuda")]
    tensors[-2] = torch.full((70_000,), torch.finfo(torch.bfloat16).max, device="cuda", dtype=torch.bfloat16)
    if bad is not None:
        tensors[-2][-1] = bad
    assert all_finite(tensors) == (bad is None) == all(bool(torch.isfinite(t).all()) for t in tensors)


def test_a_scorer_takes_the_cuda_device_current_at_its_first_batch(tmp_path):
    """A training process builds its task's scorer before Lightning makes the rank's GPU current, so a scorer on
    "auto" places its model at its first batch (esrl.scoring.batches.place), not on GPU 0 when built."""
    from esrl.models import load_tokenizer
    from esrl.models.tiny import tiny_score_model
    from esrl.scoring.score_model import ScoreModel

    tok = load_tokenizer(os.environ.get("ESRL_TOKENIZER", "smollm2-135m-instruct"))
    scorer = ScoreModel(tiny_score_model(tmp_path / "reward", seed=1, score_type="reward", tokenizer=tok))
    assert next(scorer.backbone.parameters()).device.type == "cpu"
    scores = scorer.score_texts(["Hi there", "A longer answer about the sea"])
    assert next(scorer.backbone.parameters()).device == torch.device("cuda", torch.cuda.current_device())
    assert len(scores) == 2 and all(map(math.isfinite, scores))
