"""Evaluation statistics in plain python/torch: pass@k, k3 KL, and reward-hacking indicators."""

from __future__ import annotations

import math
import re
from statistics import fmean
from typing import Sequence

import torch


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def k3_kl(logp_model: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(model || ref) per token, on samples from the model:
    exp(d) - d - 1 with d = logp_ref - logp_model; the mean over unmasked tokens."""
    d = (logp_ref - logp_model).double()
    per_token = torch.exp(d) - d - 1
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")
_SPECIAL = re.compile(r"<\|[^|>]{1,40}\|>|</?s>|\[INST\]|<\|endoftext\|>")


def repetition(text: str, n: int = 4) -> float:
    """Share of word n-grams that repeat an earlier one (0: none repeated; near 1: a loop)."""
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def cjk_share(text: str) -> float:
    """Share of characters in Chinese, Japanese or Korean script (a switch of script is a known hack)."""
    chars = [c for c in text if not c.isspace()]
    return sum(bool(_CJK.match(c)) for c in chars) / len(chars) if chars else 0.0


def hacking_indicators(texts: Sequence[str], truncated: Sequence[bool]) -> dict[str, float]:
    """Signs that a policy games its reward rather than solving the task, averaged over completions."""
    lengths = [len(t) for t in texts]
    return {
        "empty": fmean(float(not t.strip()) for t in texts),
        "special_tokens": fmean(float(bool(_SPECIAL.search(t))) for t in texts),
        "cjk_share": fmean(cjk_share(t) for t in texts),
        "repetition": fmean(repetition(t) for t in texts),
        "length_mean": fmean(lengths),
        "length_max": float(max(lengths)),
        "truncated": fmean(float(x) for x in truncated),
    }


def special_token_share(token_ids: Sequence[Sequence[int]], special_ids: Sequence[int],
                        end_ids: Sequence[int]) -> float:
    """The share of completions holding a special token other than an end token: every end token the model declares
    ends a completion and stays in its ids (Qwen2.5-Instruct's <|endoftext|> beside <|im_end|>), not a hack."""
    special = set(special_ids) - set(end_ids)
    return fmean(float(any(t in special for t in ids)) for ids in token_ids) if token_ids else 0.0
