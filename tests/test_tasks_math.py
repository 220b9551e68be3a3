"""The math task: gold answers, math-verify rewards under a time limit, columns, loading, one CLI fit."""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import time

import pytest
import yaml
from conftest import FIXTURES, run_esrl, write_tiny_config

from esrl.errors import ConfigError, DataError
from esrl.tasks import build_task
from esrl.tasks.math import DEMO_DATA, boxed_content, format_reward, gold_answer
from esrl.tasks.math_verifier import INSTALL_HINT, MathVerifier

SMALL = FIXTURES / "math_small.jsonl"


@pytest.fixture(scope="module")
def verifier():
    """One verifier (one child process) for the module's written cases."""
    v = MathVerifier(time_limit=2.0)
    yield v
    v.close()


@pytest.mark.parametrize("answer,expected", [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "\\boxed{72}"),
    ("#### 1,200", "\\boxed{1200}"),
    ("#### -2", "\\boxed{-2}"),
    ("\\frac{14}{3}", "\\boxed{\\frac{14}{3}}"),              # MATH-500's bare LaTeX
    ("So the answer is $\\boxed{4}$.", "So the answer is $\\boxed{4}$."),  # MATH's solution, as it is
    ("$\\frac{1}{2}$", "$\\frac{1}{2}$"),
    (42, "\\boxed{42}"),
    ("  ", ""),
])
def test_gold_answer(answer, expected):
    assert gold_answer(answer) == expected


@pytest.mark.parametrize("text,content", [
    ("so \\boxed{\\frac{1}{2}} it is", "\\frac{1}{2}"),
    ("\\boxed{1} then \\boxed{2}", "2"),            # the last one
    ("\\boxed{12", None),                           # unbalanced
    ("no box", None),
    ("\\boxed{}", ""),
])
def test_boxed_content_and_format(text, content):
    assert boxed_content(text) == content
    assert format_reward([], [text]) == [float(bool(content))]


# gold (as the data set writes it), completion, correct?
CASES = [
    ("#### 72", "48 + 24 = 72, so \\boxed{72}", "correct"),                 # GSM8K ####
    ("#### 72", "The answer is 72.", "correct"),                            # unboxed plain number
    ("#### 1,200", "\\boxed{1,200}", "correct"),                            # thousands separator
    ("#### 72", "\\boxed{73}", "wrong"),
    ("#### 72", "\\boxed{70}, or else \\boxed{72}", "wrong"),  # hedging with two boxes: no credit
    ("#### -2", "the answer is -2", "correct"),
    ("\\frac{14}{3}", "\\boxed{\\dfrac{14}{3}}", "correct"),                # boxed LaTeX fraction
    ("\\frac{14}{3}", "$\\boxed{14/3}$", "correct"),
    ("\\frac{14}{3}", "\\boxed{4.67}", "wrong"),
    ("\\frac{1}{2}", "\\boxed{0.5}", "correct"),                            # equivalent forms
    ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}", "correct"),
    ("x^2+2x+1", "\\boxed{(x+1)^2}", "correct"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{(3, \\pi/2)}", "correct"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{(3, \\pi)}", "wrong"),
    ("#### 72", "I do not know.", "unparsed"),                              # unparsable
    ("#### 72", "", "unparsed"),
    ("\\boxed{}", "\\boxed{1}", "bad_gold"),                    # the gold itself does not parse
]


def test_written_cases(verifier):
    golds = [gold_answer(g) for g, _, _ in CASES]
    assert verifier.verify(golds, [c for _, c, _ in CASES]) == [s for _, _, s in CASES]


def test_adversarial_inputs_stay_within_the_time_limit(verifier):
    """Inputs that make math-verify run for long (deep nesting, a power tower) time out and score 0 within the
    limit; 100k characters of digits are refused quickly; the verifier works afterwards."""
    bombs = {"\\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}": "timeout",
             "\\boxed{9^{9^{9^{9}}}} = 5": "timeout", "1" * 100_000: "unparsed"}
    for i, (bomb, expected) in enumerate(bombs.items()):
        assert verifier.verify(["\\boxed{1}"], [f"\\boxed{{{i}}}"])  # a child is up before the clock starts
        start = time.monotonic()
        assert verifier.verify(["\\boxed{5}"], [bomb]) == [expected]
        assert time.monotonic() - start < verifier.time_limit + 1.0, bomb[:30]
    assert verifier.counts["timeout"] >= 2
    assert verifier.verify(["\\boxed{5}"], ["\\boxed{5}"]) == ["correct"]


