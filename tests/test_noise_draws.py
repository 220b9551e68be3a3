"""An ES iteration draws each member's low-rank factors or lora adapter noise once (drawn_once) and copies host numbers to the
device once per list, not once per matrix: the same weights as drawing everything anew, with the draws counted.

Counts come from a TorchDispatchMode over real ops (what a GPU would launch), on the tiny random model on CPU; the
GPU itself is measured by benchmarks/es_host_work.py.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from esrl.es import get_mode, population
from esrl.es.config import ESConfig
from esrl.es.noise import drawn_once, lowrank_factors
from esrl.es.setup import build_policy, build_selection
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


def _iteration(model, cfg, members, weights, reuse: bool):
    """One iteration's noise work as ESModule runs it: the chunk's load, then the update."""
    sel, spec = build_selection(model, cfg)
    static = get_mode(cfg.mode).static_population(model, sel, spec)
    opt = torch.optim.SGD(sel.params, lr=0.1)
    load, update = Draws(), Draws()
    try:
        with drawn_once() if reuse else nullcontext():
            with load:
                static.load(members)
            with update:
                es_step(opt, sel, members, weights, spec)
    finally:
        static.remove()
    return sel, load, update


def _policy(tiny_model, cfg):
    """A fresh policy of the tiny model (its weights get updated), wrapped as the mode wants."""
    from esrl.models import load_causal_lm

    return build_policy(load_causal_lm(tiny_model), cfg, 0)


@pytest.mark.parametrize("cfg", [ESConfig(mode="lowrank", sigma=0.05, rank=2),
                                 ESConfig(mode="lora", sigma=0.05, lora_rank=2, lora_alpha=4)], ids=["lowrank", "lora"])
def test_update_reuses_the_loads_draws_with_the_same_weights(tiny_model, cfg):
    members = population(7, 0, 6, antithetic=True)  # 3 seeds: pairs share their draws too
    weights = torch.tensor([0.5, -1.0, 2.0, 0.25, -0.75, 1.5])
    per_seed = 2 if cfg.mode == "lowrank" else 1  # A and B factors; or the adapter tensor's own noise
    model = _policy(tiny_model, cfg)
    start = [p.detach().clone() for p in model.parameters()]
    sel, load, update = _iteration(model, cfg, members, weights, reuse=False)
    plain = [p.detach().clone() for p in model.parameters()]
    assert load.normal == per_seed * len(sel) * 3  # a chunk's draws are made together, each seed once per tensor
    assert update.normal == per_seed * len(sel) * 3  # drawn again (the update folds each pair into one draw)
    assert not all(torch.equal(p, s) for p, s in zip(plain, start))  # the update moved the weights
    model = _policy(tiny_model, cfg)
    sel, load, update = _iteration(model, cfg, members, weights, reuse=True)
    assert load.normal == per_seed * len(sel) * 3 and update.normal == 0  # once per seed, none for the update
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain))  # bit for bit


def test_host_numbers_reach_the_device_once_per_list_not_per_matrix(tiny_model):
    """Signs at the load and fitness coefficients at the update: one host-made tensor each, whatever the matrices
    (a GPU waits for its queue at each such copy)."""
    cfg = ESConfig(mode="lowrank", sigma=0.05)
    members = population(11, 3, 4)
    weights = torch.tensor([0.125, -0.5, 1.0, 0.3125])  # numbers no other test uses: the copies are not cached yet
    sel, load, update = _iteration(_policy(tiny_model, cfg), cfg, members, weights, reuse=True)
    assert len(sel) > 2 and load.from_host <= 1 and update.from_host <= 2, (load.from_host, update.from_host)


def test_past_its_budget_the_block_draws_again_the_same_numbers():
    a, b = lowrank_factors(5, 2, (8, 4), 1)
    with drawn_once(max_bytes=4 * (8 + 4)):  # room for one pair
        with Draws() as first:
            kept = lowrank_factors(5, 2, (8, 4), 1)
            other = lowrank_factors(6, 2, (8, 4), 1)
        with Draws() as again:
            assert torch.equal(lowrank_factors(5, 2, (8, 4), 1)[0], kept[0])
            assert torch.equal(lowrank_factors(6, 2, (8, 4), 1)[0], other[0])
    assert first.normal == 4 and again.normal == 2  # the kept pair is served; over budget, the other is drawn anew
    assert torch.equal(kept[0], a) and torch.equal(kept[1], b)
    assert torch.equal(lowrank_factors(6, 2, (8, 4), 1)[0], other[0])
