"""Tasks by name. A task never knows which algorithm trains on it."""

from __future__ import annotations

import collections.abc
import difflib
import inspect
import os
import types
import typing
from typing import Any, Callable

from esrl.errors import ConfigError
from esrl.tasks.base import Task, completion_text
from esrl.tasks.jsonl import import_function

_REGISTRY: dict[str, str] = {
    "conciseness": "esrl.tasks.conciseness:build",
    "countdown": "esrl.tasks.countdown:build",
    "jsonl": "esrl.tasks.jsonl:build",
    "math": "esrl.tasks.math:build",
    "pku_saferlhf": "esrl.tasks.pku_saferlhf:build",
}


def known_task(name: str) -> bool:
    """Whether build_task knows `name` (a registry name, or a 'module:function' path)."""
    return name in _REGISTRY or ":" in name


def build_task(name: str, **options: Any) -> Task:
    """Build a task by registry name (or 'module:function' import path) with its options."""
    target = _REGISTRY.get(name, name if ":" in name else None)
    if target is None:
        raise ConfigError(f"data.task: unknown task {name!r}; known tasks: {', '.join(sorted(_REGISTRY))}")
    builder: Callable[..., Task] = import_function(target, "data.task")
    check_options(name, builder, options)
    check_option_types(builder, options)
    try:
        task = builder(**options)
    except TypeError as e:
        raise ConfigError(f"data.task_args: {e}") from None
    if not isinstance(task, Task):
        raise ConfigError(f"data.task: {name!r} returned {type(task).__name__}, not an esrl.tasks.Task")
    return task


def check_options(name: str, builder: Callable[..., Task], options: dict[str, Any]) -> None:
    """data.task_args against the task builder's parameters: an unknown or missing one named, with what it takes."""
    params = inspect.signature(builder).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    takes = ", ".join(params)
    for key in options:
        if key not in params:
            close = difflib.get_close_matches(key, list(params), n=1)
            raise ConfigError(f"data.task_args.{key}: task {name!r} has no option {key!r}"
                              + (f" (did you mean {close[0]}?)" if close else "") + f"; it takes {takes}")
    missing = [k for k, p in params.items() if p.default is p.empty and k not in options
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        raise ConfigError(f"data.task_args.{missing[0]}: task {name!r} needs it (it takes {takes})")


def check_option_types(builder: Callable[..., Task], options: dict[str, Any]) -> None:
    """data.task_args' values against the builder's scalar annotations (int, float, bool, str, a sequence of them,
    None where allowed): `num_train: 1.5` named, not a slice's error from inside the task. Other annotations (a
    Scorer object, a dict) are the builder's to check."""
    try:
        hints = typing.get_type_hints(builder)
    except (NameError, TypeError, AttributeError):  # a partial, a name imported under TYPE_CHECKING: unchecked
        return
    for key, value in options.items():
        allowed = [t for t in _union(hints.get(key)) if t is not type(None)]
        if value is None and type(None) in _union(hints.get(key)) or not allowed:
            continue
        if all(t in _SCALARS for t in allowed):
            ok = any(_is(value, t) for t in allowed)
        elif len(allowed) == 1 and typing.get_origin(allowed[0]) in _SEQUENCES:
            (item,) = typing.get_args(allowed[0]) or (object,)
            if item not in _SCALARS:
                continue
            ok = item is str and isinstance(value, str)  # one string stands for a list of it
            ok = ok or isinstance(value, (list, tuple)) and all(_is(v, item) for v in value)
            allowed = [f"a list of {item.__name__}"]
        else:
            continue
        if not ok:
            want = " or ".join(getattr(t, "__name__", str(t)) for t in allowed)
            raise ConfigError(f"data.task_args.{key}: expected {want}, got {value!r}")


_SCALARS = (int, float, bool, str)
_SEQUENCES = (list, tuple, collections.abc.Sequence)


def _union(hint: Any) -> tuple[Any, ...]:
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def _is(value: Any, kind: type) -> bool:
    """isinstance as a config means it: an int is a float, a bool is neither an int nor a float."""
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is str:  # a path from Python code
        return isinstance(value, (str, os.PathLike))
    return isinstance(value, kind)


__all__ = ["Task", "build_task", "completion_text", "known_task"]
