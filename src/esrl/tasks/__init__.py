"""Tasks by name. A task never knows which algorithm trains on it."""

from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any, Callable

from esrl.errors import ConfigError
from esrl.tasks.base import Task, completion_text

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
    module, _, attr = target.partition(":")
    builder: Callable[..., Task] = getattr(importlib.import_module(module), attr)
    check_options(name, builder, options)
    try:
        return builder(**options)
    except TypeError as e:
        raise ConfigError(f"data.task_args: {e}") from None


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


__all__ = ["Task", "build_task", "completion_text", "known_task"]
