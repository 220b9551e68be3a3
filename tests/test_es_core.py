"""ES math in plain torch, checked against written-out references."""

from __future__ import annotations


import pytest
import torch

from esrl.es import Perturber, population, select_params, set_es_grads, shape_fitness, tensor_noise, weights_checksum
from esrl.es.noise import member_seed
from esrl.es.shaping import centered_rank, zscore


def small_model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    return m.to(dtype)


def params_copy(m):
    return [p.detach().clone() for p in m.parameters()]


def test_noise_is_reproducible_and_independent_across_tensors():
    a = tensor_noise(123, 0, (100, 100))
    assert torch.equal(a, tensor_noise(123, 0, (100, 100)))
    b = tensor_noise(123, 1, (100, 100))  # same member, next tensor
    c = tensor_noise(124, 0, (100, 100))  # next member
    assert not torch.equal(a, b) and not torch.equal(a, c)
    corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten(), c.flatten()]))
    assert corr[0, 1].abs() < 0.05 and corr[0, 2].abs() < 0.05
    assert abs(a.mean()) < 0.05 and abs(a.std() - 1) < 0.05


def test_member_seeds_depend_on_run_iteration_member_only():
    assert member_seed(0, 3, 5) == member_seed(0, 3, 5)
    assert len({member_seed(0, 3, i) for i in range(100)}) == 100
    assert member_seed(0, 3, 5) != member_seed(1, 3, 5) != member_seed(0, 4, 5)
    pop = population(7, 2, 6, antithetic=True)
    assert [m.sign for m in pop] == [1, -1, 1, -1, 1, -1]
    assert pop[0].seed == pop[1].seed != pop[2].seed == pop[3].seed
    assert [m.seed for m in population(7, 2, 4)] == [member_seed(7, 2, i) for i in range(4)]


def test_zscore_matches_written_out_values():
    f = torch.tensor([1.0, 2.0, 3.0, 6.0])
    mean, std = 3.0, (((1 - 3) ** 2 + (2 - 3) ** 2 + 0 + (6 - 3) ** 2) / 4) ** 0.5
    expected = torch.tensor([(x - mean) / (std + 1e-8) for x in [1, 2, 3, 6]], dtype=torch.float64)
    assert torch.allclose(zscore(f), expected, atol=1e-12)


def test_centered_rank_is_tie_safe():
    r = centered_rank(torch.tensor([10.0, -1.0, 10.0, 3.0]))
    # ranks: -1 -> 0, 3 -> 1, the two 10s share (2 + 3) / 2 = 2.5; scaled by 1/(n-1) and centered
    assert torch.allclose(r, torch.tensor([2.5 / 3 - 0.5, -0.5, 2.5 / 3 - 0.5, 1 / 3 - 0.5], dtype=torch.float64))
    assert r[0] == r[2]


@pytest.mark.parametrize("method", ["zscore", "centered_rank", "raw"])
def test_all_equal_fitness_gives_zero_update_never_nan(method):
    m = small_model()
    before = params_copy(m)
    sel = select_params(m)
    members = population(0, 0, 6)
    shaped = shape_fitness(torch.full((6,), 4.2), method)
    if method == "raw":
        shaped = shaped - shaped.mean()  # raw rewards are not centered; equal centered values are zero
    assert not torch.isnan(shaped).any()
    set_es_grads(sel, members, shaped)
    torch.optim.SGD(sel.params, lr=0.1).step()
    for p, q in zip(m.parameters(), before):
        assert torch.equal(p, q)


@pytest.mark.parametrize("n,value", [(7, 0.7), (30, 1000000.1), (100, 123456.789)])
def test_equal_fitness_whose_mean_rounds_off_them_still_shapes_to_zeros(n, value):
    """The mean of these equal values is off by a rounding step; (f - mean) / (0 + 1e-8) made it a random update."""
    f = torch.full((n,), value, dtype=torch.float64)
    assert f.mean() != value  # the case: the mean rounds away from the values
    assert torch.equal(shape_fitness(f, "zscore"), torch.zeros(n, dtype=torch.float64))
    with_nan = torch.tensor([value] * n + [float("nan")])
    assert torch.equal(shape_fitness(with_nan, "zscore"), torch.zeros(n + 1, dtype=torch.float64))


