"""The final save of a LoRA policy: the merged weights of PEFT's merge_and_unload, merged in CPU memory."""

from __future__ import annotations

import copy

import pytest
import torch

from esrl.models import load_causal_lm, load_tokenizer
from esrl.models.lora import GRPO_FIELDS, LoraOptions, merged_state_dict, save_final, wrap_lora


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_merged_weights_equal_peft_merge_and_unload_and_leave_the_policy_as_it_was(tiny_model, tmp_path,
                                                                                    dtype):
    """Bit for bit PEFT's merge (its delta added in W's dtype: bf16 weights here get fp32 adapters, as
    AdapterSlots' callers do); the embeddings and lm_head (tied in this model) stay one saved tensor; the policy
    keeps its adapter and weights; no second model on the policy's device (the reason for merging layer by layer:
    a CPU cannot show the device memory, so the test checks what it returns, on the CPU)."""
    policy = wrap_lora(load_causal_lm(tiny_model, dtype), LoraOptions(rank=4, alpha=8.0, layers="1"), 0,
                       GRPO_FIELDS)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator).to(torch.float32))
                p.data = p.data.float()  # fp32 adapter on a bf16 base: the sum promotes, then rounds to W's dtype
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    reference = copy.deepcopy(policy).merge_and_unload().state_dict()

    merged = merged_state_dict(policy)
    assert merged.keys() == reference.keys()
    for key, tensor in reference.items():
        assert merged[key].device.type == "cpu" and merged[key].dtype == tensor.dtype, key
        assert torch.equal(merged[key], tensor), key
    assert not torch.equal(merged["model.layers.1.self_attn.q_proj.weight"],
                           before["base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight"])
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                       before["base_model.model.model.layers.0.self_attn.q_proj.weight"])  # layer 0 has no adapter
    assert merged["lm_head.weight"] is merged["model.embed_tokens.weight"]  # tied: one tensor, saved once
    after = policy.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())

    out = save_final(policy, load_tokenizer(tiny_model), tmp_path / "final")
    loaded = load_causal_lm(str(out), dtype).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in reference.items())
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_the_adapter_names_its_base_by_a_path_that_works_from_anywhere(tiny_model, tmp_path, monkeypatch):
    """PEFT writes the base's name_or_path as the policy was loaded: a relative folder left final/adapter pointing
    nowhere once read from another folder or machine (AutoPeftModelForCausalLM.from_pretrained failed)."""
    import json
    import os
    from pathlib import Path

    monkeypatch.chdir(Path(tiny_model).parent)
    policy = wrap_lora(load_causal_lm(os.path.basename(tiny_model)), LoraOptions(rank=2), 0, GRPO_FIELDS)
    out = save_final(policy, load_tokenizer(tiny_model), tmp_path / "final")
    saved = json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert saved == str(Path(tiny_model).resolve())


def test_an_adapter_on_a_tied_head_is_refused(tiny_model):
    """The merged lm_head would be saved apart from the embeddings it is tied to, under a config that says tied:
    vLLM and transformers 4 load the embeddings there, without the adapter."""
    from esrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^model.grpo.lora.target_modules: lm_head is tied to the input "
                                          r"embeddings"):
        wrap_lora(load_causal_lm(tiny_model), LoraOptions(target_modules=["q_proj", "lm_head"]), 0, GRPO_FIELDS)


@pytest.mark.parametrize("layers", ["1-", "0-9"])
def test_an_adapter_on_the_embeddings_or_past_the_last_layer_is_refused(tiny_model, layers):
    """PEFT adapts an embedding with lora_embedding_A/B, which esrl's seeded init never drew (the global RNG's) and
    whose merge a tied head does not see; '1-' read as layer 1 alone, '0-9' reaches past the 2 layers."""
    from esrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^model.grpo.lora.target_modules: model.embed_tokens is an embedding"):
        wrap_lora(load_causal_lm(tiny_model), LoraOptions(target_modules=["q_proj", "embed_tokens"]), 0, GRPO_FIELDS)
    with pytest.raises((ConfigError, ValueError), match=r"no last layer|reaches past the model's 2 layers"):
        wrap_lora(load_causal_lm(tiny_model), LoraOptions(layers=layers), 0, GRPO_FIELDS)
