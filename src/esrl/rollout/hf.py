"""Batched generation with transformers: left padding, greedy or sampled, stop strings."""

from __future__ import annotations

from typing import Sequence

import torch

from esrl.rollout.base import Completion, EngineCapabilities, RolloutEngine, RowWeights
from esrl.rollout.text import cut_at_stop, render_prompts
from esrl.tasks.base import Prompt


class HFEngine(RolloutEngine):
    """Generates with the policy module itself, so in-place weight changes (ES) take effect at once."""

    capabilities = EngineCapabilities(shares_policy_weights=True, row_adapters=False, sleeps=False)

    def __init__(self, model, tokenizer, max_batch_size: int = 64):
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size

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

    def _generate_chunk(self, texts, max_new_tokens, greedy, temperature, top_p, stop, n,
                        min_new_tokens=None) -> list[Completion]:
        tok = self.tokenizer
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.model.device)
        kwargs = dict(max_new_tokens=max_new_tokens, num_return_sequences=n, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id)
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
        try:
            seqs = self.model.generate(**enc, **kwargs)
        finally:
            self.model.train(was_training)
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
