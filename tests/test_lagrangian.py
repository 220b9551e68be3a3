"""esrl.scoring.Lagrangian: the cost multiplier of constrained fitness (reward - lambda * cost), fixed or adapted in
log space from the cost's EMA, worked by hand; its state restores exactly from a checkpoint."""

from __future__ import annotations

import json
import math

import pytest

from esrl.errors import ConfigError
from esrl.scoring import Lagrangian


def test_lagrangian_fixed():
    lag = Lagrangian(lambda_init=0.3, adapt=False)
    assert lag.fitness([1.0, 2.0, 3.0], [0.5, 1.5]) == pytest.approx(2.0 - 0.3 * 1.0)
    assert lag.update(5.0) == 0.3 and lag.lam == 0.3 and lag.steps == 0
    assert lag.per_sample([1.0, -1.0], [2.0, 0.0]) == pytest.approx([1.0 - 0.6, -1.0])


def test_lagrangian_adapts_in_log_space():
    lag = Lagrangian(lambda_init=1.0, adapt=True, lr=0.5, ema=0.5, d=1.0, lambda_min=0.1, lambda_max=10.0)
    # x = 1 + 1 = 2; first EMA value = 2; log lambda = 0 + 0.5 * 2 = 1
    assert lag.update(1.0) == pytest.approx(math.e)
    # x = -3 + 1 = -2; EMA = 0.5 * 2 + 0.5 * -2 = 0; log lambda stays 1
    assert lag.update(-3.0) == pytest.approx(math.e)
    # x = -2; EMA = 0.5 * 0 + 0.5 * -2 = -1; log lambda = 1 - 0.5 = 0.5
    assert lag.update(-3.0) == pytest.approx(math.exp(0.5))
    assert lag.ema_value == pytest.approx(-1.0)
    state = lag.state_dict()
    # x = 101; EMA = 0.5 * -1 + 0.5 * 101 = 50; log lambda = 0.5 + 25 -> clipped to log 10
    assert lag.update(100.0) == pytest.approx(10.0)
    assert lag.fitness([1.0, 2.0, 3.0], [0.5, 1.5]) == pytest.approx(2.0 - 10.0 * 1.0)
    # checkpoint: a fresh multiplier loaded from the state continues identically
    resumed = Lagrangian(lambda_init=1.0, adapt=True, lr=0.5, ema=0.5, d=1.0, lambda_min=0.1, lambda_max=10.0)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert resumed.lam == pytest.approx(math.exp(0.5)) and resumed.steps == 3
    assert resumed.update(100.0) == lag.lam
    # lower clip
    low = Lagrangian(lambda_init=1.0, adapt=True, lr=1.0, ema=0.0, d=0.0, lambda_min=0.5, lambda_max=10.0)
    assert low.update(-5.0) == pytest.approx(0.5)


def test_lagrangian_validation():
    with pytest.raises(ConfigError, match="lagrangian.lambda_min"):
        Lagrangian(lambda_init=1.0, adapt=True, lambda_min=0.0)
    with pytest.raises(ConfigError, match="lagrangian.lambda_init"):
        Lagrangian(lambda_init=20.0, adapt=True, lambda_max=10.0)
    with pytest.raises(ConfigError, match="lagrangian.ema"):
        Lagrangian(adapt=True, ema=1.0)
    with pytest.raises(ValueError, match="not finite"):
        Lagrangian(adapt=True).update(float("nan"))


def test_a_lagrangian_restored_from_its_state_continues_as_the_uninterrupted_one():
    """The moving average of the cost is part of the state: a resumed run (lambda_ema 0.9, the task's default)
    follows the uninterrupted lambda. The fit's resume test runs with lambda_ema 0, where it is not."""
    kwargs = dict(lambda_init=1.0, adapt=True, lr=0.5, ema=0.9, d=0.1)
    whole = Lagrangian(**kwargs)
    for cost in (0.8, -0.3):
        whole.update(cost)
    resumed = Lagrangian(**kwargs)
    resumed.load_state_dict(json.loads(json.dumps(whole.state_dict())))  # as a checkpoint holds it
    assert resumed.update(0.4) == whole.update(0.4)
