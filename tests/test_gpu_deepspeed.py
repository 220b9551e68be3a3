"""GRPO under DeepSpeed on a CUDA GPU (`pytest -m gpu`; skipped without CUDA or deepspeed, so CI, which has
neither, skips them). Lightning runs DeepSpeed on CUDA only, so none of this can run on a CPU.

The reference for each DeepSpeed run is the same fit on one GPU without DeepSpeed, whose GRPO step the CPU suite
checks against TRL's own code (tests/test_grpo_parity_batches.py, tests/test_grpo_fit.py). The model: the tests'
tiny random Llama in fp32 (its tokenizer the embedded SmolLM2 one, or the folder in ESRL_TOKENIZER on a machine
without the embedded model's files). One optimizer step each, so both runs roll out the same completions.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import assert_same_tensors, fit_final, load_safetensors, write_tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("deepspeed")

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"], "layers": "1"}
CHECKPOINT_EVERY_STEP = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                         "init_args": {"every_n_train_steps": 1, "save_top_k": -1, "filename": "{step}"}}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from esrl.models import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tiny") / "llama",
                      tokenizer_from=os.environ.get("ESRL_TOKENIZER", "smollm2-135m-instruct"))


def _config(path: Path, model: str, grpo: dict, max_steps: int = 1, **trainer) -> Path:
    return write_tiny_config(path, model, prompts_per_step=1, max_steps=max_steps,
                             rollout={"temperature": 1.0, "stop": ["e", "a", "o"]},  # unequal completion lengths
                             grpo={"num_generations": 4, "num_iterations": 1, **grpo},
                             trainer={"accelerator": "gpu", "devices": 1, **trainer})


def _update(final: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: final[k].double() - base[k].double() for k in base}


@pytest.mark.parametrize("loss_type", ["dapo", "vespo"])
def test_accumulated_step_under_deepspeed_equals_one_gpu(model, tmp_path, loss_type):
    """accumulate_grad_batches 2, micro-batches of unequal token counts, plain SGD and no clipping, so the update
    is lr x the accumulated gradient: DeepSpeed ZeRO-2 (which owns the gradient buffers) gives the same update as
    one GPU, i.e. TRL's num_items_in_batch normalization (a rescale after the backwards would be missing here)."""
    config = _config(tmp_path / "acc.yaml", model, {"loss_type": loss_type, "beta": 0.0, "max_grad_norm": None},
                     accumulate_grad_batches=2)
    sgd = ("--optimizer", "torch.optim.SGD", "--optimizer.lr", "1.0")
    base = load_safetensors(Path(model) / "model.safetensors")
    plain_final = fit_final(config, tmp_path / "plain", "--algo", "grpo", *sgd)
    ds_final = fit_final(config, tmp_path / "ds", "--algo", "grpo", *sgd, "--trainer.strategy", "deepspeed_stage_2")
    plain, ds = (_update(load_safetensors(final), base) for final in (plain_final, ds_final))
    largest = max(float(u.abs().max()) for u in plain.values())
    assert largest > 0
    worst = max(float((ds[k] - plain[k]).abs().max()) for k in plain)
    assert worst <= 1e-4 * largest, (worst, largest)
    # Lightning calls the step hooks on every micro-batch under DeepSpeed: the step's loss is logged once, whole
    plain_loss, ds_loss = (_logged(final, "train/loss") for final in (plain_final, ds_final))
    assert len(ds_loss) == len(plain_loss) == 1 and ds_loss[0] == pytest.approx(plain_loss[0], rel=1e-4)


def _logged(final: Path, key: str) -> list[float]:
    import csv

    with (final.parent.parent / "metrics.csv").open() as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]


@pytest.mark.parametrize("strategy", ["deepspeed_stage_1", "deepspeed_stage_2"])
def test_grpo_lora_under_deepspeed_equals_one_gpu(model, tmp_path, strategy):
    """model.grpo.lora under ZeRO-1/2: only the adapter trains; final/ holds the merged model and final/adapter/ the
    adapter, both equal to the one-GPU run's (TRL's AdamW, fp32 master weights either way)."""
    config = _config(tmp_path / "lora.yaml", model, {"learning_rate": 1e-2, "beta": 0.04, "lora": LORA})
    plain = fit_final(config, tmp_path / "plain", "--algo", "grpo").parent
    ds = fit_final(config, tmp_path / strategy, "--algo", "grpo", "--trainer.strategy", strategy).parent
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        want, got = load_safetensors(plain / name), load_safetensors(ds / name)
        assert want.keys() == got.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")
    base = load_safetensors(Path(model) / "model.safetensors")
    merged = load_safetensors(ds / "model.safetensors")
    moved = [k for k in base if not torch.equal(base[k], merged[k])]
    assert moved and all(".layers.1." in k for k in moved), moved  # only the adapted layer's targets changed


def test_grpo_lora_under_deepspeed_resumes_exactly(model, tmp_path):
    """A ZeRO-2 LoRA run resumed from step 1's checkpoint (a DeepSpeed checkpoint folder) ends where the
    uninterrupted one does."""
    config = _config(tmp_path / "resume.yaml", model, {"learning_rate": 1e-2, "beta": 0.0, "lora": LORA},
                     max_steps=2, enable_checkpointing=True, callbacks=[CHECKPOINT_EVERY_STEP])
    args = ("--algo", "grpo", "--trainer.strategy", "deepspeed_stage_2")
    whole = fit_final(config, tmp_path / "whole", *args).parent
    ckpt = next((tmp_path / "whole").rglob("checkpoints/step=1.ckpt"))
    resumed = fit_final(config, tmp_path / "resumed", *args, "--ckpt_path", str(ckpt)).parent
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        assert_same_tensors(load_safetensors(whole / name), load_safetensors(resumed / name))
