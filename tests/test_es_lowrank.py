"""Lowrank (EGGROLL) noise and population-batched generation, checked against explicitly perturbed models.

Tolerances (fp32): batched logits equal the explicitly perturbed model's within atol 1e-5 (the two compute
x (W + s A B^T / sqrt r)^T in a different order); the ES update equals the written-out sum over perturbed
copies within atol 1e-6; greedy completions and fitness are compared exactly.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import (CONCISENESS_FILES, assert_batched_equals_member_by_member, assert_same_tensors, fit_final,
                     load_safetensors, write_tiny_config, written_out_update)

from esrl.es import (NoiseSpec, Perturber, PopulationPerturbation, lowrank_factors, lowrank_selection, member_chunks,
                     population, select_params, set_es_grads, shape_fitness)
from esrl.es.noise import factor_seed
from esrl.es.update import es_gradient

PROMPTS = ["Hi", "Write a much longer sentence about the sea and the sky"]


@pytest.fixture(scope="module")
def tok(tiny_model):
    from esrl.models import load_tokenizer

    return load_tokenizer(tiny_model)


def params_copy(m):
    return [p.detach().clone() for p in m.parameters()]


def test_factors_are_reproducible_and_a_b_independent():
    a, b = lowrank_factors(123, 4, (32, 16), 3)
    assert a.shape == (32, 3) and b.shape == (16, 3) and a.dtype == torch.float32
    a2, b2 = lowrank_factors(123, 4, (32, 16), 3)
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert not torch.equal(a[:16], b)  # distinct seeds for A and B
    assert len({factor_seed(123, 4, "A"), factor_seed(123, 4, "B"), factor_seed(123, 5, "A"),
                factor_seed(124, 4, "A")}) == 4


def test_lowrank_selection_skips_tied_embedding_and_frozen_vectors(tiny_lm):
    assert tiny_lm.lm_head.weight is tiny_lm.model.embed_tokens.weight  # SmolLM2-style tied embeddings
    sel = lowrank_selection(tiny_lm, select_params(tiny_lm), NoiseSpec(mode="lowrank"))
    assert "model.embed_tokens.weight" not in sel.names
    assert all(p.dim() == 2 for p in sel.params) and len(sel) == 2 * 7
    full = lowrank_selection(tiny_lm, select_params(tiny_lm), NoiseSpec(mode="lowrank", lowrank_vectors="full"))
    assert any("norm" in n for n in full.names) and "model.embed_tokens.weight" not in full.names
    with pytest.raises(ValueError, match="embed_tokens"):
        lowrank_selection(tiny_lm, select_params(tiny_lm, include=["embed", "q_proj"]), NoiseSpec(mode="lowrank"),
                          include=["embed", "q_proj"])


def test_rows_in_any_order_get_their_members_perturbation(tiny_lm, tok):
    """Member-major rows take the grouped path (no gather); shuffled rows the per-row gather: same logits."""
    spec = NoiseSpec(mode="lowrank", sigma=0.05, rank=2, lowrank_vectors="full")
    sel = lowrank_selection(tiny_lm, select_params(tiny_lm), spec)
    members = population(4, 1, 3)
    enc = tok(PROMPTS * len(members), return_tensors="pt", padding=True, add_special_tokens=False)
    row_member = torch.arange(len(members)).repeat_interleave(len(PROMPTS))
    perm = torch.randperm(row_member.numel(), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        grouped = PopulationPerturbation(tiny_lm, sel, spec, members, row_member)
        assert grouped.per_member == len(PROMPTS)
        with grouped:
            expected = tiny_lm(**enc).logits
        shuffled = PopulationPerturbation(tiny_lm, sel, spec, members, row_member[perm])
        assert shuffled.per_member == 0
        with shuffled:
            got = tiny_lm(input_ids=enc["input_ids"][perm], attention_mask=enc["attention_mask"][perm]).logits
    assert torch.allclose(got, expected[perm], atol=1e-5, rtol=0), (got - expected[perm]).abs().max()


SPECS = [NoiseSpec(mode="lowrank", sigma=0.05, rank=1),
         NoiseSpec(mode="lowrank", sigma=0.05, rank=3, lowrank_vectors="full"),
         NoiseSpec(mode="lowrank", sigma=2.0, rank=2, sigma_scaling="rms", lowrank_vectors="full")]


def test_full_vectors_on_a_module_that_takes_one_weight_name_it_and_leave_no_hook():
    """nn.LayerNorm's F.layer_norm takes one weight, not one per row: one config error naming the tensor."""
    from esrl.errors import ConfigError

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    spec = NoiseSpec(mode="lowrank", sigma=0.05, rank=1, lowrank_vectors="full")
    sel = lowrank_selection(model, select_params(model), spec)
    with pytest.raises(ConfigError, match=r"lowrank_vectors: full cannot perturb weight, bias of 1 \(LayerNorm\)"):
        with torch.no_grad(), PopulationPerturbation(model, sel, spec, population(0, 0, 2), torch.arange(2)):
            model(torch.ones(2, 3, 4))
    assert not any(m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("spec", SPECS, ids=["r1", "r3-vectors", "rms"])
def test_batched_logits_equal_explicitly_perturbed_model(tiny_lm, tok, spec):
    sel = lowrank_selection(tiny_lm, select_params(tiny_lm), spec)
    members = population(1, 2, 4, antithetic=True)
    before = params_copy(tiny_lm)
    enc = tok(PROMPTS * len(members), return_tensors="pt", padding=True, add_special_tokens=False)
    row_member = torch.arange(len(members)).repeat_interleave(len(PROMPTS))
    with torch.no_grad():
        with PopulationPerturbation(tiny_lm, sel, spec, members, row_member):
            batched = tiny_lm(**enc).logits
        base = tiny_lm(**enc).logits  # hooks gone
        perturber = Perturber(sel, spec)
        single = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
        for i, m in enumerate(members):
            with perturber.perturbed(m):
                explicit = tiny_lm(**single).logits
            rows = batched[i * len(PROMPTS):(i + 1) * len(PROMPTS)]
            assert torch.allclose(rows, explicit, atol=1e-5, rtol=0), (rows - explicit).abs().max()
            assert (rows - base[:len(PROMPTS)]).abs().max() > 1e-3  # the perturbation is not negligible
    for p, q in zip(tiny_lm.parameters(), before):  # no weight was touched
        assert torch.equal(p, q)


def test_greedy_completions_batched_equal_member_by_member(tiny_lm, tok):
    from esrl.rollout import HFEngine

    spec = NoiseSpec(mode="lowrank", sigma=0.05, rank=1)
    sel = lowrank_selection(tiny_lm, select_params(tiny_lm), spec)
    members = population(0, 0, 5)
    assert_batched_equals_member_by_member(
        HFEngine(tiny_lm, tok), PROMPTS, members, lambda rm: PopulationPerturbation(tiny_lm, sel, spec, members, rm),
        Perturber(sel, spec))


@pytest.mark.parametrize("spec", [NoiseSpec(mode="lowrank", sigma=0.5, rank=2, lowrank_vectors="full"),
                                  NoiseSpec(mode="lowrank", sigma=0.5, rank=1, sigma_scaling="rms"),
                                  NoiseSpec(mode="full", sigma=0.5, sigma_scaling="rms")],
                         ids=["lowrank", "lowrank-rms", "full-rms"])
def test_update_equals_written_out_sum_over_perturbed_copies(tiny_lm, spec):
    """theta + alpha (1/N) sum_i z_i (theta_i - theta) / sigma, theta_i read off explicitly perturbed copies."""
    sel = select_params(tiny_lm, exclude=["embed"])
    if spec.mode == "lowrank":
        sel = lowrank_selection(tiny_lm, sel, spec)
    alpha = 0.01
    members = population(4, 1, 6, antithetic=True)
    z = shape_fitness(torch.tensor([0.3, -1.0, 2.0, 0.7, -0.2, 0.0]))
    expected = written_out_update(sel, spec, members, z, alpha)
    set_es_grads(sel, members, z, spec)
    torch.optim.SGD(sel.params, lr=alpha).step()
    for name, p, e in zip(sel.names, sel.params, expected):
        assert torch.allclose(p, e, atol=1e-6, rtol=0), (name, (p - e).abs().max())


@pytest.mark.parametrize("part_tensors", [1, 3, None], ids=["one-a-part", "parts-of-3", "whole-groups"])
def test_grouped_gradients_are_each_tensors_own(tiny_lm, part_tensors, monkeypatch):
    """The update batches same-shape matrices (one product per group of at most GROUP_NUMBERS numbers): every tensor
    must still get the gradient of its own factors and its own rms scale, wherever the groups split a shape's tensors
    (4 tensors in groups of 3: one full and one short). Reference: noise.lowrank_gradient tensor by tensor."""
    from esrl.es import noise

    spec = NoiseSpec(mode="lowrank", sigma=0.02, rank=2, sigma_scaling="rms")
    sel = lowrank_selection(tiny_lm, select_params(tiny_lm), spec)
    biggest = max(p.numel() for p in sel.params)
    monkeypatch.setitem(noise.GROUP_NUMBERS, "cpu", biggest * part_tensors if part_tensors else 2**30)
    groups, shapes = noise.noise_groups(sel), {tuple(p.shape) for p in sel.params}
    assert len(groups) < len(sel) and (len(groups) > len(shapes) if part_tensors else len(groups) == len(shapes))
    members = population(5, 2, 6, antithetic=True)
    z = torch.tensor([0.3, -1.0, 2.0, 0.7, -0.2, 0.0])
    coef = noise.folded_coefficients(members, z)
    got = {id(p): g for p, g in es_gradient(sel, members, z, spec)}
    assert len(got) == len(sel)
    for j, name, p in sel:
        expected = noise.lowrank_gradient(coef, 6, j, p.shape, 2, p.device) * (noise.tensor_scale(p, spec) / 0.02)
        assert torch.allclose(got[id(p)], expected, rtol=1e-5, atol=1e-9), name


def test_lowrank_gradient_is_low_rank_and_zero_for_equal_fitness(tiny_lm):
    spec = NoiseSpec(mode="lowrank", rank=2)
    sel = lowrank_selection(tiny_lm, select_params(tiny_lm), spec)
    members = population(0, 0, 3)
    grads = dict(es_gradient(sel, members, torch.tensor([1.0, -2.0, 0.5]), spec))
    g = next(iter(grads.values()))
    assert torch.linalg.matrix_rank(g) <= 3 * 2
    a, b = lowrank_factors(members[0].seed, sel.indices[0], sel.params[0].shape, 2)
    ref = sum(c * (lambda ab: ab[0] @ ab[1].T)(lowrank_factors(m.seed, sel.indices[0], sel.params[0].shape, 2))
              for c, m in zip([1.0, -2.0, 0.5], members)) / (3 * math.sqrt(2))
    assert torch.allclose(g, ref, atol=1e-6)
    zero = dict(es_gradient(sel, members, torch.zeros(3), spec))
    assert all(not v.any() and not v.isnan().any() for v in zero.values())


def test_member_chunks_are_fixed_whatever_the_world_size():
    members = population(0, 0, 7)
    chunks = member_chunks(members, 3)
    assert [[m.index for m in c] for c in chunks] == [[0, 1, 2], [3, 4, 5], [6]]
    for world in (1, 2, 3):  # the union over ranks is the same chunks, each with the same companions
        assigned = sorted((c[0].index, len(c)) for r in range(world) for c in chunks[r::world])
        assert assigned == [(0, 3), (3, 3), (6, 1)]


def test_module_batched_fitness_and_update_equal_member_by_member(tiny_model, monkeypatch):
    """ESModule's lowrank chunk path vs its member-by-member path (explicit perturbation), same noise."""
    from esrl.es.config import ESConfig
    from esrl.es.module import ESModule
    from esrl.policy import PolicyConfig
    from esrl.rollout import RolloutConfig
    from esrl.tasks import build_task

    task = build_task("conciseness", **CONCISENESS_FILES)
    monkeypatch.setattr(ESModule, "task", property(lambda self: task))
    rows = task.train_rows[:2]
    es = ESConfig(mode="lowrank", population_size=6, sigma=0.05, rank=2, antithetic=True)
    mods = []
    for _ in range(2):
        mod = ESModule(PolicyConfig(tiny_model), RolloutConfig(max_new_tokens=6, max_batch_size=4), es)
        mod.configure_model()
        mods.append(mod)
    batched_mod, single_mod = mods
    members = population(9, 0, es.population_size, antithetic=True)
    chunks = member_chunks(members, batched_mod.members_per_chunk(len(rows)))
    assert [len(c) for c in chunks] == [2, 2, 2]
    batched = [float(f[0]) for c in chunks for f in batched_mod.chunk_fitness(rows, c, [])]  # column 0: fitness
    single = [float(single_mod.member_fitness(rows, m, [])[0]) for m in members]
    assert batched == single and len(set(batched)) > 1
    for mod, fitness in ((batched_mod, batched), (single_mod, single)):
        set_es_grads(mod.selection, members, shape_fitness(torch.tensor(fitness)), mod.noise_spec)
        torch.optim.SGD(mod.selection.params, lr=0.01).step()
    assert_same_tensors(dict(batched_mod.policy.named_parameters()), dict(single_mod.policy.named_parameters()))


def test_bad_lowrank_config_is_one_clear_error():
    from esrl.errors import ConfigError
    from esrl.es.config import ESConfig

    with pytest.raises(ConfigError, match="model.es.rank"):
        ESConfig(mode="lowrank", rank=0).validate()
    with pytest.raises(ConfigError, match="model.es.sigma_scaling"):
        ESConfig(sigma_scaling="layer").validate()


# -- through the real CLI ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lowrank_config(tiny_model, tmp_path_factory):
    return write_tiny_config(tmp_path_factory.mktemp("cfg") / "es_lowrank.yaml", tiny_model, seed=5,
                             rollout={"max_batch_size": 2},  # 1 prompt/step: 2 members a chunk
                             es={"mode": "lowrank", "rank": 2, "population_size": 4, "sigma": 0.05, "alpha": 0.02,
                                 "checksum_every": 1})


@pytest.mark.slow
def test_lowrank_two_processes_give_the_weights_of_one(lowrank_config, tiny_model, tmp_path):
    one = load_safetensors(fit_final(lowrank_config, tmp_path / "one"))
    two = load_safetensors(fit_final(lowrank_config, tmp_path / "two", "--trainer.devices", "2"))
    assert_same_tensors(one, two)
    base = load_safetensors(Path(tiny_model) / "model.safetensors")
    assert torch.equal(base["model.embed_tokens.weight"], one["model.embed_tokens.weight"])  # tied: frozen
    assert not torch.equal(base["model.layers.0.mlp.up_proj.weight"], one["model.layers.0.mlp.up_proj.weight"])
    log = (tmp_path / "one").rglob("seed_log.jsonl").__next__().read_text().splitlines()
    assert '"mode": "lowrank"' in log[0] and '"rank": 2' in log[0]


@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
                                      lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.01)],
                         ids=["sgd-momentum", "adamw"])
