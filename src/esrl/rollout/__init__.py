"""Generation engines behind one interface."""

from esrl.rollout.base import Completion, RolloutConfig, RolloutEngine
from esrl.rollout.hf import HFEngine, render_prompts


def build_engine(config: RolloutConfig, model, tokenizer, **options) -> RolloutEngine:
    """`options` go to the vLLM engine (lora_rank, lora_target_modules for ES lowrank / lora member adapters,
    see esrl.rollout.vllm.es_engine_options); the HF engine takes none."""
    if config.engine == "hf":
        return HFEngine(model, tokenizer, max_batch_size=config.max_batch_size)
    if config.engine == "vllm":  # imported lazily: vllm is an optional dependency
        from esrl.rollout.vllm import VLLMEngine

        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        return VLLMEngine(model.name_or_path, tokenizer, config, dtype=dtype, hf_model=model, **options)
    raise ValueError(f"rollout.engine: unknown engine {config.engine!r}")


__all__ = ["Completion", "HFEngine", "RolloutConfig", "RolloutEngine", "build_engine", "render_prompts"]
