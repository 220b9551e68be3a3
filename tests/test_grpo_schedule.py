"""GRPO's default learning-rate schedules against transformers' own (the ones TRL's trainer builds)."""

from __future__ import annotations

import math

import pytest
import torch

from esrl.errors import ConfigError
from esrl.grpo.config import GRPOConfig
from esrl.grpo.optim import default_schedule


@pytest.mark.parametrize("name, warmup_ratio", [("linear", 0.0), ("linear", 0.1), ("constant_with_warmup", 0.25),
                                                ("constant", 0.0)])
def test_each_schedule_is_transformers_of_its_name(name, warmup_ratio):
    """The factor at every step of a 20-step run, warmup steps as TrainingArguments counts them (ceil)."""
    from transformers import get_scheduler

    total = 20

    def rates(scheduler_of) -> list[float]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = scheduler_of(optimizer)
        out = []
        for _ in range(total):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        return out

    ours = rates(lambda opt: default_schedule(opt, GRPOConfig(lr_scheduler=name, warmup_ratio=warmup_ratio), total))
    theirs = rates(lambda opt: get_scheduler(name, opt, num_warmup_steps=math.ceil(warmup_ratio * total),
                                             num_training_steps=total))
    assert ours == theirs
    assert (name == "constant") == (len(set(ours)) == 1)


def test_a_warmup_with_the_constant_schedule_is_refused():
    """transformers' `constant` drops a warmup silently; esrl names the schedule that has one."""
    with pytest.raises(ConfigError, match="model.grpo.warmup_ratio: 0.1 with lr_scheduler constant.*"
                                          "constant_with_warmup"):
        GRPOConfig(lr_scheduler="constant", warmup_ratio=0.1).validate()
