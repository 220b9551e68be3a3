"""PKU-SafeRLHF task: prompt format, stratified disjoint split, stop-string stripping, reward and metrics."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from esrl.errors import ConfigError, DataError
from esrl.scoring import Scorer, find_constrained_reward
from esrl.tasks import build_task
from esrl.tasks.pku_saferlhf import clean_response, format_prompt, stratified_split, stratum


class TableScorer(Scorer):
    """Rewards and costs looked up by response; records what it was asked."""

    name = "table"

    def __init__(self, table: dict[str, tuple[float, float]]):
        super().__init__()
        self.table = table
        self.calls: list[tuple[list[str], list[str]]] = []

    def _score(self, prompts, responses):
        self.calls.append((prompts, responses))
        return [self.table[r][0] for r in responses], [self.table[r][1] for r in responses]


def _row(i: int, safe0: bool, safe1: bool, prompt: str | None = None) -> dict:
    return {"prompt": prompt or f"question {i}?", "response_0": f"a{i}", "response_1": f"b{i}",
            "is_response_0_safe": safe0, "is_response_1_safe": safe1, "prompt_source": "test",
            "response_0_harm_category": {"Violence": not safe0}, "better_response_id": i % 2}


@pytest.fixture
def pku_file(tmp_path):
    # 30 rows with both references safe, 12 with one, 18 with none, and a repeated prompt (dropped).
    rows = [_row(i, True, True) for i in range(30)]
    rows += [_row(30 + i, i % 2 == 0, i % 2 == 1) for i in range(12)]
    rows += [_row(42 + i, False, False) for i in range(18)]
    rows.append(_row(99, False, False, prompt="question 0?"))
    path = tmp_path / "pku.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_format_and_stop(tmp_path):
    assert format_prompt("How do I bake bread?") == \
        "BEGINNING OF CONVERSATION: USER: How do I bake bread? ASSISTANT:"
    task = build_task("pku_saferlhf", train_path=_write(tmp_path / "t.jsonl", [_row(0, True, False)]), num_train=None,
                      scorer=TableScorer({}))
    assert task.prompt(task.train_rows[0]) == "BEGINNING OF CONVERSATION: USER: question 0? ASSISTANT:"
    assert task.stop == ["USER:"]


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_stop_string_stripping():
    assert clean_response(" Sure, here it is.\n\nUSER:") == "Sure, here it is."
    assert clean_response("Fine.  USER: USER:") == "Fine."
    assert clean_response("  plain answer \n") == "plain answer"
    assert clean_response("The USER: field stays") == "The USER: field stays"  # only a trailing turn is cut
    assert clean_response("USER:") == ""


def test_stratified_split_disjoint_seeded_balanced(pku_file):
    task = build_task("pku_saferlhf", path=str(pku_file), num_train=20, num_eval=10, seed=7, scorer=TableScorer({}))
    train, evals = task.train_rows, task.eval_rows
    assert len(train) == 20 and len(evals) == 10
    prompts_train, prompts_eval = {r["prompt"] for r in train}, {r["prompt"] for r in evals}
    assert len(prompts_train) == 20 and len(prompts_eval) == 10
    assert not prompts_train & prompts_eval
    # proportional to the strata 30 : 12 : 18 (of 60 distinct prompts)
    assert Counter(stratum(r) for r in train) == {2: 10, 1: 4, 0: 6}
    assert Counter(stratum(r) for r in evals) == {2: 5, 1: 2, 0: 3}
    # the repeated prompt's second row (id 99) is never used
    assert all(r["response_0"] != "a99" for r in train + evals)
    # seeded: same seed, same rows in the same order; another seed, other rows
    again = build_task("pku_saferlhf", path=str(pku_file), num_train=20, num_eval=10, seed=7, scorer=TableScorer({}))
    assert again.train_rows == train and again.eval_rows == evals
    other = build_task("pku_saferlhf", path=str(pku_file), num_train=20, num_eval=10, seed=8, scorer=TableScorer({}))
    assert [r["prompt"] for r in other.train_rows] != [r["prompt"] for r in train]
    # all columns are kept for reward functions
    assert "response_0_harm_category" in train[0]


def test_stratified_split_rounding_and_limits(pku_file):
    from esrl.tasks.io import read_jsonl

    rows = read_jsonl(pku_file)
    train, evals = stratified_split(rows, 7, 3, seed=0)
    # 7 * (30, 12, 18) / 60 = (3.5, 1.4, 2.1) -> largest remainders -> (4, 1, 2)
    assert Counter(stratum(r) for r in train) == {2: 4, 1: 1, 0: 2}
    assert len(evals) == 3
    with pytest.raises(ConfigError, match="60 distinct prompts"):
        stratified_split(rows, 50, 11)


def test_stratified_split_takes_every_prompt_when_both_quotas_round_up_in_one_stratum(pku_file):
    """Strata of 3, 3 and 4 prompts split 5 + 5: each quota alone rounds the 3-prompt stratum up to 2 (2 + 2 > 3);
    the eval row it lacks comes from where rows are left, and a split of every prompt still succeeds."""
    rows = [{"prompt": f"p{i}", "is_response_0_safe": i < 6, "is_response_1_safe": i < 3} for i in range(10)]
    train, evals = stratified_split(rows, 5, 5, seed=0)
    assert len(train) == len(evals) == 5
    assert {r["prompt"] for r in train} | {r["prompt"] for r in evals} == {r["prompt"] for r in rows}
    assert stratified_split(rows, 5, 5, seed=0) == (train, evals)
    with pytest.raises(ConfigError, match="num_train must be >= 1"):
        build_task("pku_saferlhf", path=str(pku_file), num_train=0, num_eval=0, scorer=TableScorer({}))


def test_bad_data_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_row(0, True, True)) + "\n" + json.dumps({"prompt": "x", "is_response_0_safe": True})
                    + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: missing field 'is_response_1_safe'"):
        build_task("pku_saferlhf", path=str(path), num_train=1, num_eval=0, scorer=TableScorer({}))


def test_missing_scorer_is_a_config_error(pku_file):
    with pytest.raises(ConfigError, match="data.task_args.scorer"):
        build_task("pku_saferlhf", path=str(pku_file), num_train=2, num_eval=2)


@pytest.mark.parametrize("option, value, message", [
    ("retries", -1, "data.task_args.retries: must be >= 0, got -1"),
    ("timeout", 0, "data.task_args.timeout: seconds, must be > 0, got 0"),
    ("backoff", -1, "data.task_args.backoff: seconds, must be >= 0, got -1"),
])
def test_bad_scorer_service_option_names_its_field(pku_file, option, value, message):
    """A ConfigError naming the task_args field, not HTTPScorer's ValueError naming none (no server)."""
    with pytest.raises(ConfigError) as error:
        build_task("pku_saferlhf", path=str(pku_file), num_train=2, num_eval=2, scorer="http://127.0.0.1:9",
                   **{option: value})
    assert str(error.value) == message


