"""Tiny random models with the real SmolLM2 tokenizer: real code paths at test speed.

A causal Llama (policies, references) and a Llama score model in Safe-RLHF's layout (reward and cost models).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch


def tiny_llama(out_dir: str | Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
               tokenizer_from: str = "smollm2-135m-instruct") -> str:
    """Write a random-weight Llama (SmolLM2's vocabulary and chat template) to out_dir; return the path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from esrl.models.loading import load_tokenizer

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return str(out)
    tok = load_tokenizer(tokenizer_from)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def tiny_score_model(out_dir: str | Path, seed: int = 0, score_type: str = "reward", hidden_size: int = 64,
                     num_layers: int = 2, score_bias: bool = True,
                     tokenizer_from: str = "smollm2-135m-instruct", tokenizer: Any = None) -> str:
    """Write a random-weight LlamaForScore in Safe-RLHF's layout (SmolLM2's tokenizer) to out_dir; return the path.

    `tokenizer` (an already loaded one) saves loading `tokenizer_from` again.
    """
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaModel

    from esrl.models.loading import load_tokenizer

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return str(out)
    tok = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_from)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForScore"]
    config.score_dim, config.score_bias, config.score_type = 1, score_bias, score_type
    config.do_normalize, config.normalizer_type = False, None
    torch.manual_seed(seed)
    backbone = LlamaModel(config)
    head = torch.nn.Linear(hidden_size, 1, bias=score_bias)
    torch.nn.init.normal_(head.weight, std=1.0 / math.sqrt(hidden_size))
    if score_bias:
        torch.nn.init.zeros_(head.bias)  # as Safe-RLHF initialises it
    state = {f"model.{k}": v.contiguous() for k, v in backbone.state_dict().items()}
    state.update({f"score_head.{k}": v.contiguous() for k, v in head.state_dict().items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)
