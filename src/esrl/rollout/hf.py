"""Batched generation with transformers: left padding, greedy or sampled, stop strings, an optional compiled
decode path (static KV cache + torch.compile: CUDA graphs on GPUs, where eager decoding is launch-bound)."""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from esrl.rollout.base import Completion, EngineCapabilities, RolloutEngine, RowWeights
from esrl.rollout.text import cut_at_stop, render_prompts
from esrl.tasks.base import Prompt


# cuDNN's fused attention, PyTorch's first choice for padded batches on Hopper, is not bitwise repeatable at some
# KV lengths (measured on an H100: two identical generates differ from ~130 tokens on); mem-efficient attention is,
# and is faster for rollout shapes (0.88x the floor). Compiled decoding fixes its kernel when traced, so this is in
# force then too. benchmarks/gpu/NOTES_issue15.md has the measurements.
ROLLOUT_ATTENTION = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def rollout_attention(device: torch.device):
    """The attention kernels rollouts may use on `device`: repeatable ones (no cuDNN) on CUDA."""
    return sdpa_kernel(ROLLOUT_ATTENTION) if device.type == "cuda" else nullcontext()


class HFEngine(RolloutEngine):
    """Generates with the policy module itself, so in-place weight changes (ES) take effect at once."""

    def __init__(self, model, tokenizer, max_batch_size: int = 64, compile: str = "off", prompt_bucket: int = 64):
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.compile = compile
        self.prompt_bucket = prompt_bucket
        self.compile_log: list[tuple[tuple[int, int, int], float]] = []
        """((rows, padded prompt tokens, new tokens), seconds of the first call) of every compiled shape."""
        self._compile_config = None

    def compile_times(self) -> list[tuple[tuple[int, int, int], float]]:
        return list(self.compile_log)

    @property
    def compiled(self) -> bool:
        """Whether generate takes the compiled static-cache path (decided where the policy is now: Lightning
        moves it to its device after the engine is built)."""
        return self.compile == "on" or (self.compile == "auto" and self.model.device.type == "cuda")

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(shares_policy_weights=True, row_adapters=False, sleeps=False,
                                  static_shapes=self.compiled)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Prompt], *, max_new_tokens: int, greedy: bool = True,
                 temperature: float = 1.0, top_p: float = 1.0, stop: Sequence[str] = (),
                 num_return_sequences: int = 1, seed: int | None = None,
                 min_new_tokens: int | None = None) -> list[Completion]:
        texts = render_prompts(self.tokenizer, prompts)
        per_chunk = max(1, self.max_batch_size // num_return_sequences)
        out: list[Completion] = []
        if seed is not None:
            torch.manual_seed(seed)
        for start in range(0, len(texts), per_chunk):
            out.extend(self._generate_chunk(texts[start:start + per_chunk], max_new_tokens, greedy, temperature,
                                            top_p, list(stop), num_return_sequences, min_new_tokens))
        return out

    @torch.inference_mode()
    def generate_population(self, prompts: Sequence[Prompt], num_members: int, row_weights: RowWeights, *,
                            max_new_tokens: int, stop: Sequence[str] = (),
                            min_new_tokens: int | None = None) -> list[list[Completion]]:
        """RolloutEngine.generate_population: `row_weights` installs per-row forward hooks on the policy
        (e.g. esrl.es.modes.lowrank.PopulationPerturbation) while the one generate runs."""
        texts = render_prompts(self.tokenizer, prompts)
        n_prompts = len(texts)
        row_member = torch.arange(num_members).repeat_interleave(n_prompts)
        with row_weights(row_member):
            flat = self._generate_chunk(texts * num_members, max_new_tokens, True, 1.0, 1.0, list(stop), 1,
                                        min_new_tokens)
        return [flat[i * n_prompts:(i + 1) * n_prompts] for i in range(num_members)]

    def _static_kwargs(self) -> dict:
        """transformers' static KV cache with its compiled decode step (CUDA graphs on GPUs)."""
        if self._compile_config is None:
            from transformers import CompileConfig

            cuda = self.model.device.type == "cuda"
            self._compile_config = CompileConfig(fullgraph=False, dynamic=False,
                                                 mode="reduce-overhead" if cuda else "default")
            self._compile_config._compile_all_devices = True  # compile: on asks for it on a CPU too
            # One graph per (rows, prompt bucket) shape: evaluation, GRPO and ES populations need a few, more than
            # torch's default of 8 recompiles before it falls back to eager for good.
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            # A graph traced before forward hooks were added must not run without them (torch's default skips
            # hook guards): per-row hooks (ES populations) then trigger one recompile, never a silent no-op.
            torch._dynamo.config.skip_nnmodule_hook_guards = False
        return dict(cache_implementation="static", compile_config=self._compile_config)

    def _generate_chunk(self, texts, max_new_tokens, greedy, temperature, top_p, stop, n,
                        min_new_tokens=None) -> list[Completion]:
        tok = self.tokenizer
        compiled = self.compiled
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False,
                  pad_to_multiple_of=self.prompt_bucket if compiled else None).to(self.model.device)
        kwargs = dict(max_new_tokens=max_new_tokens, num_return_sequences=n, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id)
        if compiled:
            kwargs.update(self._static_kwargs())
            shape = (len(texts) * n, enc["input_ids"].shape[1], max_new_tokens)
            first = shape not in {s for s, _ in self.compile_log}
        if min_new_tokens:
            kwargs["min_new_tokens"] = min_new_tokens
        if greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        if stop:
            kwargs.update(stop_strings=stop, tokenizer=tok)
        was_training = self.model.training
        self.model.eval()
        start = time.perf_counter()
        try:
            with rollout_attention(self.model.device):
                seqs = self.model.generate(**enc, **kwargs)
        finally:
            self.model.train(was_training)
        if compiled and first:
            self.compile_log.append((shape, time.perf_counter() - start))
        new = seqs[:, enc["input_ids"].shape[1]:].tolist()
        return [self._completion(ids, stop, max_new_tokens) for ids in new]

    def _completion(self, ids: list[int], stop: Sequence[str], max_new_tokens: int) -> Completion:
        tok = self.tokenizer
        ended = False
        if tok.eos_token_id in ids:
            ids = ids[: ids.index(tok.eos_token_id) + 1]
            ended = True
        elif tok.pad_token_id is not None and tok.pad_token_id in ids:  # finished by a stop string
            ids = ids[: ids.index(tok.pad_token_id)]
        text = tok.decode(ids, skip_special_tokens=True)
        text, stopped = cut_at_stop(text, stop)
        return Completion(text=text, token_ids=ids, truncated=not (ended or stopped) and len(ids) >= max_new_tokens)
