"""The jsonl task: any prompt file, reward functions by import path, errors that name file and line."""

from __future__ import annotations

import json
import sys

import pytest

from esrl.errors import ConfigError, DataError
from esrl.tasks import Task, build_task
from esrl.tasks.jsonl import build, import_function
from esrl.tasks.io import read_json_list, read_jsonl

REWARDS = '''
def length(prompts, completions, **kwargs):
    return [float(len(c if isinstance(c, str) else c[-1]["content"])) for c in completions]

def says_target(prompts, completions, target, **kwargs):
    # A column of the rows arrives as a keyword; None means "not applicable".
    return [None if t is None else float(t in (c if isinstance(c, str) else c[-1]["content"]))
            for c, t in zip(completions, target)]

def seen_prompts(prompts, completions, **kwargs):
    return [1.0 if isinstance(p, list) else 0.0 for p in prompts]

NOT_CALLABLE = 3

def _named_length(prompts, completions, **kwargs):
    return [1.0] * len(completions)

_named_length.__name__ = "length"  # as a decorator's wrapper would name it
'''


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    pkg = tmp_path / "my_rewards_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_pkg.rewards"
    for name in ("my_rewards_pkg.rewards", "my_rewards_pkg"):
        sys.modules.pop(name, None)


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_rewards_by_import_path_and_columns(tmp_path, rewards_module):
    rows = [{"prompt": "Say hi", "target": "hi"}, {"prompt": "Any", "target": None}]
    train = _write(tmp_path / "train.jsonl", rows)
    task = build_task("jsonl", train_path=train,
                      reward_funcs=[f"{rewards_module}:length", f"{rewards_module}.says_target"],
                      reward_weights=[0.5, 10.0], stop=["\n"])
    rows = task.train_rows
    assert task.prompt(rows[0]) == [{"role": "user", "content": "Say hi"}]  # chat by default
    assert task.rewards(rows, ["hi there", "abc"]) == [0.5 * 8 + 10.0, 0.5 * 3]  # None counts as 0
    assert task.metrics(rows, ["hi there", "abc"]) == {"length": [8.0, 3.0], "says_target": [1.0, 0.0]}
    assert task.stop == ["\n"] and task.eval_rows == []


def test_raw_prompts_and_message_prompts(tmp_path, rewards_module):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    train = _write(tmp_path / "t.jsonl", [{"text": "Q: 1+1\nA:"}, {"text": messages}])
    task = build(train, prompt_field="text", chat=False, reward_funcs=[f"{rewards_module}:seen_prompts"])
    assert task.prompt(task.train_rows[0]) == "Q: 1+1\nA:"  # raw text
    assert task.prompt(task.train_rows[1]) == messages  # a conversation stays a conversation
    assert task.rewards(task.train_rows, ["2", "Hello"]) == [0.0, 1.0]


def test_eval_file(tmp_path, rewards_module):
    train = _write(tmp_path / "train.jsonl", [{"prompt": "a"}])
    ev = _write(tmp_path / "eval.jsonl", [{"prompt": "b"}, {"prompt": "c"}])
    task = build(train, eval_path=ev, reward_funcs=[f"{rewards_module}:length"])
    assert [r["prompt"] for r in task.eval_rows] == ["b", "c"]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "a"}\n{"prompt": "b",}\n', r"data.jsonl:2: invalid JSON \(Expecting property name"),
        ('{"prompt": "a"}\n\n\n["b"]\n', r"data.jsonl:4: expected a JSON object, got list"),
        ('{"prompt": "a"}\n{"question": "b"}\n', r"data.jsonl:2: missing field 'prompt'"),
        ('{"prompt": 3}\n', r"data.jsonl:1: field 'prompt' must be a string or list"),
        ('{"prompt": [{"role": "user"}]}\n', r"data.jsonl:1: field 'prompt' must be a string or a list of"),
        ('\n  \n', r"data.jsonl: no rows"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        build(str(path), reward_funcs=["esrl.tasks.conciseness:completion_length"])


def test_encoding_error_names_its_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match=r"data.jsonl:2: not UTF-8"):
        read_jsonl(path)


def test_missing_file(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"absent.jsonl: file not found$"):
        build(str(tmp_path / "absent.jsonl"), reward_funcs=["esrl.tasks.conciseness:completion_length"])
    # a shipped config run from another folder: its relative data path names the folder it was looked for in
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as e:
        build("configs/data/absent.jsonl", reward_funcs=["esrl.tasks.conciseness:completion_length"])
    assert str(e.value) == (f"configs/data/absent.jsonl: file not found in {tmp_path} (a relative path is read from "
                            "the current folder)")


def test_json_list_syntax_error_names_line(tmp_path):
    path = tmp_path / "list.json"
    path.write_text('[\n {"a": 1},\n {"a": 2}\n {"a": 3}\n]')
    with pytest.raises(DataError, match=r"list.json:4: invalid JSON"):
        read_json_list(path)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_module_xyz:f", r"^data.task_args.reward_funcs: cannot import 'no_such_module_xyz:f'"),
        ("esrl.tasks.conciseness:nope", r"^data.task_args.reward_funcs: cannot import 'esrl.tasks.conc"),
        ("justaname", r"^data.task_args.reward_funcs: 'justaname' is not an import path"),
        ("{mod}:NOT_CALLABLE", r"is not callable"),
    ],
)
def test_bad_reward_import_paths(tmp_path, rewards_module, spec, message):
    train = _write(tmp_path / "t.jsonl", [{"prompt": "a"}])
    with pytest.raises(ConfigError, match=message):
        build(train, reward_funcs=[spec.format(mod=rewards_module)])


