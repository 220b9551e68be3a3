"""The Scorer interface: `score(prompts, responses) -> (rewards, costs)`, in process or over HTTP.

`prompts` are the users' requests as plain text (not formatted with any template) and `responses` the
assistant's answers (stop strings already removed). Each scorer formats the pair the way its models expect.
Rewards: higher is more helpful (helpful means reward > 0); costs: higher is more harmful (safe means cost <= 0).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Sequence

from esrl.errors import ScorerError


def _finite(v: int | float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int past float's range (10**400)
        return False


def check_scores(rewards: Any, costs: Any, n: int, source: str, offset: int = 0) -> tuple[list[float], list[float]]:
    """Two lists of n finite numbers, or ScorerError naming `source` and what was wrong (an item by its place in the
    whole batch: `offset` is this answer's first item there)."""
    out = []
    for name, values in (("rewards", rewards), ("costs", costs)):
        if not isinstance(values, (list, tuple)):
            raise ScorerError(f"{source}: {name} must be a list of numbers, got {type(values).__name__}")
        if len(values) != n:
            raise ScorerError(f"{source}: {len(values)} {name} for {n} responses")
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ScorerError(f"{source}: {name}[{offset + i}] is not a number ({v!r:.40})")
            if not _finite(v):
                raise ScorerError(f"{source}: {name}[{offset + i}] is not finite ({v})")
        out.append([float(v) for v in values])
    return out[0], out[1]


class Scorer(ABC):
    """Rewards and costs of (prompt, response) pairs; remembers the last batch's raw values for metrics."""

    name: str = "scorer"

    def __init__(self) -> None:
        self.last_rewards: list[float] = []
        self.last_costs: list[float] = []

    @abstractmethod
    def _score(self, prompts: list[str], responses: list[str]) -> tuple[Sequence[float], Sequence[float]]:
        """Raw scores of one batch (validated by `score`)."""

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> tuple[list[float], list[float]]:
        prompts, responses = list(prompts), list(responses)
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
        if not prompts:
            rewards, costs = [], []
        else:
            rewards, costs = self._score(prompts, responses)
            rewards, costs = check_scores(list(rewards), list(costs), len(prompts), self.name)
        self.last_rewards, self.last_costs = rewards, costs
        return rewards, costs

    def close(self) -> None:
        """Release connections or memory (no-op by default)."""