def test_a_child_past_the_limit_is_killed_and_replaced():
    """With the child's own soft limit out of reach, the parent's hard limit kills it; the next completion
    gets a fresh child."""
    v = MathVerifier(time_limit=1.0, soft_limit=60.0)
    try:
        assert v.verify(["\\boxed{1}"], ["\\boxed{1}"]) == ["correct"]
        pid = v._proc.pid
        start = time.monotonic()
        assert v.verify(["\\boxed{5}"], ["\\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}"]) == ["timeout"]
        assert time.monotonic() - start < 1.0 + 1.0  # the limit, and the kill
        assert v.restarts == 1
        assert v.verify(["\\boxed{2}"], ["\\boxed{2}"]) == ["correct"]
        assert v._proc.pid != pid
    finally:
        v.close()


def test_verifier_works_outside_the_main_thread(verifier):
    """No signal is used in the calling process, so a worker thread (where signal.alarm fails) works too."""
    out = []
    thread = threading.Thread(target=lambda: out.append(verifier.verify(["\\boxed{3}"], ["so \\boxed{3}"])))
    thread.start()
    thread.join(30)
    assert out == [["correct"]]


def test_task_rewards_metrics_and_prompt():
    task = build_task("math", path=str(SMALL), num_train=6, format_weight=0.5)
    assert (len(task.train_rows), len(task.eval_rows)) == (6, 4)
    prompt = task.prompt(task.train_rows[0])
    assert prompt[-1]["role"] == "user" and prompt[-1]["content"].startswith("Natalia sold clips")
    assert prompt[-1]["content"].endswith("put your final answer within \\boxed{}.")
    rows = task.train_rows[:3]
    texts = ["so \\boxed{72}", "The answer is 400.", "no idea"]
    assert task.rewards(rows, texts) == [1.5, 1.0, 0.0]  # correctness + 0.5 * format
    metrics = task.metrics(rows, texts)
    assert metrics["accuracy"] == [1.0, 1.0, 0.0]
    assert metrics["format"] == [1.0, 0.0, 0.0]
    assert metrics["unparsed"] == [0.0, 0.0, 1.0]
    assert metrics["timeout"] == [0.0, 0.0, 0.0]
    chat = task.as_completions(task.prompts(rows), texts)  # TRL's message format works as well
    assert task.reward_funcs[0](task.prompts(rows), chat, gold=[r["gold"] for r in rows]) == [1.0, 1.0, 0.0]
    copy = pickle.loads(pickle.dumps(task))  # e.g. for spawned processes: the copy starts its own verifier
    assert copy.rewards(rows[:1], texts[:1]) == [1.5]


def test_column_options_jsonl_and_parquet(tmp_path):
    rows = [{"problem": "What is $1+1$?", "solution": "$1+1=\\boxed{2}$"},
            {"problem": "What is $\\frac{1}{2}+\\frac{1}{2}$?", "solution": "\\boxed{1}"}]
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = build_task("math", path=str(path), question_field="problem", answer_field="solution", chat=False,
                      prompt_template="Q: {question}\nA:")
    assert task.prompt(task.train_rows[0]) == "Q: What is $1+1$?\nA:"
    assert task.rewards(task.train_rows, ["\\boxed{2}", "\\boxed{2}"]) == [1.0, 0.0]

    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": r["problem"], "a": r["solution"]} for r in rows]), parquet)
    task = build_task("math", path=str(parquet), question_field="q", answer_field="a")
    assert [r["gold"] for r in task.train_rows] == [r["solution"] for r in rows] and not task.eval_rows
    # the eval file is read with the same column options, which it lacks: one line naming the column
    with pytest.raises(DataError, match=r"math.parquet row 0: no question column 'problem' .*question_field"):
        build_task("math", path=str(path), eval_path=str(parquet), question_field="problem",
                   answer_field="solution", num_train=1)


def test_bad_data_is_one_line_naming_it(tmp_path):
    no_answer = tmp_path / "no_answer.jsonl"
    no_answer.write_text(json.dumps({"question": "1+1?", "solution": "2"}) + "\n")
    with pytest.raises(DataError) as e:
        build_task("math", path=str(no_answer))
    assert str(e.value) == (f"{no_answer}:1: no answer column 'answer' (columns: question, solution); "
                            "set data.task_args.answer_field")
    with pytest.raises(DataError, match="file not found"):
        build_task("math", path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="data.task_args.num_train: .* has only 10 rows, got 11"):
        build_task("math", path=str(SMALL), num_train=11)
    with pytest.raises(ConfigError, match="data.task_args.time_limit"):
        build_task("math", path=str(SMALL), time_limit=0)


