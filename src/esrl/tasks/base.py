"""What every task provides, whichever algorithm trains on it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from esrl.errors import ConfigError
from esrl.tasks.reward_values import call_rewards, reward_floats, reward_name

# A prompt is either raw text or a chat conversation (list of {"role", "content"} messages) that the
# rollout engine renders with the tokenizer's chat template.
Prompt = str | list[dict[str, str]]
# TRL's reward signature: f(prompts, completions, **columns) -> list[float | None].
RewardFunc = Callable[..., list[float | None]]


def completion_text(completion: Any) -> str:
    """The text of a completion in either of TRL's formats (plain string or list of messages)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return completion[-1].get("content", "")
    raise TypeError(f"unsupported completion format: {type(completion).__name__}")


def prompt_text(prompt: Prompt) -> str:
    """A prompt as a person (or a judge) reads it: raw text as it is; a chat's one message as its content, several
    as `role: content` paragraphs (what samples.csv and `esrl elo` show, not a Python list)."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1:
        return str(prompt[0].get("content", ""))
    return "\n\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt)


def _where(func: Any) -> str:
    """A function as its import path names it (`package.module:function`, as data.task_args.reward_funcs takes it)."""
    module, name = getattr(func, "__module__", None), getattr(func, "__qualname__", None)
    return f"{module}:{name}" if module and name else repr(func)


@dataclass
class Task:
    """Data, prompt format, rewards and metrics of one task.

    Rows are dicts (the data set's columns); every column is passed to reward functions as a keyword,
    as TRL does, so TRL reward functions work unchanged.
    """

    name: str
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    reward_funcs: list[RewardFunc]
    reward_weights: list[float] | None = None
    stop: list[str] = field(default_factory=list)
    # metric name -> f(prompts, completions, **columns) -> list[float]; averaged over the eval set.
    metric_funcs: dict[str, RewardFunc] = field(default_factory=dict)
    prompt_fn: Callable[[dict[str, Any]], Prompt] | None = None
    # reward function name -> how many non-finite values it gave in the last `rewards` call (for error messages).
    last_bad: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    # whether any reward function applied to each completion of the last `rewards` call (False: all returned None).
    last_scored: list[bool] = field(default_factory=list, repr=False, compare=False)
    # each reward function's values in the last `rewards` call, NaN where it returned None (TRL's rewards/<name>).
    last_per_function: dict[str, list[float]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        """What would otherwise go wrong silently: zip() dropping the functions past the last weight (TRL refuses
        too), a stop string given as one str cut at its first character, an empty one cutting every completion, two
        reward functions of one name logging as one (rewards/<name>, the last one's values)."""
        names = [reward_name(f) for f in self.reward_funcs]
        if repeated := [f"{_where(f)} is named {n!r}" for f, n in zip(self.reward_funcs, names) if names.count(n) > 1]:
            raise ConfigError(f"task {self.name!r}: reward functions share a name: {'; '.join(repeated)}: each logs "
                              "as rewards/<its name>, so one would hide the other; rename one (or give one function "
                              "a larger weight than list it twice)")
        if self.reward_weights is not None and (
                not isinstance(self.reward_weights, (list, tuple)) or not all(
                    isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
                    for w in self.reward_weights)):  # a string weight failed at the first rewards, as a TypeError
            raise ConfigError(f"task {self.name!r}: reward_weights must be a list of finite numbers, one per reward "
                              f"function, got {self.reward_weights!r}")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError(f"task {self.name!r}: {len(self.reward_weights)} reward_weights for "
                              f"{len(self.reward_funcs)} reward functions")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"task {self.name!r}: stop must be a list of non-empty strings, got {self.stop!r}")

    def prompt(self, row: dict[str, Any]) -> Prompt:
        if self.prompt_fn is not None:
            return self.prompt_fn(row)
        return row["prompt"]

    def prompts(self, rows: Sequence[dict[str, Any]]) -> list[Prompt]:
        return [self.prompt(r) for r in rows]

    @staticmethod
    def as_completions(prompts: Sequence[Prompt], texts: Sequence[str]) -> list[Any]:
        """Completions in TRL's format: messages for chat prompts, plain text for raw prompts."""
        return [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]

    @staticmethod
    def _columns(rows: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
        keys = [k for k in rows[0] if k not in ("prompt", "completion", "prompts", "completions")] if rows else []
        return {k: [r.get(k) for r in rows] for k in keys}

    def rewards(self, rows: Sequence[dict[str, Any]], texts: Sequence[str],
                completion_ids: Sequence[Sequence[int]] | None = None, unscorable: float = 0.0,
                **context: Any) -> list[float]:
        """Weighted sum of the reward functions, each called as TRL calls it: prompts, completions, the rows'
        columns, `completion_ids` (the completions' tokens, where the caller has them) and `context` (the trainer's:
        trainer_state). None means a function does not apply to a completion and adds nothing; a completion no
        function applies to is `unscorable` (0 by default; GRPO passes NaN, which leaves it out of its group, as
        TRL), counted in `last_unscorable`. A non-number is a RewardError naming the function; a non-finite total
        is NaN, and `last_bad` says which function gave it (the policy: esrl.tasks.reward_values)."""
        prompts = self.prompts(rows)
        completions = self.as_completions(prompts, texts)
        kwargs = self._keywords(rows, completion_ids, context)
        weights = self.reward_weights or [1.0] * len(self.reward_funcs)
        total = [0.0] * len(texts)
        scored = [not self.reward_funcs] * len(texts)  # with no reward function every total stands (0)
        self.last_bad, self.last_per_function = {}, {}
        labels = [f"reward function {reward_name(f)}" for f in self.reward_funcs]
        raws = call_rewards(list(zip(labels, self.reward_funcs)), prompts=prompts, completions=completions, **kwargs)
        for w, f, label, raw in zip(weights, self.reward_funcs, labels, raws):
            name = reward_name(f)
            values = reward_floats(label, raw, len(texts))  # a sequence of len(texts) from here on
            scored = [s or v is not None for s, v in zip(scored, raw)]
            self.last_per_function[name] = [math.nan if r is None else v for r, v in zip(raw, values)]
            bad = sum(math.isnan(v) for v in values)
            if bad:
                self.last_bad[name] = self.last_bad.get(name, 0) + bad
            total = [t + w * v for t, v in zip(total, values)]
        self.last_scored = scored
        return [(t if math.isfinite(t) else math.nan) if s else unscorable for t, s in zip(total, scored)]

    @property
    def last_unscorable(self) -> int:
        """How many completions of the last `rewards` call no reward function applied to."""
        return self.last_scored.count(False)

    def metrics(self, rows: Sequence[dict[str, Any]], texts: Sequence[str],
                completion_ids: Sequence[Sequence[int]] | None = None, **context: Any) -> dict[str, list[float]]:
        """Per-sample values of each evaluation metric (averaged by the caller), each called as `rewards` calls a
        reward function (a task's reward functions may serve as its metrics too)."""
        prompts = self.prompts(rows)
        completions = self.as_completions(prompts, texts)
        kwargs = self._keywords(rows, completion_ids, context)
        calls = [(f"metric function {name}", f) for name, f in self.metric_funcs.items()]
        raws = call_rewards(calls, prompts=prompts, completions=completions, **kwargs)
        return {name: reward_floats(label, raw, len(texts)) for (name, _), (label, _), raw in
                zip(self.metric_funcs.items(), calls, raws)}

    def _keywords(self, rows: Sequence[dict[str, Any]], completion_ids: Sequence[Sequence[int]] | None,
                  context: dict[str, Any]) -> dict[str, Any]:
        """What a reward or metric function gets besides prompts and completions, as TRL hands it: the rows'
        columns, completion_ids (where the caller has them) and the caller's context."""
        kwargs = {**self._columns(rows), **context}
        if completion_ids is not None:
            kwargs["completion_ids"] = [list(ids) for ids in completion_ids]
        return kwargs
