"""Padded token batches for one scoring forward pass, shared by the score models and the LM judge: padding on
either side, positions over real tokens, the last real token of each row, and the device the pass runs on
(`place`; esrl.needs.checked_device checks the device's name when the scorer is built)."""

from __future__ import annotations

from typing import Sequence

import torch


def place(modules: Sequence[torch.nn.Module], device: torch.device) -> torch.device:
    """Move the modules to `device` and say where they are; a "cuda" without an index is the CUDA device current
    now. Scorers place their models at their first batch, not when built: a training process builds its task, and
    with it an in-process scorer, before Lightning makes the rank's GPU current, so every rank's scorer would
    otherwise sit on GPU 0 (and rank N's inputs, sent to its current device, would not meet it there)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for module in modules:
        module.to(device)
    return device


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of the mask (right or left padding alike)."""
    length = attention_mask.shape[1]
    flipped = attention_mask.flip(dims=[1]).to(torch.long)
    return (length - 1 - flipped.argmax(dim=1)).to(torch.long)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so left padding does not shift rotary/absolute positions."""
    return (attention_mask.to(torch.long).cumsum(dim=1) - 1).clamp(min=0)


def pad_batch(ids: Sequence[Sequence[int]], pad_id: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask of token lists padded to the longest, on the right or the left."""
    length = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), length), dtype=torch.long)
    for i, x in enumerate(ids):
        sl = slice(0, len(x)) if side == "right" else slice(length - len(x), length)
        input_ids[i, sl] = torch.tensor(list(x), dtype=torch.long)
        mask[i, sl] = 1
    return input_ids, mask


__all__ = ["last_token_index", "pad_batch", "place", "position_ids"]