def test_hub_offline_fails_at_once_in_one_line(monkeypatch):
    """HF_HUB_OFFLINE (the tests' setting) and an unreachable endpoint: one line naming the data set."""
    with pytest.raises(DataError, match=r"^openai/gsm8k \(config 'main', split 'train'\): cannot load") as e:
        build_task("math", path="openai/gsm8k")
    assert "\n" not in str(e.value)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    with pytest.raises(DataError, match=r"127\.0\.0\.1:9 unreachable.*HF_HUB_OFFLINE=1") as e:
        build_task("math", path="HuggingFaceH4/MATH-500", config=None, split="test", eval_split=None)
    assert "\n" not in str(e.value)


def test_packaged_demo_data_by_name():
    task = build_task("math", path="math_demo.jsonl", num_train=12)
    assert (len(task.train_rows), len(task.eval_rows)) == (12, 4)
    assert len(DEMO_DATA.read_text().splitlines()) == 16


def test_missing_math_verify_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if not installed
    with pytest.raises(ConfigError) as e:
        build_task("math", path=str(SMALL))
    assert str(e.value) == INSTALL_HINT == "data.task: math needs math-verify: pip install 'esrl[math]'"
    from esrl.needs import local_needs

    assert [n.line() for n in local_needs({"data": {"task": "math"}}) if n.status == "missing"] == [
        "data.task: math needs math-verify (pip install 'esrl[math]')"]


def test_one_step_fit_through_the_cli(tiny_model, tmp_path):
    """ES for one step on the math task with the tiny model; the shared evaluation logs accuracy, the
    unparsed count and pass@k."""
    config = write_tiny_config(tmp_path / "math.yaml", tiny_model, max_steps=1, prompts_per_step=2,
                               es={"population_size": 2, "sigma": 0.01, "alpha": 0.01})
    data = yaml.safe_load(config.read_text())
    data["data"] = {"task": "math", "task_args": {"path": str(SMALL), "num_train": 8, "format_weight": 0.1},
                    "prompts_per_step": 2}
    data["trainer"]["callbacks"] = [{"class_path": "esrl.callbacks.Evaluation",
                                     "init_args": {"before": False, "num_samples": 2, "kl": False}}]
    config.write_text(yaml.safe_dump(data))
    out = run_esrl("fit", "--config", config, "--trainer.default_root_dir", tmp_path / "run")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    eval_file = next((tmp_path / "run").rglob("eval.jsonl"))
    lines = [json.loads(line) for line in eval_file.read_text().splitlines()]
    assert [r["step"] for r in lines] == [1]
    for record in lines:
        assert {"accuracy", "format", "unparsed", "timeout", "pass@1", "pass@2", "reward"} <= record.keys()
        assert 0.0 <= record["unparsed"] <= 1.0


PARENT = r'''
import sys
from esrl.tasks.math_verifier import MathVerifier
verifier = MathVerifier(time_limit=600)
verifier.verify(["72"], ["72"])
print(verifier._proc.pid, flush=True)
verifier.verify(["72"], [sys.argv[1]])  # minutes of big-integer arithmetic in C, no timer gets through
'''


def test_the_verifier_child_dies_with_a_parent_killed_mid_completion():
    """A parent SIGKILLed (the OOM killer, srun past its grace period) while its child verified a costly completion
    left the child running on in its own session, an orphan computing 7^300000000 for minutes: the kernel now
    kills it with its parent."""
    import signal
    import subprocess
    import sys
    import time

    pytest.importorskip("math_verify")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, r"The answer is $\boxed{7^{300000000}}$"],
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        time.sleep(2)  # inside the costly completion
        assert parent.poll() is None and os.path.exists(f"/proc/{child}")
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{child}") and _state(child) != "Z" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{child}") or _state(child) == "Z"
    finally:
        if os.path.exists(f"/proc/{child}"):
            os.kill(child, signal.SIGKILL)


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


class _FixedVerifier:
    def verify(self, golds, completions):
        return ["correct", "wrong", "unparsed", "timeout", "bad_gold"][:len(completions)]


def test_only_a_correct_status_scores_one():
    """The reward of each verifier status: a timeout or an unparsable completion scores 0, not 1 (no test fed the
    reward function those statuses)."""
    from esrl.tasks.math import MathReward

    with pytest.warns(UserWarning):  # the bad gold answer is named
        got = MathReward(_FixedVerifier())([], ["a", "b", "c", "d", "e"], gold=["g"] * 5)
    assert got == [1.0, 0.0, 0.0, 0.0, 0.0]
