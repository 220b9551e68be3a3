"""Non-finite and non-numeric rewards (issue 17.1): one policy for ES and GRPO, and weights never non-finite."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from conftest import FIXTURES, load_safetensors, run_esrl, write_tiny_config

from esrl import finite
from esrl.errors import NonFiniteUpdateError, RewardError
from esrl.es.noise import population
from esrl.es.params import select_params
from esrl.es.shaping import shape_fitness
from esrl.es.update import es_step
from esrl.finite import all_finite
from esrl.tasks.base import Task
from esrl.tasks.reward_values import check_bad_rewards

NAN, INF = math.nan, math.inf


# -- units: shaping, the threshold, types, the update guard -------------------------------------------------------
@pytest.mark.parametrize("method", ["zscore", "centered_rank", "raw"])
def test_shaping_leaves_out_non_finite_members(method):
    fitness = torch.tensor([1.0, NAN, 3.0, INF, 6.0, -INF], dtype=torch.float64)
    shaped = shape_fitness(fitness, method)
    finite = torch.tensor([1.0, 3.0, 6.0], dtype=torch.float64)
    assert torch.isfinite(shaped).all()
    assert shaped[[1, 3, 5]].tolist() == [0.0, 0.0, 0.0]
    assert torch.equal(shaped[[0, 2, 4]], shape_fitness(finite, method))  # as if the bad ones never ran


def test_too_many_bad_rewards_stop_the_step_naming_function_and_step():
    check_bad_rewards(0, 4, step=3, unit="ES members", sources=[], min_usable=2)
    check_bad_rewards(2, 4, step=3, unit="ES members", sources=["f"], min_usable=2)  # half is allowed
    with pytest.raises(RewardError, match=r"^step 3: reward function f gave non-finite .* 3 of 4 ES members"):
        check_bad_rewards(3, 4, step=3, unit="ES members", sources=["f"], min_usable=2)
    with pytest.raises(RewardError, match="1 of 2"):  # half, but fewer than 2 usable members
        check_bad_rewards(1, 2, step=0, unit="ES members", sources=["f"], min_usable=2)


def _task(*funcs, weights=None) -> Task:
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    return Task(name="t", train_rows=rows, eval_rows=[], reward_funcs=list(funcs), reward_weights=weights)


def test_rewards_non_finite_become_nan_and_name_their_function():
    def good(prompts, completions, **kw):
        return [1.0, None]

    def broken(prompts, completions, **kw):
        return [INF, 2]

    task = _task(good, broken)
    out = task.rewards(task.train_rows, ["x", "y"])
    assert math.isnan(out[0]) and out[1] == 2.0
    assert task.last_bad == {"broken": 1}
    task = _task(good)
    assert task.rewards(task.train_rows, ["x", "y"]) == [1.0, 0.0] and task.last_bad == {}


@pytest.mark.parametrize("value", [True, "1.5", "nan", [1.0], {"r": 1}])
def test_a_non_number_reward_is_an_error_naming_the_function(value):
    def picky(prompts, completions, **kw):
        return [1.0, value]

    task = _task(picky)
    with pytest.raises(RewardError, match=r"^reward function picky returned .* for completion 1: values must be"):
        task.rewards(task.train_rows, ["x", "y"])


def test_numpy_and_torch_scalars_are_numbers():
    np = pytest.importorskip("numpy")

    def scalars(prompts, completions, **kw):
        return [np.float32(0.5), torch.tensor(2)]

    task = _task(scalars)
    assert task.rewards(task.train_rows, ["x", "y"]) == [0.5, 2.0]


def test_async_reward_functions_are_awaited_as_trl_awaits_them():
    """TRL takes async reward functions (trl's is_async_callable: `async def`, a partial of one, an object with an async
    __call__) and awaits them; so does Task.rewards, for ES and GRPO alike (it crashed on the coroutine): values,
    None, non-finite values and errors as a sync function's, on one event loop from call to call (a client bound to
    it lives on), also for metric functions."""
    import asyncio
    import functools

    from trl.trainer.utils import is_async_callable

    loops = []

    async def length(prompts, completions, scale=1.0, **kw):
        await asyncio.sleep(0)
        loops.append(asyncio.get_running_loop())
        return [scale * len(c) for c in completions]

    class Judge:
        async def __call__(self, prompts, completions, **kw):
            return [None, INF]

    async def judge_down(prompts, completions, **kw):
        raise ValueError("503")

    funcs = [length, functools.partial(length, scale=2.0), Judge()]
    assert all(is_async_callable(f) for f in funcs)
    task = _task(*funcs)
    for _ in range(2):
        out = task.rewards(task.train_rows, ["xy", "xyz"])
        assert out[0] == 6.0 and math.isnan(out[1]) and list(task.last_bad.values()) == [1]
    assert len(loops) == 4 and len(set(loops)) == 1
    task.metric_funcs = {"length": length}
    assert task.metrics(task.train_rows, ["x", "yz"]) == {"length": [1.0, 2.0]}
    with pytest.raises(RewardError, match=r"^reward function judge_down raised ValueError: 503$"):
        _task(judge_down).rewards(task.train_rows, ["x", "y"])


def test_async_reward_functions_run_together_as_trl_gathers_them():
    """TRL's GRPOTrainer runs the async reward functions of a step together (asyncio.gather): two judges that each
    wait for the other to have started finish only when they run at once (one after another, each gives up and
    says so). The first in order of those that raise is the one named; a sync one that raises leaves no coroutine
    unawaited."""
    import asyncio
    import gc
    import warnings

    started = set()

    def waiting_for(me, other):
        async def judge(prompts, completions, **kw):
            started.add(me)
            for _ in range(1000):
                if other in started:
                    return [1.0] * len(completions)
                await asyncio.sleep(0)
            return [0.0] * len(completions)  # gave up: the other never ran beside it

        judge.__name__ = me
        return judge

    task = _task(waiting_for("a", "b"), waiting_for("b", "a"))
    assert task.rewards(task.train_rows, ["x", "y"]) == [2.0, 2.0]

    async def down(prompts, completions, **kw):
        raise ConnectionError("judge 1 down")

    async def down_too(prompts, completions, **kw):
        raise ConnectionError("judge 2 down")

    with pytest.raises(RewardError, match=r"^reward function down raised ConnectionError: judge 1 down$"):
        _task(down, down_too).rewards(task.train_rows, ["x", "y"])

    def broken(prompts, completions, **kw):
        raise KeyError("answer")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RewardError, match=r"^reward function broken raised KeyError"):
            _task(waiting_for("c", "d"), broken).rewards(task.train_rows, ["x", "y"])
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
    assert "c" not in started


def test_a_non_finite_es_update_is_refused_and_leaves_weights_unchanged():
    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    sel = select_params(model)
    opt = torch.optim.SGD(sel.params, lr=0.1)
    weights = torch.tensor([1.0, -1.0, INF, 0.0], dtype=torch.float64)  # never from shape_fitness; a guard
    with pytest.raises(NonFiniteUpdateError, match=r"^ES step 7: the update is not finite"):
        es_step(opt, sel, population(0, 7, 4), weights, iteration=7)
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q) and p.grad is None
    with torch.no_grad():  # a finite step that overflows the weights' dtype is caught after it
        model.weight.fill_(torch.finfo(torch.float32).max)
    with pytest.raises(NonFiniteUpdateError, match="made weights non-finite"):
        es_step(torch.optim.SGD(sel.params, lr=1e38), sel, population(0, 7, 4),
                torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64), iteration=7)


@pytest.fixture(params=["extremes", "sums"])
def finite_check(request, monkeypatch):
    """all_finite as a CPU runs it (per-tensor min/max) and as a GPU runs it (multi-tensor fp64 sums of |x|)."""
    monkeypatch.setattr(finite, "batched_on", lambda device: request.param == "sums")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), INF, -INF, None])
@pytest.mark.parametrize("where", [(0, (0, 0)), (4, (10,))])  # first element of the first tensor, last of the last
def test_all_finite_finds_one_bad_element_anywhere(dtype, bad, where, finite_check):
    """Both checks (esrl.finite) against the element-wise definition, an empty tensor (ZeRO-3 partitions), integer
    tensors and a tensor of another dtype beside."""
    tensors = [torch.randn(7, 5).to(dtype), torch.empty(0, dtype=dtype), torch.arange(3), torch.randn(4, 3),
               torch.randn(11).to(dtype)]
    if bad is not None:
        tensor, index = where
        tensors[tensor][index] = bad
    assert all_finite(tensors) == all(bool(torch.isfinite(t).all()) for t in tensors) == (bad is None)
    assert all_finite([]) and all_finite([torch.empty(0)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_finite_holds_for_the_largest_finite_weights(dtype, finite_check):
    """Sums of |x| must not overflow where every element is finite: 100k elements at the dtype's largest value (an
    fp32 sum would be inf), beside a NaN in another tensor of the same group, found."""
    huge = torch.full((100_000,), torch.finfo(dtype).max, dtype=dtype)
    assert all_finite([huge, huge.clone()])
    assert not all_finite([huge, torch.tensor([1.0, float("nan")], dtype=dtype)])


# -- through the real CLI: a jsonl task whose reward function returns NaN / inf -------------------------------------
@pytest.fixture(scope="module")
def jsonl_data(tmp_path_factory) -> dict[str, Path]:
    """Train files (3 prompts, one `bad` kind each) and one clean eval file."""
    root = tmp_path_factory.mktemp("bad_rewards")
    rows = [json.loads(line) for line in (FIXTURES / "conciseness_train3.jsonl").read_text().splitlines()]
    files = {}
    for kind in ("member", "sample", "all"):
        files[kind] = root / f"train_{kind}.jsonl"
        files[kind].write_text("".join(json.dumps({"prompt": r["question"], "bad": kind}) + "\n" for r in rows))
    files["mixed"] = root / "train_mixed.jsonl"  # one prompt all NaN, one clean: one per GRPO rank at 2 processes
    files["mixed"].write_text("".join(json.dumps({"prompt": r["question"], "bad": kind}) + "\n"
                                      for r, kind in zip(rows, ("all", "none"))))
    files["eval"] = root / "eval.jsonl"
    files["eval"].write_text('{"prompt": "What is 2 + 2?"}\n{"prompt": "Name a colour."}\n')
    return files


def _fit(tiny_model, jsonl_data, kind: str, root: Path, monkeypatch, *extra: str):
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    config = write_tiny_config(root / "c.yaml", tiny_model, max_steps=2, es={"population_size": 4},
                               rollout={"temperature": 1.0}, grpo={"num_generations": 4, "learning_rate": 1e-3})
    data = yaml.safe_load(config.read_text())
    data["data"] = {"task": "jsonl", "prompts_per_step": 1,
                    "task_args": {"train_path": str(jsonl_data[kind]), "eval_path": str(jsonl_data["eval"]),
                                  "reward_funcs": ["nonfinite_rewards:flaky"]}}
    config.write_text(yaml.safe_dump(data))
    return run_esrl("fit", "--config", config, "--trainer.default_root_dir", root / "run", *extra)


def _metric(root: Path, name: str) -> list[float]:
    (path,) = root.rglob("metrics.csv")
    return [float(r[name]) for r in csv.DictReader(path.open()) if r.get(name)]


@pytest.mark.slow
@pytest.mark.parametrize("algo, kind", [("es", "member"), ("grpo", "sample")])
def test_bad_rewards_are_excluded_and_counted(algo, kind, tiny_model, jsonl_data, tmp_path, monkeypatch):
    """ES: 2 of 4 members per iteration have a NaN / -inf reward; GRPO: 2 of 4 samples NaN / +inf. Both train on,
    log train/bad_rewards = 2 each step, and leave a finite final model."""
    out = _fit(tiny_model, jsonl_data, kind, tmp_path, monkeypatch, "--algo", algo)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _metric(tmp_path, "train/bad_rewards") == [2.0, 2.0]
    assert all(math.isfinite(v) for v in _metric(tmp_path, "train/reward_mean"))
    (final,) = tmp_path.rglob("final/model.safetensors")
    assert all(torch.isfinite(t).all() for t in load_safetensors(final).values())


@pytest.mark.slow
def test_a_grpo_rank_whose_samples_all_fail_trains_on_with_the_others(tiny_model, jsonl_data, tmp_path, monkeypatch):
    """2 processes, one prompt each: every sample of one rank is NaN, none of the other's (4 of 8, allowed). The run
    goes on; bad_rewards is the step's count (summed over ranks) and reward_min/max the finite rewards' over ranks."""
    out = _fit(tiny_model, jsonl_data, "mixed", tmp_path, monkeypatch, "--algo", "grpo", "--trainer.devices", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert _metric(tmp_path, "train/bad_rewards") == [4.0, 4.0]
    lows, highs = _metric(tmp_path, "train/reward_min"), _metric(tmp_path, "train/reward_max")
    assert len(lows) == 2 and all(0 < low <= high < math.inf for low, high in zip(lows, highs))


@pytest.mark.slow
@pytest.mark.parametrize("algo, unit", [("es", "4 of 4 ES members"), ("grpo", "4 of 4 GRPO samples")])
def test_a_step_of_mostly_bad_rewards_stops_the_run_in_one_line(algo, unit, tiny_model, jsonl_data, tmp_path,
                                                                monkeypatch):
    out = _fit(tiny_model, jsonl_data, "all", tmp_path, monkeypatch, "--algo", algo)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("esrl: error:")]
    assert errors == [f"esrl: error: step 0: reward function flaky gave non-finite rewards (NaN/inf) to {unit}, "
                      "more than the 50% allowed (at least " + ("2" if algo == "es" else "1")
                      + " must be usable); stopped before the update"], out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert not list(tmp_path.rglob("final"))


@pytest.mark.slow
def test_an_evaluation_of_mostly_bad_rewards_stops_the_run_in_one_line(tiny_model, jsonl_data, tmp_path,
                                                                       monkeypatch):
    """The evaluation follows the training's policy: NaN rewards are left out of eval/ means and counted in
    eval/bad_rewards, and more than half of them stops the run (here at the evaluation before step 1)."""
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    config = write_tiny_config(tmp_path / "c.yaml", tiny_model, max_steps=1, es={"population_size": 4})
    data = yaml.safe_load(config.read_text())
    data["data"] = {"task": "jsonl", "prompts_per_step": 1,
                    "task_args": {"train_path": str(jsonl_data["all"]), "eval_path": str(jsonl_data["all"]),
                                  "reward_funcs": ["nonfinite_rewards:flaky"]}}
    config.write_text(yaml.safe_dump(data))
    out = run_esrl("fit", "--config", config, "--trainer.default_root_dir", tmp_path / "run")
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("esrl: error:")]
    assert errors == ["esrl: error: evaluation at step 0: reward function flaky gave non-finite rewards (NaN/inf) "
                      "to 3 of 3 samples, more than the 50% allowed"], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and not list(tmp_path.rglob("final"))


def test_evaluation_means_leave_out_non_finite_values_and_count_them():
    from types import SimpleNamespace

    from esrl.callbacks.evaluation import finite_means

    module = SimpleNamespace(task=SimpleNamespace(last_bad={"f": 1}), trainer=SimpleNamespace(global_step=4))
    out = finite_means({"reward": [1.0, math.nan, 3.0], "length": [2.0, 4.0, math.inf]}, module, "reward")
    assert out == {"reward": 2.0, "length": 3.0, "bad_rewards": 1.0}
    with pytest.raises(RewardError, match=r"^evaluation at step 4: reward function f gave non-finite rewards"):
        finite_means({"reward": [math.nan, math.inf, 1.0]}, module, "reward")
