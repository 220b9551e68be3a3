"""One member, every consumer: the in-place perturbation, the population hooks, the member adapters and the
update all draw a member's noise from esrl.es.noise, so they must agree on the same tensor.

Where two consumers run the same function (member weights of lora mode, the factors of lowrank) the tensors
are compared bit for bit; where the arithmetic order differs by construction (x (W + dW)^T against
x W^T + (x B) A^T, fp32) within atol 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from esrl.es import Perturber, get_mode, population
from esrl.es.config import ESConfig
from esrl.es.noise import NoiseSpec, tensor_scale
from esrl.es.setup import build_policy, build_selection
from esrl.es.update import es_gradient


def _one_hot(n: int, i: int) -> torch.Tensor:
    w = torch.zeros(n, dtype=torch.float64)
    w[i] = 1.0
    return w


@pytest.mark.parametrize("mode,kw", [("full", {}), ("full", {"sigma_scaling": "rms"}), ("lowrank", {"rank": 2}),
                                     ("lowrank", {"rank": 1, "lowrank_vectors": "full"})],
                         ids=["full", "full-rms", "lowrank-r2", "lowrank-vectors"])
def test_in_place_perturbation_and_gradient_share_the_members_direction(tiny_lm, mode, kw):
    """theta_i - theta == sign_i s_j eps_ij (Perturber), and the gradient with fitness one-hot on member i is
    sign_i (s_j / sigma) eps_ij / N: the update moves along exactly the direction the member was scored on."""
    cfg = ESConfig(mode=mode, sigma=0.05, population_size=4, antithetic=True, **kw)
    selection, spec = build_selection(tiny_lm, cfg)
    members = population(5, 2, 4, antithetic=True)
    noise_mode = get_mode(mode)
    base = [p.detach().clone() for p in selection.params]
    i = 3  # sign -1
    eps = [noise_mode.direction(members[i].seed, j, p, spec) for j, _, p in selection]
    scales = [tensor_scale(p, spec) for p in selection.params]
    with Perturber(selection, spec).perturbed(members[i]):
        for p, b, e, s in zip(selection.params, base, eps, scales):
            torch.testing.assert_close(p - b, -s * e, atol=1e-6, rtol=1e-5)
    grads = dict((id(p), g) for p, g in es_gradient(selection, members, _one_hot(4, i), spec))
    for p, e, s in zip(selection.params, eps, scales):
        torch.testing.assert_close(grads[id(p)], -(s / spec.sigma) * e / 4, atol=1e-7, rtol=1e-5)


def test_lowrank_hooks_and_member_adapters_apply_the_members_direction(tiny_lm):
    """On one perturbed Linear, the batched hooks' output and the member adapter's lora_B lora_A both equal
    the dense member direction sign s A B^T / sqrt(r) that the Perturber writes into the weight."""
    cfg = ESConfig(mode="lowrank", sigma=0.05, rank=2)
    selection, spec = build_selection(tiny_lm, cfg)
    mode = get_mode("lowrank")
    members = population(1, 0, 4, antithetic=True)
    j, name, weight = next(iter(selection))
    linear = tiny_lm.get_submodule(name.removesuffix(".weight"))
    x = torch.randn(len(members), 3, weight.shape[1], generator=torch.Generator().manual_seed(0))
    base_out = linear(x)
    with torch.no_grad(), mode.population(tiny_lm, selection, spec, members, torch.arange(len(members))):
        hooked = linear(x)
    adapters = mode.member_adapters(tiny_lm, selection, spec, members)
    for k, m in enumerate(members):
        delta = m.sign * spec.sigma * mode.direction(m.seed, j, weight, spec)
        torch.testing.assert_close(hooked[k] - base_out[k], x[k] @ delta.T, atol=1e-5, rtol=0)
        lora_a, lora_b = adapters[k][name.removesuffix(".weight")]
        torch.testing.assert_close(lora_b @ lora_a, delta, atol=1e-6, rtol=1e-5)


def test_lora_members_are_the_same_tensors_for_hooks_adapters_and_in_place(tiny_model):
    """lora mode: the member weights the population hooks use, the member adapters an engine receives and
    the weights the Perturber writes in place are bit-identical (one member_weight)."""
    pytest.importorskip("peft")
    from esrl.es.modes.lora import LoraPopulation, lora_adapters, peft_lora_modules
    from esrl.models import load_causal_lm

    cfg = ESConfig(mode="lora", sigma=0.5, lora_rank=4, lora_alpha=4.0)  # scaling 1: adapters carry lora_B as is
    model = build_policy(load_causal_lm(tiny_model), cfg, seed=0)
    selection, spec = build_selection(model, cfg)
    members = population(2, 1, 3, antithetic=True)
    adapters = lora_adapters(model, selection, spec, members)
    with LoraPopulation(model, selection, spec, members, torch.arange(3)) as hooks:
        hooked = dict(hooks.member_weights)
    modules = peft_lora_modules(model)
    where = {id(a): (n, 0) for n, (a, _, _) in modules.items()} | {id(b): (n, 1) for n, (_, b, _) in modules.items()}
    perturber = Perturber(selection, spec)
    for k, m in enumerate(members):
        with perturber.perturbed(m):
            for _, pname, p in selection:
                module, part = where[id(p)]
                assert torch.equal(adapters[k][module][part], p), pname
                assert torch.equal(hooked[pname][k], p), pname


def test_noise_spec_names_a_registered_mode():
    from esrl.es.modes import MODES

    assert set(MODES) >= {"full", "lowrank", "lora"}
    assert all(MODES[name].name == name for name in MODES)
    with pytest.raises(ValueError, match="unknown ES noise mode 'gaussian2'"):
        Perturber([], NoiseSpec(mode="gaussian2"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 333), (8, 576), (1000,)])
def test_member_weights_of_a_stack_equal_member_weight_one_by_one(dtype, shape):
    """member_weights (lora's load, lowrank's full-noise vectors) writes a chunk's members in three launches; each must
    equal member_weight (the in-place perturbation) bit for bit, in fp32 and bf16, on shapes whose rows are no multiple
    of a CPU's vector width (odd tails), with the stack large enough for two threads."""
    from esrl.es.noise import member_weight, member_weights

    g = torch.Generator().manual_seed(0)
    p = torch.randn(shape, generator=g).to(dtype)
    eps = torch.randn(30, *shape, generator=g)
    signs = [1.0 if k % 3 else -1.0 for k in range(30)]
    one_by_one = torch.stack([member_weight(p, e, s, 0.0123) for e, s in zip(eps, signs)])
    out = torch.empty(30, *shape, dtype=dtype)
    assert member_weights(p, eps, signs, 0.0123, out=out) is out
    assert torch.equal(out, one_by_one)
    in_place = p.clone()
    member_weight(in_place, eps[0], signs[0], 0.0123, in_place=True)
    assert torch.equal(in_place, one_by_one[0]) and not torch.equal(in_place, p)
