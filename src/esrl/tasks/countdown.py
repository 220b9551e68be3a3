"""Countdown (TinyZero style): reach a target with the given numbers, each used once, and + - * /.

Reward = 0.1 * format + answer, exactly as the ES paper's replication code scores it (Qiu et al. 2025,
countdown/countdown_task.py, itself TinyZero's rule): the last <answer>...</answer> counts, its text must be
made of digits, `+ - * / ( )` and spaces (so `**` and `//` count), use each given number exactly once and
come within 1e-5 of the target. The reference runs `eval` on it (and hangs on `9**9**9`); here a small
interpreter walks Python's AST of it instead, with limits that bound the time of every completion:
at most MAX_EXPRESSION_CHARS characters (spaces not counted), integers of at most MAX_INT_BITS bits (a power
or product that would exceed it is refused before it is computed), nesting as deep as Python's own parser
takes (200 parentheses) since the walk is iterative. An answer outside these limits scores 0 like any other
wrong answer; inside them every score equals the reference's. Tags are found by linear scans (str.find),
not backtracking regexes, so thousands of repeated tags cost no more than their length.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re
from typing import Any, Callable, Sequence

from esrl.errors import ConfigError, DataError
from esrl.tasks.base import Prompt, Task, completion_text
from esrl.tasks.io import read_rows

PROMPT_TEMPLATE = (
    "You are a helpful assistant. You first think about the reasoning process in your mind and then "
    "provide the user with the answer.Using the numbers {numbers}, create an equation that equals {target}. "
    "You can use basic arithmetic operations (+, -, *, /) and each number can only be used once. Show your "
    "work in <think> </think> tags. And return the final answer in <answer> </answer> tags, for example "
    "<answer> (1 + 2) / 3 </answer>.Let me solve this step by step.\n<think>"
)
STOP = ["</answer>"]
TOLERANCE = 1e-5

MAX_EXPRESSION_CHARS = 1000
"""Longest answer evaluated, spaces not counted (a correct Countdown answer needs a few dozen)."""
MAX_INT_BITS = 4096
"""Largest integer the evaluator computes, in bits (floats end at 1024; the slack lets big terms cancel)."""

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ALLOWED = re.compile(r"^[0-9+\-*/() ]+$")  # the reference's pattern ($ also matches before a final "\n")
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


# ---------------------------------------------------------------------------------------------------------
# Safe arithmetic


class _Refused(Exception):
    """An expression outside the evaluator's language or limits."""


def _binary(op: ast.operator, a: int | float, b: int | float) -> int | float:
    """a op b with Python's semantics, refusing integers beyond MAX_INT_BITS before computing them."""
    if type(a) is int and type(b) is int:
        if type(op) is ast.Pow and b > 0 and abs(a) > 1 and (abs(a).bit_length() - 1) * b >= MAX_INT_BITS:
            raise _Refused("power too large")  # |a| ** b >= 2 ** ((bits(a) - 1) * b)
        if type(op) is ast.Mult and a and b and a.bit_length() + b.bit_length() - 1 > MAX_INT_BITS:
            raise _Refused("product too large")
    return _BINARY[type(op)](a, b)


def _evaluate(tree: ast.Expression) -> int | float:
    """Post-order walk with an explicit stack (no recursion limit; a sum of 2,000 terms is 2,000 deep)."""
    values: list[int | float] = []
    todo: list[tuple[ast.AST, bool]] = [(tree.body, False)]
    while todo:
        node, children_done = todo.pop()
        kind = type(node)
        if kind is ast.Constant and type(node.value) is int:
            value = node.value
        elif kind is ast.BinOp and type(node.op) in _BINARY:
            if not children_done:
                todo += [(node, True), (node.right, False), (node.left, False)]
                continue
            right = values.pop()
            value = _binary(node.op, values.pop(), right)
        elif kind is ast.UnaryOp and type(node.op) in _UNARY:
            if not children_done:
                todo += [(node, True), (node.operand, False)]
                continue
            value = _UNARY[type(node.op)](values.pop())
        else:
            raise _Refused(f"not allowed in an equation: {kind.__name__}")
        if type(value) is int and value.bit_length() > MAX_INT_BITS:
            raise _Refused("integer too large")
        if type(value) not in (int, float):  # complex, from a negative base to a fractional power
            raise _Refused(f"not a real number: {value!r:.40}")
        values.append(value)
    return values[0]


