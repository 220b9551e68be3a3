"""GRPO's step metrics against TRL's definitions where the fits in other tests never reach them: the sampling
metrics' min / max over processes, the lengths of the completions that ended."""

from __future__ import annotations

import torch
from trl.trainer.utils import nanmin

from esrl.grpo.step_metrics import loss_metrics, rank_reduction, sample_metrics


def test_sampling_min_and_max_reduce_over_processes_by_min_and_max():
    """TRL takes nanmin / nanmax of its sampling/*/min and /max metrics over processes; averaged, a rank with a
    tiny importance ratio would hide behind the others."""
    for key, reduce_fx in (("sampling/importance_sampling_ratio/min", "min"),
                           ("sampling/importance_sampling_ratio/max", "max"),
                           ("sampling/sampling_logp_difference/max", "max"),
                           ("sampling/importance_sampling_ratio/mean", "mean")):
        assert rank_reduction(key) == reduce_fx, key
    mine = [{"sampling/importance_sampling_ratio/min": torch.tensor(0.2)}]
    other = torch.tensor([[[0.8, 1.0]]], dtype=torch.float64)  # [K, A, (value, count)] of the other process
    out = loss_metrics(mine, lambda local: torch.stack([local, other]))
    assert out["train/sampling/importance_sampling_ratio/min"] == nanmin(torch.tensor([0.2, 0.8])).item()


def test_terminated_lengths_leave_truncated_completions_out():
    """terminated_length_* are over the completions that ended (an end token or a stop string), 0 when none did,
    as TRL's; the fits in other tests never mixed the two kinds."""
    samples = {"rewards": torch.tensor([1.0, 0.0, 2.0, 3.0]), "advantages": torch.zeros(4),
               "lengths": torch.tensor([3.0, 8.0, 5.0, 8.0]), "truncated": torch.tensor([0.0, 1.0, 0.0, 1.0]),
               "unscorable": torch.tensor([0.0])}
    metrics = sample_metrics(samples, 2)
    assert [metrics[f"train/terminated_length_{k}"] for k in ("mean", "min", "max")] == [4.0, 3.0, 5.0]
    samples["truncated"] = torch.ones(4)
    assert sample_metrics(samples, 2)["train/terminated_length_mean"] == 0.0
