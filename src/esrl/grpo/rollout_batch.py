"""A GRPO micro-batch as the tensors its loss needs: prompt ids as the engine tokenized them, completion ids, masks.

Plain torch: built from the engine's completions and the group advantages; the module adds the reference and old
log-probs and (dapo, cispo, vespo) the loss tokens counted over every process.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from esrl.errors import ConfigError
from esrl.models.logps import packed
from esrl.rollout import Completion


@dataclass
class RolloutBatch:
    """One micro-batch of scored completions, as tensors the loss needs (rows: prompt i's G completions
    contiguous, TRL's layout)."""

    input_ids: torch.Tensor  # [B*G, P+T] left-padded prompt, then right-padded completion
    attention_mask: torch.Tensor  # [B*G, P+T]
    completion_mask: torch.Tensor  # [B*G, T] tokens that count in the loss
    rewards: torch.Tensor  # [B*G]
    advantages: torch.Tensor  # [B*G]
    lengths: torch.Tensor  # [B*G] completion tokens
    truncated: torch.Tensor  # [B*G] bool, hit max_new_tokens
    old_logps: torch.Tensor | None = None  # [B*G, T], only when num_iterations > 1
    ref_logps: torch.Tensor | None = None  # [B*G, T], only when beta > 0
    is_ratio: torch.Tensor | None = None  # [B*G, T] or [B*G, 1], vLLM importance-sampling correction only
    num_tokens: torch.Tensor | None = None  # loss tokens of this micro-batch on all ranks (dapo, cispo, vespo)
    is_values: dict[str, torch.Tensor] = field(default_factory=dict)  # what TRL's sampling/* metrics summarize
    unscorable: int = 0  # completions no reward function applied to (NaN rewards that are not failures)
    rewards_per_function: dict[str, torch.Tensor] = field(default_factory=dict)  # [B*G] each, NaN where None

    @property
    def completion_width(self) -> int:
        return self.completion_mask.shape[1]

    def to(self, device: torch.device | str) -> RolloutBatch:
        """A copy with every tensor on `device`."""
        return replace(self, **{f.name: _moved(getattr(self, f.name), device) for f in fields(self)})

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors, dicts and ints on the CPU: a checkpoint keeps the rollouts num_iterations > 1 reuses, and
        still loads with torch.load(weights_only=True)."""
        return {f.name: _moved(getattr(self, f.name), "cpu") for f in fields(self)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> RolloutBatch:
        return cls(**state)


def reuse_state(rollouts: list[RolloutBatch], num_items: torch.Tensor | None, world_size: int) -> dict[str, Any]:
    """A num_iterations window's rollouts of every process (each samples its own prompts), for a checkpoint that
    rank 0 writes; every process calls this (the hook runs on each), as all_gather_object needs."""
    mine = [r.state_dict() for r in rollouts]
    every: list[Any] = [mine]
    if world_size > 1:
        every = [None] * world_size
        torch.distributed.all_gather_object(every, mine)
    return {"rollouts": every, "num_items": None if num_items is None else num_items.cpu()}


def reused(state: dict[str, Any] | None, world_size: int, rank: int) -> tuple[list[RolloutBatch], Any]:
    """This process's rollouts and the window's token count from reuse_state's `state` (none: empty); saved on
    another number of processes is refused: no process could train on its own."""
    if state is None:
        return [], None
    if len(state["rollouts"]) != world_size:
        raise ConfigError(f"--ckpt_path: saved inside a num_iterations window on {len(state['rollouts'])} "
                          f"process(es), whose rollouts a run on {world_size} cannot share out; resume on as many, "
                          "or from a checkpoint at a window's end")
    return [RolloutBatch.from_state_dict(r) for r in state["rollouts"][rank]], state["num_items"]


def _moved(value: Any, device: torch.device | str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    return value


@dataclass
class Scores:
    """Scored completions' rewards (checked: NaN is out of its group), which ones no reward function applied to,
    and each function's own values (NaN where it returned None), for TRL's rewards/<function> metrics."""

    rewards: torch.Tensor
    unscored: torch.Tensor  # bool, one a completion
    per_function: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def unscorable(self) -> int:
        return int(self.unscored.sum())

    def split(self, sizes: list[int]) -> list[Scores]:
        """Consecutive parts of these scores: a window's micro-batches, scored in one call."""
        parts = zip(self.rewards.split(sizes), self.unscored.split(sizes),
                    *(values.split(sizes) for values in self.per_function.values()))
        return [Scores(rewards, unscored, dict(zip(self.per_function, per_function)))
                for rewards, unscored, *per_function in parts]


def rollout_tensors(tokenizer, prompt_ids: list[list[int]], completions: list[Completion], rewards: torch.Tensor,
                    advantages: torch.Tensor, mask_truncated: bool, device: torch.device) -> RolloutBatch:
    """Left-padded prompt ids (as the engine tokenized them, esrl.rollout.text.encode_prompts) + right-padded
    completion ids, each prompt's G = len(completions) / len(prompts) completions in a row. `mask_truncated`: a
    completion that hit max_new_tokens counts no loss tokens (TRL's mask_truncated_completions)."""
    generations = len(completions) // len(prompt_ids)
    input_ids, attention_mask, present = packed(tokenizer, [row for row in prompt_ids for _ in range(generations)],
                                                [c.token_ids for c in completions])
    truncated = torch.tensor([c.truncated for c in completions])
    loss_mask = present * (~truncated).long().unsqueeze(1) if mask_truncated else present
    return RolloutBatch(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                        completion_mask=loss_mask.to(device), rewards=rewards, advantages=advantages.to(device),
                        lengths=present.sum(1), truncated=truncated)
