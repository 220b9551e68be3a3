"""Any prompt file: JSONL rows with a prompt field, rewarded by TRL-signature functions by import path."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Sequence

from esrl.errors import ConfigError, DataError
from esrl.tasks.base import Prompt, RewardFunc, Task
from esrl.tasks.io import read_jsonl


def import_function(spec: str, field: str = "data.task_args.reward_funcs") -> RewardFunc:
    """A callable from `package.module:function` or `package.module.function`."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{field}: {spec!r} is not an import path ('package.module:function')")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        hint = ("; a module in the current folder is found only with the folder on PYTHONPATH (PYTHONPATH=. esrl ...)"
                if e.name == module_name.partition(".")[0] else "")
        raise ConfigError(f"{field}: cannot import {spec!r} ({e}){hint}") from None
    except Exception as e:  # noqa: BLE001 - the module itself fails: SyntaxError, an import inside it, its own code
        where = f" at {e.filename}:{e.lineno}" if isinstance(e, SyntaxError) else ""
        raise ConfigError(f"{field}: cannot import {spec!r} ({type(e).__name__}{where}: "
                          f"{e.msg if isinstance(e, SyntaxError) else e})") from None
    func = module
    try:
        for part in attr.split("."):  # allows `module:Class.method`
            func = getattr(func, part)
    except AttributeError:
        raise ConfigError(f"{field}: cannot import {spec!r} ({module_name!r} has no {attr!r})") from None
    if not callable(func):
        raise ConfigError(f"{field}: {spec!r} is not callable")
    return func


def _check_prompt(field: str) -> Callable[[dict[str, Any], str], None]:
    """A prompt is text or a chat conversation: a non-empty list of {"role", "content"} string messages; empty text (or
    only spaces) is no prompt, as the other tasks say."""

    def check(row: dict[str, Any], where: str) -> None:
        value = row[field]
        if isinstance(value, str) and not value.strip():
            raise DataError(f"{where}: field {field!r} is empty")
        if isinstance(value, str) or (isinstance(value, list) and value and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value)):
            return
        raise DataError(f"{where}: field {field!r} must be a string or a list of {{'role', 'content'}} "
                        f"messages, got {value!r:.60}")

    return check


def build(train_path: str, eval_path: str | None = None, prompt_field: str = "prompt",
          reward_funcs: Sequence[str] = (), reward_weights: Sequence[float] | None = None, chat: bool = True,
          stop: Sequence[str] = ()) -> Task:
    """A task from JSONL prompt files.

    Args:
        train_path: training prompts, one JSON object per line; every field reaches the reward functions.
        eval_path: evaluation prompts (default: none; evaluation then uses the training prompts).
        prompt_field: the field holding the prompt: text, or a list of chat messages.
        reward_funcs: import paths of TRL-signature reward functions, `package.module:function`.
        reward_weights: one weight per reward function (default: all 1).
        chat: wrap text prompts as a user message for the chat template (False: feed the text raw).
        stop: strings that end generation (one string: that string).
    """
    if isinstance(reward_funcs, str):
        reward_funcs = [reward_funcs]
    if isinstance(stop, str):
        stop = [stop]
    if not reward_funcs:
        raise ConfigError("data.task_args.reward_funcs: give at least one reward function "
                          "('package.module:function')")
    funcs = [import_function(spec) for spec in reward_funcs]
    if reward_weights is not None and not isinstance(reward_weights, (list, tuple)):
        raise ConfigError(f"data.task_args.reward_weights: a list of numbers, one per reward function, got "
                          f"{reward_weights!r}")
    if reward_weights is not None and len(reward_weights) != len(funcs):
        raise ConfigError(f"data.task_args.reward_weights: {len(reward_weights)} weights for {len(funcs)} "
                          "reward functions")

    def prompt(row: dict[str, Any]) -> Prompt:
        value = row[prompt_field]
        if chat and isinstance(value, str):
            return [{"role": "user", "content": value}]
        return value

    schema, check = {prompt_field: (str, list)}, _check_prompt(prompt_field)
    # Each reward function is also an evaluation metric, named after it.
    metrics: dict[str, RewardFunc] = {getattr(f, "__name__", None) or spec: f for spec, f in zip(reward_funcs, funcs)}
    return Task(
        name="jsonl",
        train_rows=read_jsonl(train_path, schema, check),
        eval_rows=read_jsonl(eval_path, schema, check) if eval_path is not None else [],
        reward_funcs=funcs,
        reward_weights=list(reward_weights) if reward_weights is not None else None,
        stop=list(stop),
        metric_funcs=metrics,
        prompt_fn=prompt,
    )
