"""Evaluation statistics against written-out references."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from esrl.metrics import cjk_share, hacking_indicators, k3_kl, pass_at_k, repetition, special_token_share


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 2, 1), (5, 2, 3), (6, 3, 6), (4, 4, 2), (8, 1, 4)])
def test_pass_at_k_equals_enumeration_over_subsets(n, c, k):
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    expected = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert math.isclose(pass_at_k(n, c, k), expected, rel_tol=1e-12)


def test_pass_at_k_rejects_k_above_n():
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_k3_kl_matches_formula_and_is_zero_for_equal_models():
    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    lr = torch.tensor([[-1.5, -1.0, -0.5]])
    mask = torch.tensor([[1, 1, 0]])
    d = [-0.5, 1.0]
    expected = sum(math.exp(x) - x - 1 for x in d) / 2
    assert math.isclose(float(k3_kl(lp, lr, mask)), expected, rel_tol=1e-12)
    assert float(k3_kl(lp, lp, mask)) == 0.0


def test_hacking_indicators_on_written_examples():
    assert repetition("a b c d a b c d a b c d") == pytest.approx(1 - 4 / 9)
    assert repetition("one two three") == 0.0
    assert cjk_share("ab中文") == 0.5
    ind = hacking_indicators(["", "hello <|im_start|> there", "好的"], [False, True, False])
    assert ind["empty"] == pytest.approx(1 / 3)
    assert ind["special_tokens"] == pytest.approx(1 / 3)
    assert ind["cjk_share"] == pytest.approx(1 / 3)
    assert ind["truncated"] == pytest.approx(1 / 3)
    assert ind["length_max"] == len("hello <|im_start|> there")


def test_special_token_share_leaves_out_every_declared_end_token():
    """Qwen2.5-Instruct ends on <|im_end|> or <|endoftext|> (both declared, kept in the ids): ending on the second
    flagged every completion as holding a special token, and sweep and study called the run hacked."""
    im_end, endoftext, pad_like, word = 2, 0, 5, 100
    ended_on_either = [[word, im_end], [word, endoftext], [word]]
    assert special_token_share(ended_on_either, [im_end, endoftext, pad_like], [im_end, endoftext]) == 0.0
    assert special_token_share(ended_on_either, [im_end, endoftext, pad_like], [im_end]) == 1 / 3
    assert special_token_share([[word, pad_like, word], [word]], [im_end, pad_like], [im_end]) == 0.5
    assert special_token_share([], [im_end], [im_end]) == 0.0