def safe_eval(expression: str) -> float | None:
    """Value of an arithmetic expression of integers, + - * / // ** and parentheses; None if it is anything
    else, or if Python's `eval` would fail on it, or if it is beyond the limits (MAX_EXPRESSION_CHARS,
    MAX_INT_BITS).

    Operators have Python's semantics (true division, floor division, `**` right-associative, an integer to a
    negative power is a float), so values match what `eval` gives and what the data set's targets were
    computed with. Division by zero, overflow and any other syntax give None.
    """
    if len(expression) - expression.count(" ") > MAX_EXPRESSION_CHARS:
        return None
    try:
        # eval skips leading spaces; ast.parse would call them an indent.
        return float(_evaluate(ast.parse(expression.lstrip(" \t"), mode="eval")))
    except (_Refused, SyntaxError, ValueError, TypeError, ArithmeticError, RecursionError, MemoryError):
        return None


# ---------------------------------------------------------------------------------------------------------
# Tags: linear scans with the same results as the reference's lazy DOTALL regexes


def _has_pair(text: str, open_tag: str, close_tag: str) -> bool:
    """re.search(open_tag + ".*?" + close_tag, text, re.DOTALL) is not None."""
    start = text.find(open_tag)
    return start >= 0 and text.find(close_tag, start + len(open_tag)) >= 0


def _full_format(text: str) -> bool:
    """re.match(r"^<think>.*?</think>\\n<answer>.*?</answer>$", text, re.DOTALL) is not None.

    `$` matches at the end or before a final newline; the earliest "</think>\\n<answer>" leaves the most room.
    """
    if not text.startswith("<think>"):
        return False
    middle = text.find("</think>\n<answer>", len("<think>"))
    if middle < 0:
        return False
    end = len(text) - (1 if text.endswith("\n") else 0)
    return text.endswith("</answer>", 0, end) and end - len("</answer>") >= middle + len("</think>\n<answer>")


def last_answer(text: str) -> str | None:
    """The last group of re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL), or None if there is none.

    The same regex, run only up to the last "</answer>": there every "<answer>" it tries has a closing tag
    ahead, so no attempt fails after scanning to the end (what made thousands of unclosed tags quadratic).
    """
    end = text.rfind("</answer>")
    found = _ANSWER.findall(text, 0, end + len("</answer>")) if end >= 0 else []
    return found[-1] if found else None


# ---------------------------------------------------------------------------------------------------------
# Rewards (TRL signature)


def format_score(text: str) -> float:
    """Format score of a full response (the prompt's trailing "<think>" included)."""
    if _full_format(text):
        return 1.0
    return (0.1 if _has_pair(text, "<think>", "</think>") else 0.0) + \
        (0.5 if _has_pair(text, "<answer>", "</answer>") else 0.0)


def answer_score(text: str, numbers: Sequence[int], target: str | float) -> float:
    """1.0 when the last <answer> uses each given number exactly once and reaches the target within 1e-5."""
    equation = last_answer(text)
    if not equation or len(equation) - equation.count(" ") > MAX_EXPRESSION_CHARS:
        return 0.0
    if not _ALLOWED.match(equation):  # unstripped, as the reference checks it
        return 0.0
    if sorted(int(n) for n in re.findall(r"\d+", equation)) != sorted(int(n) for n in numbers):
        return 0.0
    value = safe_eval(equation)
    return float(value is not None and abs(value - float(target)) < TOLERANCE)


def format_reward(prompts: Sequence[Prompt], completions: Sequence[Any], **_: Any) -> list[float]:
    """Format reward, scored on "<think>" + completion since the prompt opens the <think> tag."""
    return [format_score("<think>" + completion_text(c)) for c in completions]