def test_streamed_step_equals_one_step_over_all_grads(make_opt):
    from esrl.es import es_step

    spec = NoiseSpec(mode="lowrank", rank=2, lowrank_vectors="full")
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)))
    sels = [select_params(m) for m in models]
    opts = [make_opt(s.params) for s in sels]
    for t in range(3):  # several iterations: optimizer state (momentum, Adam moments) carries over
        members = population(0, t, 4)
        z = shape_fitness(torch.tensor([1.0, -0.5, 0.2, 3.0 + t]))
        es_step(opts[0], sels[0], members, z, spec)
        set_es_grads(sels[1], members, z, spec)
        opts[1].step()
        opts[1].zero_grad(set_to_none=True)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q) and p.grad is None


@pytest.mark.parametrize("static", [False, True], ids=["per-chunk hooks", "static population"])
def test_rank1_factors_reach_the_hooks_row_major(tiny_lm, tok, static, monkeypatch):
    """At rank 1 a transposed (M, n, 1) view of the factors counts as contiguous, and its strides then send the CPU's
    batched GEMV down BLAS's 3.5-7x slower route (RESULTS, session 12): both population paths must hand the hooks
    row-major copies (strides (n, n, 1))."""
    import esrl.es.modes.lowrank as lowrank_mode
    import esrl.es.static_population as static_population
    from esrl.es import get_mode

    spec = NoiseSpec(mode="lowrank", sigma=0.01, rank=1)
    sel = lowrank_selection(tiny_lm, select_params(tiny_lm), spec)
    members = population(0, 0, 3)
    seen = []
    add = lowrank_mode.lowrank_add_
    monkeypatch.setattr(lowrank_mode, "lowrank_add_", lambda ys, xs, a_t, b_t: seen.append((a_t, b_t)) or
                        add(ys, xs, a_t, b_t))
    add_linears = static_population.lowrank_add_linears_  # the static hooks' (q, k and v in one call)
    monkeypatch.setattr(static_population, "lowrank_add_linears_", lambda terms, xs: seen.extend(
        t[1:] for t in terms) or add_linears(terms, xs))
    enc = tok(PROMPTS * len(members), return_tensors="pt", padding=True, add_special_tokens=False)
    row_member = torch.arange(len(members)).repeat_interleave(len(PROMPTS))
    with torch.no_grad():
        if static:
            population_ = get_mode("lowrank").static_population(tiny_lm, sel, spec)
            population_.load(members)
            with population_.population(row_member):
                tiny_lm(**enc)
            population_.remove()
        else:
            with PopulationPerturbation(tiny_lm, sel, spec, members, row_member):
                tiny_lm(**enc)
    assert len(seen) == len(sel)
    for factors in seen:
        for t in factors:
            assert t.stride() == (t.shape[2], t.shape[2], 1), t.stride()