def test_config_errors(tmp_path, rewards_module):
    train = _write(tmp_path / "t.jsonl", [{"prompt": "a"}])
    with pytest.raises(ConfigError, match="^data.task_args.reward_funcs"):
        build(train)
    with pytest.raises(ConfigError, match="^data.task_args.reward_weights"):
        build(train, reward_funcs=[f"{rewards_module}:length"], reward_weights=[1.0, 2.0])
    # one stop string given as a str is that string, not its characters; an empty one would cut everything
    assert build(train, reward_funcs=[f"{rewards_module}:length"], stop="</answer>").stop == ["</answer>"]
    with pytest.raises(ConfigError, match="stop must be a list of non-empty strings"):
        build(train, reward_funcs=[f"{rewards_module}:length"], stop=["</answer>", ""])


def test_reward_functions_of_one_name_are_refused_naming_both(tmp_path, rewards_module):
    """Two functions named `length` logged as one rewards/length (the last one's values), and only one became an
    evaluation metric: refused by the Task, each function named by its import path (the same function listed twice
    too: a weight says that)."""
    train = _write(tmp_path / "t.jsonl", [{"prompt": "a"}])
    specs = [f"{rewards_module}:length", f"{rewards_module}:_named_length"]
    with pytest.raises(ConfigError, match=f"^task 'jsonl': reward functions share a name: {specs[0]} is named "
                                          f"'length'; {specs[1]} is named 'length': each logs as rewards/<its name>"):
        build(train, reward_funcs=specs)
    with pytest.raises(ConfigError, match="is named 'length'"):
        build(train, reward_funcs=[specs[0], specs[0]])
    funcs = build(train, reward_funcs=specs[:1]).reward_funcs
    with pytest.raises(ConfigError, match=f"^task 't': reward functions share a name: {specs[0]} is named 'length'; "):
        Task("t", [], [], reward_funcs=[funcs[0], funcs[0]])


def test_a_task_refuses_fewer_weights_than_reward_functions(rewards_module):
    """zip() would drop the reward functions past the last weight, silently (TRL refuses too): any Task, a custom
    builder's included."""
    from esrl.tasks.base import Task

    funcs = [import_function(f"{rewards_module}:length"), import_function(f"{rewards_module}:seen_prompts")]
    assert Task("mine", [], [], funcs, reward_weights=[1.0, 2.0]).reward_weights == [1.0, 2.0]
    with pytest.raises(ConfigError, match="task 'mine': 1 reward_weights for 2 reward functions"):
        Task("mine", [], [], funcs, reward_weights=[1.0])
    with pytest.raises(ConfigError, match="stop must be a list"):
        Task("mine", [], [], funcs, stop="</answer>")


@pytest.mark.parametrize("weights", [["a"], [float("nan")], [True]])
def test_a_weight_that_is_no_finite_number_is_refused(tmp_path, rewards_module, weights):
    """A string weight was a TypeError traceback at the first evaluation; a NaN one blamed the reward function."""
    train = _write(tmp_path / "t.jsonl", [{"prompt": "a"}])
    with pytest.raises(ConfigError, match=r"^task 'jsonl': reward_weights must be a list of finite numbers, one per "
                                          r"reward function, got \["):
        build(train, reward_funcs=[f"{rewards_module}:length"], reward_weights=weights)
    with pytest.raises(ConfigError, match=r"^data.task_args.reward_weights: a list of numbers, one per reward "
                                          r"function, got 5$"):
        build(train, reward_funcs=[f"{rewards_module}:length"], reward_weights=5)


@pytest.mark.parametrize("prompt", ["", "  \n"])
def test_an_empty_prompt_is_named_with_its_line(tmp_path, rewards_module, prompt):
    """It was trained on, exit 0 (the other tasks refuse one)."""
    train = _write(tmp_path / "t.jsonl", [{"prompt": "a"}, {"prompt": prompt}])
    with pytest.raises(DataError, match=f"^{train}:2: field 'prompt' is empty$"):
        build(train, reward_funcs=[f"{rewards_module}:length"])


def test_import_function_accepts_both_spellings():
    from esrl.tasks.conciseness import length_reward

    assert import_function("esrl.tasks.conciseness:length_reward") is length_reward
    assert import_function("esrl.tasks.conciseness.length_reward") is length_reward


def test_a_trl_reward_function_plugs_in(tmp_path):
    """TRL's own reward functions share the signature, so they work unchanged (chat completions)."""
    think_format_reward = pytest.importorskip("trl.rewards").think_format_reward
    train = _write(tmp_path / "t.jsonl", [{"prompt": "Think, then answer."}] * 2)
    task = build(train, reward_funcs=["trl.rewards:think_format_reward"])
    assert task.reward_funcs == [think_format_reward]
    texts = ["<think>\nreasoning\n</think>\nanswer", "no tags at all"]
    assert task.rewards(task.train_rows, texts) == [1.0, 0.0]