def answer_reward(prompts: Sequence[Prompt], completions: Sequence[Any], numbers: Sequence[Sequence[int]],
                  target: Sequence[str], **_: Any) -> list[float]:
    """Answer reward: 1.0 for a correct equation in the last <answer> tags, else 0."""
    return [answer_score(completion_text(c), n, t) for c, n, t in zip(completions, numbers, target)]


def countdown_reward(prompts: Sequence[Prompt], completions: Sequence[Any], numbers: Sequence[Sequence[int]],
                     target: Sequence[str], **_: Any) -> list[float]:
    """0.1 * format + answer in one function, for trainers that take a single reward."""
    fmt = format_reward(prompts, completions)
    ans = answer_reward(prompts, completions, numbers, target)
    return [0.1 * f + a for f, a in zip(fmt, ans)]


# ---------------------------------------------------------------------------------------------------------
# Data


def format_numbers(numbers: Sequence[int]) -> str:
    """Numbers as the data set prints them (a numpy array: `[ 8 16 56]`, right-aligned to the widest)."""
    width = max(len(str(n)) for n in numbers)
    return "[" + " ".join(str(n).rjust(width) for n in numbers) + "]"


def format_target(value: float) -> str:
    """Target as the data set stores it: an integer without `.0`, otherwise Python's float repr."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def make_prompt(numbers: Sequence[int], target: str) -> str:
    return PROMPT_TEMPLATE.format(numbers=format_numbers(numbers), target=target)


def _random_expression(numbers: list[int], rng: random.Random) -> str:
    """A fully parenthesised random binary tree over the numbers, in order, like the data set's solutions."""
    if len(numbers) == 1:
        return str(numbers[0])
    split = rng.randint(1, len(numbers) - 1)
    op = rng.choice("+-*/")
    return f"({_random_expression(numbers[:split], rng)} {op} {_random_expression(numbers[split:], rng)})"


def generate_problems(n: int, seed: int = 0, num_numbers: int = 3, min_number: int = 1, max_number: int = 99,
                      integer_targets: bool = True, exclude: set[tuple[Any, ...]] | None = None,
                      start_id: int = 0, field: str = "data.task_args.generate") -> list[dict[str, Any]]:
    """n distinct seeded problems in the data set's format; each target is the value of its stored solution.

    `exclude` holds (sorted numbers, target) keys that must not be produced (e.g. the training problems) and
    is updated with the new ones. `field`: the option that asked for n, named if they cannot be found.
    """
    rng = random.Random(seed)
    seen = exclude if exclude is not None else set()
    rows: list[dict[str, Any]] = []
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 1000 * n + 10_000:
            raise ConfigError(f"{field}: cannot find {n} distinct problems with these settings (num_numbers, "
                              "min_number, max_number, integer_targets)")
        numbers = [rng.randint(min_number, max_number) for _ in range(num_numbers)]
        solution = _random_expression(numbers, rng)
        value = safe_eval(solution)
        if value is None or (integer_targets and not value.is_integer()):
            continue
        target = format_target(value)
        key = (tuple(sorted(numbers)), target)
        if key in seen:
            continue
        seen.add(key)
        shown = numbers[:]
        rng.shuffle(shown)  # the prompt should not give away the solution's order
        rows.append({"id": start_id + len(rows), "context": make_prompt(shown, target), "numbers": shown,
                     "target": target, "solution": solution})
    return rows


def _normalize(row: dict[str, Any], where: str) -> None:
    """Check a data row and bring it to the TinyZero columns (`nums` -> `numbers`, string `target`)."""
    if "numbers" not in row and "nums" in row:
        row["numbers"] = row.pop("nums")
    numbers, target = row.get("numbers"), row.get("target")
    if not isinstance(numbers, list) or not numbers or not all(type(n) is int for n in numbers):
        raise DataError(f"{where}: 'numbers' must be a non-empty list of integers, got {numbers!r:.60}")
    try:
        if type(target) in (int, float):
            row["target"] = format_target(target)
        elif not isinstance(target, str):
            raise ValueError
        if not math.isfinite(float(row["target"])):
            raise ValueError
    except (ValueError, OverflowError):
        raise DataError(f"{where}: 'target' must be a number, got {target!r:.60}") from None
    if not isinstance(row.get("context"), str):
        row["context"] = make_prompt(numbers, row["target"])
    row.setdefault("solution", None)


