"""Per-token log-probs of completion tokens, as TRL 1.16's GRPOTrainer._get_per_token_logps_and_entropies.

In models/ because both the GRPO loss and the evaluation callback's KL score completions with it.
"""

from __future__ import annotations

import torch
from torch import nn


def selective_log_softmax(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) at ids, in float32, one row at a time.

    Row by row so that only one [T, V] float32 copy of the logits lives at once; float32 because TRL's fused
    LM head scores in float32 whatever the model's dtype.
    """
    rows = []
    for row_logits, row_ids in zip(logits, ids):
        row = row_logits.float() / temperature
        rows.append(row.gather(-1, row_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(row, dim=-1))
    return torch.stack(rows)


@torch.no_grad()
def token_entropies(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) at every position, in float32, one row at a time, without a graph
    (TRL's entropy_from_logits: a metric, not a loss term)."""
    rows = []
    for row_logits in logits:
        parts = []
        for part in row_logits.split(128):  # 128 positions at a time: a few float32 [128, V] copies, as TRL's chunks
            part = part.float() / temperature
            parts.append(torch.logsumexp(part, dim=-1) - (torch.softmax(part, dim=-1) * part).sum(-1))
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def per_token_logps(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    logits_to_keep: int, temperature: float = 1.0, with_entropies: bool = False,
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, logits_to_keep] of the last logits_to_keep tokens of input_ids (prompt + completion).

    The token at position t is scored by the logits at t - 1, so the model returns logits_to_keep + 1
    positions and the last one (predicting past the sequence) is dropped. Padded completion positions
    (attention_mask 0) are 0, as in TRL, whose fused LM head skips them; the loss masks them out anyway.
    `with_entropies`: also the entropies [B, logits_to_keep] of the same distributions (token_entropies), as TRL's
    _get_per_token_logps_and_entropies.
    """
    # the kept positions as an index, not transformers' int slice: a contiguous (B, k + 1, hidden) keeps lm_head one GEMM
    # when its weight is frozen (reference model, LoRA); a strided slice it would run per row (1.16-1.25x on the head
    # product on the 2-core CPU; esrl.rollout.static_decode's prefill, RESULTS session 12)
    length = input_ids.shape[1]
    if not 0 < logits_to_keep < length:  # the first token has no position before it: arange would wrap to the last
        raise ValueError(f"logits_to_keep {logits_to_keep}: must be in [1, {length - 1}] for {length} tokens")
    kept = torch.arange(length - logits_to_keep - 1, length, device=input_ids.device)
    out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=kept)
    logps = selective_log_softmax(out.logits[:, :-1], input_ids[:, -logits_to_keep:], temperature)
    padded = attention_mask[:, -logits_to_keep:] == 0
    if with_entropies:
        return logps.masked_fill(padded, 0.0), token_entropies(out.logits[:, :-1], temperature).masked_fill(padded, 0.0)
    return logps.masked_fill(padded, 0.0)


def packed(tokenizer, prompt_ids: list[list[int]], completion_ids: list[list[int]]):
    """Left-padded prompts followed by right-padded completions, row by row, the layout per_token_logps reads:
    input_ids, attention_mask, and the completions' own mask [B, width] (width at least 1)."""
    from esrl.rollout.text import left_padded

    prompts = left_padded(tokenizer, prompt_ids)
    lengths = torch.tensor([len(c) for c in completion_ids])
    width = max(1, int(lengths.max()))
    completions = torch.full((len(completion_ids), width), tokenizer.pad_token_id, dtype=torch.long)
    for i, c in enumerate(completion_ids):
        completions[i, :len(c)] = torch.tensor(c, dtype=torch.long)
    present = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return (torch.cat([prompts["input_ids"], completions], 1), torch.cat([prompts["attention_mask"], present], 1),
            present)