def test_reward_and_quadrant_metrics(pku_file):
    table = {"helpful safe": (1.0, -1.0), "unhelpful safe": (-1.0, -2.0), "helpful harmful": (2.0, 3.0),
             "borderline": (0.0, 0.0)}
    scorer = TableScorer(table)
    task = build_task("pku_saferlhf", path=str(pku_file), num_train=4, num_eval=4, scorer=scorer, lambda_init=0.5)
    rows = task.eval_rows
    texts = [" helpful safe\nUSER:", "unhelpful safe", " helpful harmful USER:", "borderline\n"]
    # reward - lambda * cost per sample
    assert task.rewards(rows, texts) == [1.0 + 0.5, -1.0 + 1.0, 2.0 - 1.5, 0.0]
    # the scorer saw the users' requests (not the formatted prompt) and the stripped responses
    assert scorer.calls[0] == ([r["prompt"] for r in rows], list(table))
    metrics = task.metrics(rows, texts)
    assert len(scorer.calls) == 1  # metrics reuse the batch's scores
    assert metrics["safe"] == [1.0, 1.0, 0.0, 1.0]  # cost <= 0
    assert metrics["helpful"] == [1.0, 0.0, 1.0, 0.0]  # reward > 0
    assert metrics["safe_helpful"] == [1.0, 0.0, 0.0, 0.0]
    assert metrics["safe_unhelpful"] == [0.0, 1.0, 0.0, 1.0]
    assert metrics["unsafe_helpful"] == [0.0, 0.0, 1.0, 0.0]
    assert metrics["unsafe_unhelpful"] == [0.0, 0.0, 0.0, 0.0]
    assert metrics["raw_reward"] == [1.0, -1.0, 2.0, 0.0]
    assert metrics["cost"] == [-1.0, -2.0, 3.0, 0.0]
    # the raw scores of the last batch are exposed for logging, on the reward and on the scorer
    reward = find_constrained_reward(task)
    assert reward is task.reward_funcs[0]
    assert reward.last_rewards == scorer.last_rewards == [1.0, -1.0, 2.0, 0.0]
    assert reward.last_costs == scorer.last_costs == [-1.0, -2.0, 3.0, 0.0]
    # an algorithm adapts lambda through the reward's Lagrangian: log lambda += lambda_lr * (mean cost + d)
    assert reward.lagrangian.adapt and reward.lam == 0.5
    lam = reward.lagrangian.update(sum(reward.last_costs) / 4)  # mean cost 0: lambda unchanged
    assert lam == pytest.approx(0.5)
    lam = reward.lagrangian.update(2.0)  # EMA 0.9 * 0 + 0.1 * 2 = 0.2 -> log lambda += 0.1 * 0.2
    assert lam == pytest.approx(0.5 * math.exp(0.02))
    assert task.rewards(rows, texts) == pytest.approx([1.0 + lam, -1.0 + 2 * lam, 2.0 - 3 * lam, 0.0])


def test_presplit_files(tmp_path):
    train = _write(tmp_path / "train.jsonl", [_row(i, True, False) for i in range(5)])
    evals = _write(tmp_path / "eval.jsonl", [_row(10 + i, False, False) for i in range(3)])
    task = build_task("pku_saferlhf", train_path=train, eval_path=evals, num_train=4, num_eval=None,
                      scorer=TableScorer({}))
    assert [r["prompt"] for r in task.train_rows] == [f"question {i}?" for i in range(4)]
    assert len(task.eval_rows) == 3
