"""ES over a PEFT LoRA adapter (mode lora): population batching checked against explicitly perturbed adapters.

Tolerances (fp32): batched logits equal those of the model whose adapter weights were perturbed in place with
the member's noise within atol 1e-5 (bmm over stacked per-member factors against nn.Linear; bit-identical on
the CPUs tried, the tolerance is headroom for other BLAS kernels); greedy tokens, fitness and the trained
adapter are compared exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import (CONCISENESS_FILES, assert_batched_equals_member_by_member, assert_same_tensors, fit_final,
                     load_safetensors, run_esrl, write_tiny_config, written_out_update)

from esrl.errors import ConfigError
from esrl.es import Perturber, get_mode, member_chunks, population, set_es_grads, shape_fitness
from esrl.es.config import ESConfig
from esrl.es.modes.lora import LoraPopulation
from esrl.es.setup import build_optimizer, build_policy, build_selection
from esrl.es.update import es_step

pytest.importorskip("peft")

PROMPTS = ["Hi", "Write a much longer sentence about the sea and the sky"]


@pytest.fixture(scope="module")
def tok(tiny_model):
    from esrl.models import load_tokenizer

    return load_tokenizer(tiny_model)


def lora_model(tiny_model, seed=0, **es):
    from esrl.models import load_causal_lm

    cfg = ESConfig(mode="lora", **es)
    model = build_policy(load_causal_lm(tiny_model), cfg, seed)
    selection, spec = build_selection(model, cfg)
    return model, selection, spec


def adapter_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


@torch.no_grad()
def randomize_b(selection, seed=0):
    """A trained-looking adapter (B != 0), so the tests exercise both factors, not just B = 0."""
    g = torch.Generator().manual_seed(seed)
    for name, p in zip(selection.names, selection.params):
        if ".lora_B." in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


# -- the adapter ---------------------------------------------------------------------------------------------
def test_adapter_is_seeded_identity_and_leaves_the_global_rng_alone(tiny_model, tok):
    from esrl.models import load_causal_lm

    rng = torch.get_rng_state()
    model, sel, _ = lora_model(tiny_model, seed=3, lora_rank=4)
    assert torch.equal(rng, torch.get_rng_state())
    again, _, _ = lora_model(tiny_model, seed=3, lora_rank=4)
    other, _, _ = lora_model(tiny_model, seed=4, lora_rank=4)
    assert_same_tensors(adapter_state(model), adapter_state(again))
    a = {n: p for n, p in adapter_state(model).items() if ".lora_A." in n}
    assert all(not torch.equal(p, adapter_state(other)[n]) for n, p in a.items())
    assert all(not p.any() for n, p in adapter_state(model).items() if ".lora_B." in n)  # B = 0: identity
    assert all(p.abs().max() <= 1 / p.shape[1] ** 0.5 for p in a.values())  # kaiming-uniform bound
    # targets: the 7 projections of each of the 2 layers, A and B each; nothing else is perturbed
    assert len(sel) == 2 * 7 * 2 and all(".lora_A." in n or ".lora_B." in n for n in sel.names)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(sel.names)
    enc = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        assert torch.equal(model(**enc).logits, load_causal_lm(tiny_model)(**enc).logits)


def test_layers_targets_and_include_pick_the_adapters(tiny_model):
    _, sel, _ = lora_model(tiny_model, layers="1", lora_target_modules=["q_proj", "v_proj"])
    assert len(sel) == 4 and all(".layers.1." in n and ("q_proj" in n or "v_proj" in n) for n in sel.names)
    _, sel, _ = lora_model(tiny_model, include=[r"lora_B"])
    assert len(sel) == 14 and all(".lora_B." in n for n in sel.names)
    with pytest.raises(ConfigError, match="model.es.include: .*embed"):
        lora_model(tiny_model, include=["embed"])
    with pytest.raises(ConfigError, match="model.es.lora_target_modules"):
        lora_model(tiny_model, lora_target_modules=["no_such_proj"])


def test_bad_lora_config_is_one_clear_error():
    for kwargs, field in [({"lora_rank": 0}, "model.es.lora_rank"), ({"lora_alpha": 0}, "model.es.lora_alpha"),
                          ({"lora_target_modules": []}, "model.es.lora_target_modules"),
                          ({"lora_init": "pissa"}, "model.es.lora_init"),
                          ({"sigma_scaling": "rms"}, "model.es.sigma_scaling")]:
        with pytest.raises(ConfigError, match=field):
            ESConfig(mode="lora", **kwargs).validate()
    with pytest.raises(ConfigError, match="model.es.mode"):
        ESConfig(mode="adapter").validate()


# -- population batching == explicit perturbation ----------------------------------------------------------------
@pytest.mark.parametrize("rows", ["member-major", "shuffled"])
def test_batched_logits_equal_explicitly_perturbed_adapter(tiny_model, tok, rows):
    model, sel, spec = lora_model(tiny_model, lora_rank=4, sigma=0.5,
                                  lora_init="kaiming" if rows == "member-major" else "gaussian")
    randomize_b(sel)
    members = population(1, 2, 4, antithetic=True)
    p = len(PROMPTS)
    row_member = torch.arange(len(members)).repeat_interleave(p)
    if rows == "shuffled":  # any row -> member map works (gathered per row)
        row_member = row_member[torch.randperm(row_member.numel(), generator=torch.Generator().manual_seed(0))]
    prompts = [PROMPTS[k % p] for k in range(len(row_member))]
    before = {n: q.detach().clone() for n, q in model.named_parameters()}
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        with LoraPopulation(model, sel, spec, members, row_member) as ctx:
            assert bool(ctx.per_member) == (rows == "member-major")
            batched = model(**enc).logits
        base = model(**enc).logits  # hooks gone: the unperturbed adapter
        perturber = Perturber(sel, spec)
        for i, m in enumerate(members):
            with perturber.perturbed(m):
                explicit = model(**enc).logits  # every row with member i's adapter
            mine = row_member == i
            assert torch.allclose(batched[mine], explicit[mine], atol=1e-5, rtol=0), \
                (batched[mine] - explicit[mine]).abs().max()
            assert (batched[mine] - base[mine]).abs().max() > 1e-3  # the perturbation is not negligible
    assert_same_tensors(before, {n: q.detach() for n, q in model.named_parameters()})  # no weight touched


def test_hooks_are_removed_when_the_generate_fails(tiny_model, tok):
    model, sel, spec = lora_model(tiny_model)
    enc = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        base = model(**enc).logits
        with pytest.raises(RuntimeError, match="rows"):
            with LoraPopulation(model, sel, spec, population(0, 0, 3), torch.arange(3)):
                model(**enc)  # 2 rows, a map for 3
        assert torch.equal(model(**enc).logits, base)


def test_greedy_completions_batched_equal_member_by_member(tiny_model, tok):
    from esrl.rollout import HFEngine

    model, sel, spec = lora_model(tiny_model, sigma=0.5)
    randomize_b(sel, seed=1)
    members = population(0, 0, 5)
    engine = HFEngine(model.get_base_model(), tok)  # as in ESModule: the engine holds the injected base model
    assert_batched_equals_member_by_member(
        engine, PROMPTS, members, lambda rm: get_mode(spec.mode).population(model, sel, spec, members, rm),
        Perturber(sel, spec))


def test_update_is_the_written_out_sum_over_perturbed_adapters(tiny_model):
    """theta + alpha (1/N) sum_i z_i (theta_i - theta) / sigma, in adapter space, through build_optimizer."""
    model, sel, spec = lora_model(tiny_model, sigma=0.1, alpha=0.01)
    theta = [p.detach().clone() for p in sel.params]
    members = population(4, 1, 6, antithetic=True)
    z = shape_fitness(torch.tensor([0.3, -1.0, 2.0, 0.7, -0.2, 0.0]))
    expected = written_out_update(sel, spec, members, z, alpha=0.01)
    es_step(build_optimizer(sel.params, ESConfig(mode="lora", alpha=0.01)), sel, members, z, spec)
    for name, p, e in zip(sel.names, sel.params, expected):
        assert torch.allclose(p, e, atol=1e-6, rtol=0), (name, (p - e).abs().max())
    assert any(not torch.equal(p, t) for p, t in zip(sel.params, theta) if p.abs().sum() > 0)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_module_batched_fitness_and_update_equal_member_by_member(tiny_model, monkeypatch, optimizer):
    """ESModule's lora chunk path vs its member-by-member path (adapter perturbed in place), same noise."""
    from esrl.es.module import ESModule
    from esrl.policy import PolicyConfig
    from esrl.rollout import RolloutConfig
    from esrl.tasks import build_task

    task = build_task("conciseness", **CONCISENESS_FILES)
    monkeypatch.setattr(ESModule, "task", property(lambda self: task))
    rows = task.train_rows[:2]
    es = ESConfig(mode="lora", population_size=6, sigma=0.5, alpha=0.05, antithetic=True, lora_rank=4,
                  optimizer=optimizer)
    mods = []
    for _ in range(2):
        mod = ESModule(PolicyConfig(tiny_model), RolloutConfig(max_new_tokens=6, max_batch_size=4), es)
        mod.configure_model()
        mods.append(mod)
    batched_mod, single_mod = mods
    assert_same_tensors(adapter_state(batched_mod.policy), adapter_state(single_mod.policy))
    opts = {id(mod): build_optimizer(mod.selection.params, es) for mod in mods}
    for t in range(2):  # two iterations: the second starts from a non-zero B (and Adam's moments)
        members = population(9, t, es.population_size, antithetic=True)
        chunks = member_chunks(members, batched_mod.members_per_chunk(len(rows)))
        assert [len(c) for c in chunks] == [2, 2, 2]
        batched = torch.cat([batched_mod.chunk_fitness(rows, c, []) for c in chunks])
        single = torch.stack([single_mod.member_fitness(rows, m, []) for m in members])
        assert torch.equal(batched, single) and len(set(batched[:, 0].tolist())) > 1
        for mod, fitness in ((batched_mod, batched), (single_mod, single)):
            es_step(opts[id(mod)], mod.selection, members, shape_fitness(fitness[:, 0]), mod.noise_spec)
        assert_same_tensors(dict(batched_mod.policy.named_parameters()), dict(single_mod.policy.named_parameters()))
    assert any(p.any() for n, p in adapter_state(batched_mod.policy).items() if ".lora_B." in n)