def test_update_equals_written_out_sum_over_perturbed_copies():
    """theta + alpha/N sum_i z_i eps_i, with eps_i read off explicitly perturbed copies of the model."""
    m = small_model()
    theta = params_copy(m)
    sel = select_params(m)
    sigma, alpha, n = 0.5, 0.01, 5
    members = population(11, 3, n)
    fitness = torch.tensor([0.3, -1.0, 2.0, 0.7, -0.2])
    z = shape_fitness(fitness)
    perturber = Perturber(sel)
    copies = []
    for mem in members:
        with perturber.perturbed(mem, sigma):
            copies.append(params_copy(m))
    expected = []
    for k, t in enumerate(theta):
        g = sum(float(z[i]) * (copies[i][k] - t) / sigma for i in range(n)) / n
        expected.append(t + alpha * g)
    set_es_grads(sel, members, z)
    torch.optim.SGD(sel.params, lr=alpha).step()
    for p, e in zip(m.parameters(), expected):
        assert torch.allclose(p, e, atol=1e-6, rtol=0), (p - e).abs().max()


def test_antithetic_pairs_fold_into_one_noise_draw_with_the_same_result():
    m = small_model()
    members = population(5, 0, 4, antithetic=True)
    z = torch.tensor([1.0, -0.5, 0.25, 2.0], dtype=torch.float64)
    set_es_grads(select_params(m), members, z)
    for j, p in enumerate(m.parameters()):  # reference: every member drawn on its own
        g = sum(float(z[i]) * members[i].sign * tensor_noise(members[i].seed, j, p.shape) for i in range(4)) / 4
        assert torch.allclose(-p.grad, g, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_restore_is_bit_exact_after_many_cycles(dtype):
    m = small_model(dtype)
    before = params_copy(m)
    perturber = Perturber(select_params(m))
    for i, mem in enumerate(population(0, 0, 50, antithetic=True)):
        with perturber.perturbed(mem, sigma=0.01 * (i + 1)):
            assert not torch.equal(next(m.parameters()), before[0])
    for p, q in zip(m.parameters(), before):
        assert torch.equal(p, q)


def test_failing_reward_never_leaves_weights_perturbed():
    m = small_model()
    before = params_copy(m)
    perturber = Perturber(select_params(m))
    with pytest.raises(RuntimeError, match="scorer down"):
        with perturber.perturbed(population(0, 0, 2)[0], 0.1):
            raise RuntimeError("scorer down")
    assert not perturber.is_perturbed
    for p, q in zip(m.parameters(), before):
        assert torch.equal(p, q)


def test_parameter_filter_include_exclude_layers(tiny_lm):
    names = [n for n, _ in tiny_lm.named_parameters()]
    assert select_params(tiny_lm).names == names
    attn = select_params(tiny_lm, include=[r"self_attn\."])
    assert attn.names and all("self_attn." in n for n in attn.names)
    no_norm = select_params(tiny_lm, exclude=["norm"])
    assert all("norm" not in n for n in no_norm.names)
    layer1 = select_params(tiny_lm, layers="1")
    assert layer1.names and all(".layers.1." in n for n in layer1.names)
    # indices are positions in the full parameter list: filtering never changes another tensor's noise
    assert [names[j] for j in layer1.indices] == layer1.names
    with pytest.raises(ValueError, match="selects no parameter"):
        select_params(tiny_lm, include=["does-not-exist"])


def test_checksum_sees_a_one_ulp_change():
    m = small_model()
    before = weights_checksum(list(m.parameters()))
    p = next(m.parameters())
    with torch.no_grad():
        p.view(-1)[3] = torch.nextafter(p.view(-1)[3], torch.tensor(10.0))
    assert weights_checksum(list(m.parameters())) != before


def test_es_update_is_one_lightning_optimizer_step_per_iteration(tiny_model, tmp_path):
    """Lightning's precision plugin sees each ES update as ONE optimizer step (on_before_optimizer_step fires
    once per iteration, with every perturbed tensor's gradient set); fp16 loss scaling is refused in one line."""
    import lightning as L

    from conftest import FIXTURES
    from esrl.data import PromptDataModule
    from esrl.errors import ConfigError
    from esrl.es.config import ESConfig
    from esrl.es.module import ESModule
    from esrl.policy import PolicyConfig
    from esrl.rollout import RolloutConfig

    class Steps(L.Callback):
        def __init__(self):
            self.grads_set = []

        def on_before_optimizer_step(self, trainer, module, optimizer):
            self.grads_set.append(all(p.grad is not None for p in module.selection.params))

    def fit(precision: str, steps: Steps):
        module = ESModule(PolicyConfig(name_or_path=tiny_model), RolloutConfig(max_new_tokens=4),
                          ESConfig(population_size=4, sigma=0.05, alpha=0.01, seed=1, mode="lowrank"))
        data = PromptDataModule("conciseness", {"train_path": str(FIXTURES / "conciseness_train3.jsonl"),
                                                "eval_path": str(FIXTURES / "conciseness_eval2.jsonl")},
                                prompts_per_step=1)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, logger=False,
                            default_root_dir=tmp_path, limit_val_batches=0, precision=precision, callbacks=[steps])
        trainer.fit(module, datamodule=data)
        return module

    steps = Steps()
    module = fit("32-true", steps)
    assert steps.grads_set == [True, True, True]
    assert all(p.grad is None for p in module.selection.params)  # dropped after the step
    with pytest.raises(ConfigError, match="trainer.precision"):
        fit("16-mixed", Steps())


