"""Generation engines behind one interface (esrl.rollout.base.RolloutEngine)."""

import torch

from esrl.rollout.base import (AdapterSpec, Completion, EngineCapabilities, RolloutConfig, RolloutEngine,
                               RowWeights)
from esrl.rollout.hf import HFEngine
from esrl.rollout.text import cut_at_stop, encode_prompts, render_prompts


def engine_capabilities(config: RolloutConfig, adapters: AdapterSpec | None = None) -> EngineCapabilities:
    """What `build_engine(config, ..., adapters=adapters)` will be able to do, known before it is built."""
    if config.engine == "hf":  # static_shapes (compile: auto: recorded on CUDA only) is known once it is placed
        return EngineCapabilities(shares_policy_weights=True, row_adapters=False, sleeps=False,
                                  static_shapes=config.compile in ("on", "fused"))
    if config.engine == "vllm":
        from esrl.rollout.vllm import VLLMEngine

        return VLLMEngine.capabilities_for(config, adapters)
    raise ValueError(f"rollout.engine: unknown engine {config.engine!r}")


def build_engine(config: RolloutConfig, model, tokenizer, adapters: AdapterSpec | None = None,
                 compute_dtype: torch.dtype | None = None) -> RolloutEngine:
    """The configured engine. `adapters`: the row adapters it must be able to run (engines whose capabilities
    say row_adapters); engines that share the policy's weights need none and ignore it. `compute_dtype`: the dtype
    the policy's forward runs in where that is not its weights' (mixed precision: fp32 weights, a bf16 forward); an
    engine with its own copy of the weights (vLLM) runs in it, else in the weights' dtype."""
    if config.engine == "hf":
        return HFEngine(model, tokenizer, max_batch_size=config.max_batch_size, compile=config.compile,
                        prompt_bucket=config.prompt_bucket)
    if config.engine == "vllm":  # imported lazily: vllm is an optional dependency
        from esrl.rollout.vllm import VLLMEngine

        dtype = str(compute_dtype or next(model.parameters()).dtype).removeprefix("torch.")
        return VLLMEngine(model.name_or_path, tokenizer, config, dtype=dtype, hf_model=model, adapters=adapters)
    raise ValueError(f"rollout.engine: unknown engine {config.engine!r}")


__all__ = ["AdapterSpec", "Completion", "EngineCapabilities", "HFEngine", "RolloutConfig", "RolloutEngine",
           "RowWeights", "build_engine", "cut_at_stop", "encode_prompts", "engine_capabilities", "render_prompts"]