def test_set_es_grads_matches_es_step_in_adapter_space(tiny_model):
    model, sel, spec = lora_model(tiny_model)
    members = population(0, 0, 4)
    set_es_grads(sel, members, torch.tensor([1.0, -1.0, 0.5, 0.0]), spec)
    assert all(p.grad is not None and p.grad.shape == p.shape for p in sel.params)
    assert all(p.grad is None for n, p in model.named_parameters() if n not in set(sel.names))


# -- through the real CLI ---------------------------------------------------------------------------------------
STEPS = 2


@pytest.fixture(scope="module")
def lora_config(tiny_model, tmp_path_factory):
    return write_tiny_config(
        tmp_path_factory.mktemp("cfg") / "es_lora.yaml", tiny_model, seed=5, max_steps=STEPS,
        rollout={"max_batch_size": 2},  # 1 prompt/step: 2 members a chunk
        es={"mode": "lora", "lora_rank": 4, "population_size": 4, "sigma": 0.5, "alpha": 0.05, "optimizer": "adam",
            "checksum_every": 1},
        trainer={"enable_checkpointing": True,
                 "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                "init_args": {"every_n_train_steps": 1, "save_top_k": -1, "filename": "{step}"}}]})


@pytest.fixture(scope="module")
def lora_run(lora_config, tmp_path_factory):
    return fit_final(lora_config, tmp_path_factory.mktemp("lora_run")).parent


@pytest.mark.slow
def test_final_holds_the_peft_adapter_and_the_merged_model(lora_run, tiny_model, tok):
    from peft import PeftModel

    from esrl.models import load_causal_lm

    assert (lora_run / "adapter" / "adapter_config.json").is_file()
    assert (lora_run / "adapter" / "adapter_model.safetensors").is_file()
    adapter = load_safetensors(lora_run / "adapter" / "adapter_model.safetensors")
    assert any(".lora_B." in k and v.any() for k, v in adapter.items())  # trained: B moved off zero
    peft_model = PeftModel.from_pretrained(load_causal_lm(tiny_model), lora_run / "adapter")
    merged = load_causal_lm(str(lora_run))  # final/ is a plain HF model
    base = load_safetensors(Path(tiny_model) / "model.safetensors")
    final = load_safetensors(lora_run / "model.safetensors")
    assert final.keys() == base.keys()
    assert torch.equal(final["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert not torch.equal(final["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])
    assert_same_tensors(final, {k: v.contiguous() for k, v in
                                peft_model.merge_and_unload().state_dict().items() if k in final})
    enc = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    again = PeftModel.from_pretrained(load_causal_lm(tiny_model), lora_run / "adapter")
    with torch.no_grad():
        assert torch.allclose(merged(**enc).logits, again(**enc).logits, atol=1e-5, rtol=0)
    log = (lora_run.parent / "seed_log.jsonl").read_text().splitlines()
    assert '"mode": "lora"' in log[0] and '"lora_rank": 4' in log[0] and len(log) == 1 + STEPS


@pytest.mark.slow
def test_lora_resume_from_checkpoint_equals_uninterrupted(lora_config, lora_run, tmp_path):
    ckpt = next(lora_run.parent.glob("checkpoints/step=1.ckpt"))
    resumed = fit_final(lora_config, tmp_path, "--ckpt_path", ckpt).parent
    assert_same_tensors(load_safetensors(lora_run / "model.safetensors"), load_safetensors(resumed / "model.safetensors"))
    assert_same_tensors(load_safetensors(lora_run / "adapter" / "adapter_model.safetensors"),
                        load_safetensors(resumed / "adapter" / "adapter_model.safetensors"))


@pytest.mark.slow
def test_lora_export_from_seed_log_equals_final(lora_run, tiny_model, tmp_path):
    from esrl.export import export  # in process (the CLI wrapper is tested in test_es_fit)

    export(str(lora_run.parent / "seed_log.jsonl"), str(tmp_path / "rebuilt"), tiny_model)
    assert_same_tensors(load_safetensors(lora_run / "model.safetensors"),
                        load_safetensors(tmp_path / "rebuilt" / "model.safetensors"))
    assert_same_tensors(load_safetensors(lora_run / "adapter" / "adapter_model.safetensors"),
                        load_safetensors(tmp_path / "rebuilt" / "adapter" / "adapter_model.safetensors"))


@pytest.mark.slow
def test_lora_two_processes_give_the_weights_of_one(lora_config, lora_run, tmp_path):
    two = fit_final(lora_config, tmp_path, "--trainer.devices", "2").parent
    assert_same_tensors(load_safetensors(lora_run / "adapter" / "adapter_model.safetensors"),
                        load_safetensors(two / "adapter" / "adapter_model.safetensors"))
    assert_same_tensors(load_safetensors(lora_run / "model.safetensors"), load_safetensors(two / "model.safetensors"))


@pytest.mark.parametrize("args,culprit", [
    (["--model.es.lora_rank", "0"], "model.es.lora_rank"),
    (["--model.es.lora_target_modules", "[nope_proj]"], "model.es.lora_target_modules"),
])
def test_bad_lora_config_exits_with_one_line(args, culprit, tiny_model, tmp_path):
    from conftest import ROOT

    out = run_esrl("fit", "--config", ROOT / "configs" / "demo" / "es_conciseness_lora.yaml",
                   "--model.policy.name_or_path", tiny_model, "--trainer.max_steps", "1",
                   "--trainer.default_root_dir", tmp_path, *args)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.startswith("esrl: error:")]
    assert len(lines) == 1 and culprit in lines[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
