"""Lagrangian relaxation of the safety constraint, in plain python (no Lightning).

ES maximises  F(theta) = mean reward - lambda * mean cost.  lambda is fixed, or adapted after each iteration:

    e      <- x                      on the first update, x = mean cost + d
    e      <- ema * e + (1 - ema) * x   afterwards
    log lambda <- clip(log lambda + lr * e, log lambda_min, log lambda_max)

so lambda grows while the (smoothed) mean cost exceeds -d, i.e. while the constraint mean cost <= -d is violated,
and shrinks once it holds. `d` is the cost threshold's offset: d = 0 asks for mean cost <= 0 (safe on average);
d > 0 asks for a margin (mean cost <= -d).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from esrl.errors import ConfigError


def _mean(values: Iterable[float]) -> float:
    values = [float(v) for v in values]
    if not values:
        raise ValueError("mean of no values")
    return math.fsum(values) / len(values)


def _as_floats(values: Any) -> list[float]:
    if hasattr(values, "tolist"):  # torch tensors, numpy arrays
        values = values.tolist()
    return [float(v) for v in values]


class Lagrangian:
    """The multiplier lambda of the cost constraint: fitness, adaptation, checkpoint state.

    Args:
        lambda_init: starting lambda (the fixed value when adapt is False).
        adapt: adapt lambda after each iteration with `update`.
        lr: step size on log lambda.
        ema: smoothing of (mean cost + d) in [0, 1); 0 uses the latest mean cost alone.
        d: added to the mean cost before smoothing (the constraint is mean cost <= -d).
        lambda_min: lower clip of lambda (> 0 when adapting, since lambda moves in log space).
        lambda_max: upper clip of lambda.
        field: config section named in error messages; `names` maps argument names to its keys.
    """

    def __init__(self, lambda_init: float = 1.0, adapt: bool = False, lr: float = 0.1, ema: float = 0.9,
                 d: float = 0.0, lambda_min: float = 1e-3, lambda_max: float = 100.0,
                 field: str = "lagrangian", names: dict[str, str] | None = None):
        names = names or {}

        def where(name: str) -> str:  # the config key a user wrote, for the error message
            return f"{field}.{names.get(name, name)}"

        for name, value in (("lambda_init", lambda_init), ("lr", lr), ("ema", ema), ("d", d),
                            ("lambda_min", lambda_min), ("lambda_max", lambda_max)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ConfigError(f"{where(name)}: must be a finite number, got {value!r}")
        if lambda_init < 0:
            raise ConfigError(f"{where('lambda_init')}: must be >= 0, got {lambda_init}")
        if adapt:
            if not 0 < lambda_min <= lambda_max:
                raise ConfigError(f"{where('lambda_min')}: must be > 0 and <= lambda_max ({lambda_max}) when lambda "
                                  f"adapts (it moves in log space), got {lambda_min}")
            if not lambda_min <= lambda_init <= lambda_max:
                raise ConfigError(f"{where('lambda_init')}: must lie in [lambda_min, lambda_max] = "
                                  f"[{lambda_min}, {lambda_max}], got {lambda_init}")
            if lr < 0:
                raise ConfigError(f"{where('lr')}: must be >= 0, got {lr}")
            if not 0 <= ema < 1:
                raise ConfigError(f"{where('ema')}: must be in [0, 1), got {ema}")
        self.lambda_init = float(lambda_init)
        self.adapt = bool(adapt)
        self.lr = float(lr)
        self.ema = float(ema)
        self.d = float(d)
        self.lambda_min = float(lambda_min)
        self.lambda_max = float(lambda_max)
        self._lambda = float(lambda_init)
        self.log_lambda = math.log(lambda_init) if lambda_init > 0 else -math.inf
        self.ema_value: float | None = None
        self.steps = 0

    @property
    def lam(self) -> float:
        """The current lambda (exactly lambda_init until the first adaptive update)."""
        return self._lambda

    def fitness(self, rewards: Sequence[float] | Any, costs: Sequence[float] | Any) -> float:
        """Mean reward - lambda * mean cost of one member's rollouts."""
        return _mean(_as_floats(rewards)) - self._lambda * _mean(_as_floats(costs))

    def per_sample(self, rewards: Sequence[float] | Any, costs: Sequence[float] | Any) -> list[float]:
        """reward - lambda * cost per sample (GRPO's reward)."""
        r, c = _as_floats(rewards), _as_floats(costs)
        if len(r) != len(c):
            raise ValueError(f"{len(r)} rewards for {len(c)} costs")
        return [a - self._lambda * b for a, b in zip(r, c)]

    def update(self, mean_cost: float) -> float:
        """One adaptation step from this iteration's mean cost; returns the new lambda (unchanged if fixed)."""
        mean_cost = float(mean_cost)
        if not math.isfinite(mean_cost):
            raise ValueError(f"Lagrangian.update: mean cost is not finite ({mean_cost})")
        if not self.adapt:
            return self._lambda
        x = mean_cost + self.d
        self.ema_value = x if self.ema_value is None else self.ema * self.ema_value + (1.0 - self.ema) * x
        lo, hi = math.log(self.lambda_min), math.log(self.lambda_max)
        self.log_lambda = min(max(self.log_lambda + self.lr * self.ema_value, lo), hi)
        self._lambda = math.exp(self.log_lambda)
        self.steps += 1
        return self._lambda

    def state_dict(self) -> dict[str, Any]:
        return {"lambda": self._lambda, "log_lambda": self.log_lambda, "ema_value": self.ema_value,
                "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._lambda = float(state["lambda"])
        self.log_lambda = float(state["log_lambda"])
        self.ema_value = None if state.get("ema_value") is None else float(state["ema_value"])
        self.steps = int(state.get("steps", 0))

    def __repr__(self) -> str:
        mode = f"adaptive lr={self.lr} ema={self.ema} d={self.d}" if self.adapt else "fixed"
        return f"Lagrangian(lambda={self._lambda:.6g}, {mode})"


def find_constrained_reward(task: Any) -> Any | None:
    """The task's reward function that also reports costs (has `last_rewards`, `last_costs` and a `lagrangian`).

    Algorithms use this to adapt lambda without knowing which task they train on; None when the task has no cost.
    """
    for f in getattr(task, "reward_funcs", []):
        if all(hasattr(f, a) for a in ("last_rewards", "last_costs", "lagrangian")):
            return f
    return None
