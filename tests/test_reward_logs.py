"""What reward functions log through TRL's keywords (esrl.tasks.reward_logs): log_metric's numbers pooled as TRL's
GRPOTrainer pools them (every call in every process, total over count), logged by ES and GRPO alike."""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from conftest import FIXTURES, free_port, run_esrl, write_tiny_config

from esrl.errors import RewardError
from esrl.tasks.reward_logs import RewardLogs


def test_a_metric_is_the_mean_of_its_calls_since_the_last_take():
    logs = RewardLogs()
    log_metric = logs.context()["log_metric"]
    log_metric("a", 1)
    log_metric("a", 4.0)
    log_metric("b", -2.5)
    assert logs.take() == {"a": 2.5, "b": -2.5}
    assert logs.take() == {}
    log_metric("a", 3)
    assert logs.take() == {"a": 3.0}


def test_a_bool_counts_as_0_or_1_as_in_trl():
    """numpy's and torch's bools too (np.all(...) is one): they were refused, stopping the run."""
    import numpy as np
    import torch

    logs = RewardLogs()
    for value in (True, False, np.bool_(True), np.all([1, 0]), torch.tensor(True), torch.tensor([False])):
        logs.log_metric("solved", value)
    assert logs.take() == {"solved": 0.5}


@pytest.mark.parametrize(("name", "value"), [("a", "1.5"), ("a", None), ("a", [1.0]), ("", 1.0), (3, 1.0)])
def test_a_metric_that_is_no_name_and_number_is_an_error_naming_the_call(name, value):
    with pytest.raises(RewardError, match=r"^a reward function called log_metric\("):
        RewardLogs().log_metric(name, value)


def test_a_name_esrl_logs_itself_is_refused_and_evaluation_gets_a_value_a_sample():
    logs = RewardLogs()
    logs.log_metric("truncated", 1.0)
    with pytest.raises(RewardError, match="log_metric named 'truncated', a metric esrl logs itself"):
        logs.take(reserved=["reward", "truncated"])
    logs.log_metric("bad_rewards", 1.0)  # the evaluation's count of failed rewards, added after
    with pytest.raises(RewardError, match="log_metric named 'bad_rewards'"):
        logs.add_to({"reward": [1.0]})
    values = {"reward": [1.0, 2.0, 3.0]}
    logs.log_metric("calls", 1.0)
    logs.log_metric("calls", 2.0)
    logs.add_to(values)
    assert values == {"reward": [1.0, 2.0, 3.0], "calls": [1.5, 1.5, 1.5]}


def test_a_metric_function_that_raises_is_named_as_a_metric_function():
    from esrl.tasks.base import Task

    task = Task("t", [], [], reward_funcs=[], metric_funcs={"ratio": lambda prompts, completions, **_: [1 / 0]})
    with pytest.raises(RewardError, match=r"^metric function ratio raised ZeroDivisionError"):
        task.metrics([{"prompt": "a"}], ["x"])


def test_log_extra_is_dropped_with_one_warning():
    logs = RewardLogs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logs.log_extra("note", ["a"])
        logs.log_extra("note", ["b"])
    assert [str(w.message)[:41] for w in caught] == ["a reward function called log_extra('note'"]
    assert logs.take() == {}


def _pooled(rank: int, port: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    logs = RewardLogs()
    for value in ([1.0, 1.0] if rank == 0 else [4.0]):
        logs.log_metric("a", value)
    if rank == 1:
        logs.log_metric("only_one", 7.0)
    out[rank] = (logs.take(), logs.take(pool=False))
    dist.destroy_process_group()


def test_two_processes_pool_every_call_total_over_count():
    """Rank 0 logs a = 1 twice, rank 1 a = 4 once and a metric rank 0 never logs: both get a = 6 / 3 = 2 (TRL's
    pooling; the mean of the processes' means would be 2.5) and only_one = 7; unpooled, each its own."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_pooled, args=(free_port(), out), nprocs=2, join=True)
        out = dict(out)
    assert out[0][0] == out[1][0] == {"a": 2.0, "only_one": 7.0}
    assert out[0][1] == {} and out[1][1] == {}


@pytest.mark.slow
@pytest.mark.parametrize(("algo", "devices", "scored"), [("es", 1, 2.0), ("grpo", 1, 4.0), ("es", 2, 2.0)])
def test_a_fit_logs_what_reward_functions_logged(algo, devices, scored, tiny_model, tmp_path, monkeypatch):
    """ES (lowrank, chunks of 3 members: calls of 3 and 1 completions) and GRPO (4 completions of one prompt):
    train/scored is the calls' mean each step, ES's (3 + 1) / 2; on 2 processes ES's two chunks go one to each, and
    the mean pooled over both is logged, not rank 0's 3. The evaluation (2 prompts, one call) logs eval/scored 2;
    log_extra warns once a process."""
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    rows = [json.loads(line) for line in (FIXTURES / "conciseness_train3.jsonl").read_text().splitlines()]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": r["question"]}) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text('{"prompt": "What is 2 + 2?"}\n{"prompt": "Name a colour."}\n')
    config = write_tiny_config(tmp_path / "c.yaml", tiny_model, max_steps=2,
                               es={"population_size": 4, "mode": "lowrank"},
                               rollout={"temperature": 1.0, "max_batch_size": 3}, grpo={"num_generations": 4},
                               trainer={"devices": devices})
    data = yaml.safe_load(config.read_text())
    data["data"] = {"task": "jsonl", "prompts_per_step": 1,
                    "task_args": {"train_path": str(tmp_path / "train.jsonl"), "eval_path": str(tmp_path / "eval.jsonl"),
                                  "reward_funcs": ["logging_rewards:logged_length"]}}
    config.write_text(yaml.safe_dump(data))
    out = run_esrl("fit", "--config", config, "--algo", algo, "--trainer.default_root_dir", tmp_path / "run")
    assert out.returncode == 0, out.stderr[-3000:]
    (path,) = Path(tmp_path / "run").rglob("metrics.csv")
    table = list(csv.DictReader(path.open()))
    assert [float(r["train/scored"]) for r in table if r.get("train/scored")] == [scored, scored]
    assert [float(r["eval/scored"]) for r in table if r.get("eval/scored")] == [2.0, 2.0]  # before and after
    assert out.stderr.count("a reward function called log_extra('note'") == devices, out.stderr[-3000:]
