"""What reward functions log through TRL's keywords (TRL's GRPOTrainer hands every reward function `log_metric`
and `log_extra`), so that a reward function written for TRL runs unchanged under ES and GRPO alike.

- `log_metric(name, value)`: one number (or bool) a call. Training logs `train/<name>` each optimizer step (ES: each
  iteration): every call's value in every process pooled, total over count, as TRL's GRPOTrainer (GRPO calls a
  reward function once per step's window, TRL once per generation batch: the same completions; ES once per chunk
  of members). Evaluation logs `eval/<name>`, the mean of its calls.
- `log_extra(column, values)`: columns for TRL's completions table. esrl keeps no table of training completions
  (evaluation writes samples.csv), so these are dropped, with one warning a run.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch.distributed as dist

from esrl.errors import RewardError
from esrl.tasks.reward_values import as_number


class RewardLogs:
    """The metrics reward functions logged since the last `take`; `context()` is what they are handed."""

    def __init__(self) -> None:
        self._sums: dict[str, tuple[float, int]] = {}
        self._warned = False

    def context(self) -> dict[str, Any]:
        return {"log_metric": self.log_metric, "log_extra": self.log_extra}

    def log_metric(self, name: str, value: float) -> None:
        number = as_number(value, bools=True)
        if not isinstance(name, str) or not name or number is None:
            raise RewardError(f"a reward function called log_metric({name!r:.40}, {value!r:.40}): it takes a "
                              "metric's name (a non-empty str) and one number")
        total, count = self._sums.get(name, (0.0, 0))
        self._sums[name] = (total + number, count + 1)

    def log_extra(self, column: str, values: list) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"a reward function called log_extra({column!r:.40}, ...): esrl keeps no table of training "
                          "completions, so its columns are dropped (log_metric's numbers are logged)", stacklevel=2)

    def take(self, pool: bool = True, reserved: Iterable[str] = ()) -> dict[str, float]:
        """Each metric's mean since the last take, and a fresh start. `pool`: over every process too (a collective:
        every process calls it at the same point, as the training step's logging does), total over count.
        `reserved`: the caller's own metric names, which a reward function's may not take."""
        local, self._sums = self._sums, {}
        gathered = [local]
        if pool and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [{}] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        names = sorted(set().union(*gathered))
        refuse_clashes(names, reserved)
        return {name: sum(g[name][0] for g in gathered if name in g) / sum(g[name][1] for g in gathered if name in g)
                for name in names}

    def add_to(self, values: dict[str, list[float]], pool: bool = False) -> None:
        """Each metric's mean since the last take (this process's calls; `pool`: every process's, a collective) into
        an evaluation's per-sample `values`, as every sample's value."""
        n = len(values["reward"])
        taken = self.take(pool=pool, reserved=[*values, "bad_rewards"])  # the evaluation's count of failed rewards
        values.update({k: [v] * n for k, v in taken.items()})


def refuse_clashes(logged: Iterable[str], own: Iterable[str]) -> None:
    """A RewardError when a name a reward function logged is one of the caller's own metrics (it would overwrite
    it, or be overwritten, without a word)."""
    clash = sorted(set(logged) & set(own))
    if clash:
        raise RewardError(f"a reward function's log_metric named {clash[0]!r}, a metric esrl logs itself: rename it")
