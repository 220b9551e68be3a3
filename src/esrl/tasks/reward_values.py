"""The reward policy ES and GRPO share: rewards are numbers, and non-finite ones are excluded, within a limit.

A reward function returns, per completion, a real number or None (not applicable: adds nothing; see Task.rewards). A
bool, a string (even "1.5") or any other type is a RewardError naming the function: nothing is coerced
silently. NaN and +/-inf pass through as NaN and make that completion *bad*. ES excludes a member with any bad
reward from fitness shaping (its shaped fitness is 0, the update still divides by N); GRPO excludes a bad sample
from its group's mean and std (advantage 0). Both log the count as `train/bad_rewards`. A step where more than
MAX_BAD_FRACTION of them are bad, or fewer than `min_usable` remain (ES: 2), stops the run with one line naming
the reward function(s) and the step, before any weight changes.

A reward function may be async (`async def`, as TRL accepts): a step's async functions run together (gathered) on one
event loop kept in a daemon thread, as TRL's GRPOTrainer runs them, so clients they bind to that loop (an HTTP
session) live on from step to step.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import os
import threading
from typing import Any, Callable, Iterable, Sequence

from esrl.errors import EsrlError, RewardError

MAX_BAD_FRACTION = 0.5
"""A step stops when more than this fraction of its members (ES) or samples (GRPO) has a non-finite reward."""


def reward_name(func: Any) -> str:
    return getattr(func, "__name__", None) or repr(func)


def as_number(value: Any, bools: bool = False) -> float | None:
    """A real number as float, None for anything else (strings included; bools too, unless `bools`: log_metric takes
    them as 0 / 1, as TRL sums them, numpy's and torch's included)."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy / torch scalars
        try:
            value = value.item()
        except (ValueError, RuntimeError, TypeError):
            return None
    if isinstance(value, bool):
        return float(value) if bools else None
    return float(value) if isinstance(value, numbers.Real) else None


def call_rewards(calls: Sequence[tuple[str, Callable[..., Any]]], /, **kwargs: Any) -> list[Any]:
    """Each (label, function)'s values, in order. Sync functions run one after another; the coroutines of async ones
    (`async def`, as TRL accepts) then run together on one event loop, as TRL's GRPOTrainer gathers them (a judge
    that waits on an HTTP server costs the slowest one's wait, not their sum). One that raises is a RewardError
    naming it by its label ("reward function NAME"; a TypeError: the signature TRL's reward functions take), the
    first in `calls` order; esrl's own errors (a scorer's) pass as they are."""
    values: list[Any] = []
    for label, func in calls:
        try:
            values.append(func(**kwargs))
        except BaseException as e:
            for v in values:  # the async ones' coroutines, never to run: closed, not left to warn
                if inspect.iscoroutine(v):
                    v.close()
            _raise_as_culprit(label, e)
    pending = [i for i, v in enumerate(values) if inspect.isawaitable(v)]
    if pending:
        results = asyncio.run_coroutine_threadsafe(_gathered([values[i] for i in pending]), _event_loop()).result()
        for i, result in zip(pending, results):
            if isinstance(result, BaseException):
                _raise_as_culprit(calls[i][0], result)
            values[i] = result
    return values


def _raise_as_culprit(label: str, e: BaseException) -> None:
    """Raise what a reward or metric function raised: a RewardError naming it, or esrl's own errors and Ctrl+C as
    they are."""
    if isinstance(e, EsrlError) or not isinstance(e, Exception):
        raise e
    hint = (" (reward and metric functions take f(prompts, completions, **kwargs): the rows' columns, "
            "completion_ids, trainer_state, log_metric and log_extra come as keywords)"
            if isinstance(e, TypeError) else "")
    raise RewardError(f"{label} raised {type(e).__name__}: {e}{hint}") from e


async def _gathered(awaitables: list[Any]) -> list[Any]:
    return await asyncio.gather(*awaitables, return_exceptions=True)


_loop: tuple[int, asyncio.AbstractEventLoop] | None = None  # (the process that started it, the loop)
_loop_lock = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for async reward functions, started once in a daemon thread (again in a forked
    child, which has no such thread)."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=_run_forever, args=(loop,), name="esrl-async-rewards", daemon=True).start()
            _loop = (os.getpid(), loop)
        return _loop[1]


def _run_forever(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()


def reward_floats(label: str, values: Any, expected: int) -> list[float]:
    """The values of a reward or metric function (`label`: "reward function NAME") as floats (None -> 0.0); a
    non-number or a wrong count is a RewardError. Non-finite values stay (as NaN for the caller to exclude)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise RewardError(f"{label} returned {type(values).__name__}, not a list of numbers")
    values = list(values)
    if len(values) != expected:
        raise RewardError(f"{label} returned {len(values)} values for {expected} completions")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(0.0)
            continue
        x = as_number(v)
        if x is None:
            raise RewardError(f"{label} returned {v!r:.40} ({type(v).__name__}) for completion {i}: "
                              "values must be numbers (int or float) or None")
        out.append(x if math.isfinite(x) else math.nan)
    return out


def check_bad_rewards(bad: int, total: int, *, step: int, unit: str, sources: Iterable[str],
                      min_usable: int = 1) -> None:
    """Stop the run (RewardError) when too many of a step's `total` members/samples have a non-finite reward."""
    usable = total - bad
    if bad == 0 or (bad <= MAX_BAD_FRACTION * total and usable >= min_usable):
        return
    names = ", ".join(sorted(set(sources))) or "the task's reward"
    raise RewardError(f"step {step}: reward function {names} gave non-finite rewards (NaN/inf) to {bad} of {total} "
                      f"{unit}, more than the {MAX_BAD_FRACTION:.0%} allowed (at least {min_usable} must be usable); "
                      "stopped before the update")
