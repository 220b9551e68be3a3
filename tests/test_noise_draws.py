"""An ES iteration draws each member's low-rank factors once (factors_drawn_once) and copies host numbers to the
device once per list, not once per matrix: the same weights as drawing everything anew, with the draws counted.

Counts come from a TorchDispatchMode over real ops (what a GPU would launch), on the tiny random model on CPU; the
GPU itself is measured by benchmarks/es_host_work.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from esrl.es import NoiseSpec, get_mode, lowrank_selection, population, select_params
from esrl.es.noise import factors_drawn_once, lowrank_factors
from esrl.es.update import es_step


class Draws(TorchDispatchMode):
    """Seeded normal draws and tensors made from Python numbers, by op."""

    def __init__(self):
        super().__init__()
        self.normal = self.from_host = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.normal += name in ("randn", "normal_")
        self.from_host += name == "lift_fresh"
        return func(*args, **(kwargs or {}))


def _iteration(model, spec, members, weights, reuse: bool):
    """One lowrank iteration's noise work as ESModule runs it: the chunk's load, then the update."""
    sel = lowrank_selection(model, select_params(model), spec)
    static = get_mode("lowrank").static_population(model, sel, spec)
    opt = torch.optim.SGD(sel.params, lr=0.1)
    load, update = Draws(), Draws()
    try:
        with factors_drawn_once() if reuse else torch.no_grad():
            with load:
                static.load(members)
            with update:
                es_step(opt, sel, members, weights, spec)
    finally:
        static.remove()
    return sel, load, update


@pytest.fixture
def own_lm(tiny_model):
    """A copy of the tiny model of this test's own (its weights get updated)."""
    from esrl.models import load_causal_lm

    return load_causal_lm(tiny_model)


def test_update_reuses_the_loads_draws_with_the_same_weights(own_lm):
    spec = NoiseSpec(mode="lowrank", sigma=0.05, rank=2)
    members = population(7, 0, 6, antithetic=True)  # 3 seeds: pairs share their draws too
    weights = torch.tensor([0.5, -1.0, 2.0, 0.25, -0.75, 1.5])
    start = [p.detach().clone() for p in own_lm.parameters()]
    sel, load, update = _iteration(own_lm, spec, members, weights, reuse=False)
    plain = [p.detach().clone() for p in own_lm.parameters()]
    assert load.normal == 2 * len(sel) * 6  # A and B per matrix and member
    assert update.normal == 2 * len(sel) * 3  # drawn again (the update folds each pair into one draw)
    with torch.no_grad():
        for p, s in zip(own_lm.parameters(), start):
            p.copy_(s)
    sel, load, update = _iteration(own_lm, spec, members, weights, reuse=True)
    assert load.normal == 2 * len(sel) * 3 and update.normal == 0  # once per seed, none for the update
    assert all(torch.equal(p, q) for p, q in zip(own_lm.parameters(), plain))  # bit for bit
    assert not all(torch.equal(p, s) for p, s in zip(plain, start))  # the update moved the weights


def test_host_numbers_reach_the_device_once_per_list_not_per_matrix(own_lm):
    """Signs at the load and fitness coefficients at the update: one host-made tensor each, whatever the matrices
    (a GPU waits for its queue at each such copy)."""
    spec = NoiseSpec(mode="lowrank", sigma=0.05)
    members = population(11, 3, 4)
    weights = torch.tensor([0.125, -0.5, 1.0, 0.375]) * torch.rand(()).item()  # numbers no earlier test used
    sel, load, update = _iteration(own_lm, spec, members, weights, reuse=True)
    assert len(sel) > 2 and load.from_host <= 1 and update.from_host <= 2, (load.from_host, update.from_host)


def test_past_its_budget_the_block_draws_again_the_same_numbers():
    a, b = lowrank_factors(5, 2, (8, 4), 1)
    with factors_drawn_once(max_bytes=4 * (8 + 4)):  # room for one pair
        kept = lowrank_factors(5, 2, (8, 4), 1)
        assert lowrank_factors(5, 2, (8, 4), 1)[0] is kept[0]
        other = lowrank_factors(6, 2, (8, 4), 1)
        assert lowrank_factors(6, 2, (8, 4), 1)[0] is not other[0]  # over budget: drawn anew
    assert torch.equal(kept[0], a) and torch.equal(kept[1], b)
    assert torch.equal(lowrank_factors(6, 2, (8, 4), 1)[0], other[0])