def test_the_member_table_gathered_from_ranks_gives_the_metrics_over_all_completions():
    """Two members of two completions each, filled on two ranks and summed, against the values written out: a
    reward function's None (NaN) values count in no mean, so its mean is over the completions it scored (0.5 as a
    mean of members' means, 1/3 over all), and a function that scored none is NaN, as GRPO's nanmean."""
    import math

    from esrl.es.member_scores import COLUMNS, completion_metrics, member_table

    nan = math.nan
    rewards, lengths, truncated = [1, 0, 0, 0], [3, 4, 5, 6], [False, True, False, False]
    per_function = {"f": [1.0, nan, 0.0, 0.0], "g": [nan] * 4}
    whole = member_table(2, rewards, lengths, truncated, per_function)
    assert whole.shape == (2, len(COLUMNS) + 4)
    gathered = torch.zeros_like(whole)
    for rank in range(2):  # each rank fills its own member's row, the others stay 0
        mine = slice(2 * rank, 2 * rank + 2)
        gathered[rank] += member_table(1, rewards[mine], lengths[mine], truncated[mine],
                                       {k: v[mine] for k, v in per_function.items()})[0]
    assert torch.equal(gathered, whole)
    metrics = completion_metrics(gathered, ["f", "g"])
    assert math.isnan(metrics.pop("train/rewards/g/mean"))
    assert metrics == {"train/completion_length_mean": 4.5, "train/completion_length_min": 3.0,
                       "train/completion_length_max": 6.0, "train/truncated_frac": 0.25,
                       "train/rewards/f/mean": pytest.approx(1 / 3)}


def test_an_unknown_shaping_is_named_when_the_config_is_checked_not_after_an_iteration():
    from esrl.errors import ConfigError
    from esrl.es.config import ESConfig

    with pytest.raises(ConfigError, match="model.es.shaping: choose zscore, centered_rank or raw, got 'bogus'"):
        ESConfig(shaping="bogus").validate()
