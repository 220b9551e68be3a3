"""Each ES member's scores and completion statistics: one row of a [members, columns] float64 table.

Ranks fill the rows of their own members and leave the others 0, so a sum across ranks gathers the table exactly
(min and max included: each row has one writer). The completion columns give ES the length, truncation and
per-reward-function series that GRPO logs over its samples: every member decodes the same prompts, so a mean over
members' mean lengths is the mean over all completions; a reward function's None values differ between members, so
its columns are a sum and a count, divided once over the whole population."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

COLUMNS = ("fitness", "raw_reward", "cost", "safe", "length_mean", "length_min", "length_max", "truncated")
"""The fixed columns; each reward function's sum and count of values (its None left out) follow, in the task's
order."""
FITNESS, RAW_REWARD, COST, SAFE, LENGTH_MEAN, LENGTH_MIN, LENGTH_MAX, TRUNCATED = range(len(COLUMNS))


def width(num_functions: int) -> int:
    return len(COLUMNS) + 2 * num_functions


def member_table(n_members: int, rewards: Sequence[float], lengths: Sequence[int], truncated: Sequence[bool],
                 per_function: Mapping[str, Sequence[float]],
                 raw_and_costs: tuple[Sequence[float], Sequence[float]] | None = None) -> torch.Tensor:
    """[n_members, width] from member-major per-completion values: the fitness (mean task reward); with a cost
    (`raw_and_costs`), the mean raw reward, mean cost and safe fraction (cost <= 0); the completions' mean, min and
    max length in tokens and truncated share; each reward function's sum and count leaving out its None (NaN)
    values."""
    def per_member(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64).view(n_members, -1)

    table = torch.zeros(n_members, width(len(per_function)), dtype=torch.float64)
    table[:, FITNESS] = per_member(rewards).mean(1)
    if raw_and_costs is not None:
        raw, cost = (per_member(v) for v in raw_and_costs)
        table[:, RAW_REWARD], table[:, COST], table[:, SAFE] = raw.mean(1), cost.mean(1), (cost <= 0).double().mean(1)
    length = per_member(lengths)
    table[:, LENGTH_MEAN], table[:, LENGTH_MIN], table[:, LENGTH_MAX] = length.mean(1), length.amin(1), length.amax(1)
    table[:, TRUNCATED] = per_member([float(t) for t in truncated]).mean(1)
    functions = table[:, len(COLUMNS):].view(n_members, -1, 2)  # [member, function, (sum, count)]
    for j, values in enumerate(per_function.values()):
        given = per_member(values)
        functions[:, j, 0], functions[:, j, 1] = given.nansum(1), (~given.isnan()).sum(1)
    return table


def completion_metrics(table: torch.Tensor, function_names: Sequence[str]) -> dict[str, float]:
    """The population's completion metrics under GRPO's names: train/completion_length_mean, _min, _max,
    train/truncated_frac and train/rewards/<function>/mean."""
    metrics = {"train/completion_length_mean": table[:, LENGTH_MEAN].mean(),
               "train/completion_length_min": table[:, LENGTH_MIN].min(),
               "train/completion_length_max": table[:, LENGTH_MAX].max(),
               "train/truncated_frac": table[:, TRUNCATED].mean()}
    sums, counts = table[:, len(COLUMNS):].reshape(len(table), -1, 2).sum(0).unbind(-1)
    for name, total, given in zip(function_names, sums.tolist(), counts.tolist(), strict=True):
        metrics[f"train/rewards/{name}/mean"] = total / given if given else math.nan  # NaN as GRPO's nanmean
    return {k: float(v) for k, v in metrics.items()}