def load_problems(path: str) -> list[dict[str, Any]]:
    """TinyZero rows from a JSON list or JSONL file: {"id", "context", "numbers", "target", "solution"}.

    `nums` is accepted for `numbers` and a missing `context` is written from the numbers and target, so
    plain {"nums", "target"} exports (e.g. Countdown-Tasks-3to4) load too.
    """
    rows = read_rows(path, check=_normalize)
    for i, row in enumerate(rows):
        row.setdefault("id", i)
    return rows


def _prompt(row: dict[str, Any]) -> Prompt:
    return row["context"]


def build(path: str | None = None, num_train: int = 200, num_eval: int | None = None, generate: int = 0,
          seed: int = 0, num_numbers: int = 3, min_number: int = 1, max_number: int = 99,
          integer_targets: bool = True) -> Task:
    """The Countdown task.

    Args:
        path: TinyZero data file (JSON list or JSONL); rows [0, num_train) train, the rest evaluate, by
            position (the ES paper: 200 train, 2,000 test). Without it, problems are generated.
        num_train: training problems: the split point in the file, or how many to generate.
        num_eval: evaluation problems (default: every row after the split; 200 when generated).
        generate: if > 0, train on this many generated problems instead of the file's training rows
            (evaluation stays on the file's rows after `num_train`).
        seed: seed of the generator.
        num_numbers: numbers per generated problem (the data set has 3 and 4).
        min_number: smallest generated number.
        max_number: largest generated number.
        integer_targets: generate only problems whose target is an integer.
    """
    for field, value, low in (("num_train", num_train, 1), ("generate", generate, 0),
                              ("num_numbers", num_numbers, 2), ("min_number", min_number, 0)):
        if value < low:
            raise ConfigError(f"data.task_args.{field}: must be >= {low}, got {value}")
    if num_eval is not None and num_eval < 0:
        raise ConfigError(f"data.task_args.num_eval: must be >= 0, got {num_eval}")
    if max_number < min_number:
        raise ConfigError(f"data.task_args.max_number: must be >= min_number ({min_number}), "
                          f"got {max_number}")
    gen = dict(num_numbers=num_numbers, min_number=min_number, max_number=max_number,
               integer_targets=integer_targets)

    seen: set[tuple[Any, ...]] = set()  # (sorted numbers, target) of the problems taken so far
    if path is not None:
        rows = load_problems(path)
        if num_train > len(rows):
            raise ConfigError(f"data.task_args.num_train: {path} has only {len(rows)} rows, got {num_train}")
        train_rows, eval_rows = rows[:num_train], rows[num_train:]
        eval_rows = eval_rows if num_eval is None else eval_rows[:num_eval]
        if generate:
            seen.update((tuple(sorted(r["numbers"])), r["target"]) for r in eval_rows)
            train_rows = generate_problems(generate, seed, exclude=seen, **gen)
    else:
        # Evaluation problems come from a second seeded stream and never repeat a training problem.
        train_rows = generate_problems(generate or num_train, seed, exclude=seen, **gen,
                                       field="data.task_args." + ("generate" if generate else "num_train"))
        eval_rows = generate_problems(200 if num_eval is None else num_eval, seed + 1_000_003, exclude=seen,
                                      start_id=len(train_rows), **gen, field="data.task_args.num_eval")
    return Task(
        name="countdown",
        train_rows=train_rows,
        eval_rows=eval_rows,
        reward_funcs=[format_reward, answer_reward],
        reward_weights=[0.1, 1.0],
        stop=list(STOP),
        metric_funcs={"accuracy": answer_reward, "format": format_reward},
        prompt_fn=_prompt,
    )
