"""Batched generation with transformers: left padding, greedy or sampled, stop strings, an optional compiled
decode path (a static KV cache and one decode step recorded as a CUDA graph on GPUs, where eager decoding is
launch-bound; rollout/static_decode.py). With compile: auto on a CPU, greedy calls run that step loop eagerly."""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from esrl.rollout.base import Completion, EngineCapabilities, RolloutEngine, RowWeights
from esrl.rollout.static_decode import DecodeKey, StaticDecoder, module_context, supports_static_decode
from esrl.rollout.text import check_context, cut_at_stop, encode_prompts, left_padded
from esrl.tasks.base import Prompt


# cuDNN's fused attention, PyTorch's first choice for padded batches on Hopper, is not bitwise repeatable at some
# KV lengths (measured on an H100: two identical generates differ from ~130 tokens on); mem-efficient attention is,
# and is faster for rollout shapes (0.88x the floor). Compiled decoding fixes its kernel when traced, so this is in
# force then too. benchmarks/gpu/NOTES_issue15.md has the measurements.
ROLLOUT_ATTENTION = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def rollout_attention(device: torch.device):
    """The attention kernels rollouts may use on `device`: repeatable ones (no cuDNN) on CUDA."""
    return sdpa_kernel(ROLLOUT_ATTENTION) if device.type == "cuda" else nullcontext()


# generate takes from the model's generation_config whatever a call leaves unset: a checkpoint's repetition_penalty
# (Qwen2.5-Instruct declares 1.05-1.1), no_repeat_ngram_size, min_p, num_beams, min_new_tokens, stop_strings... The
# static decoder and vLLM apply none of them, and GRPO's log-probs assume plain sampling, so every call sets them
# neutral (those this transformers knows).
NEUTRAL_GENERATION = {key: value for key, value in dict(
    num_beams=1, num_beam_groups=1, diversity_penalty=0.0, repetition_penalty=1.0, encoder_repetition_penalty=1.0,
    no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
    min_p=None, top_h=None, min_length=0, min_new_tokens=None, stop_strings=None, bad_words_ids=None,
    sequence_bias=None, suppress_tokens=None, begin_suppress_tokens=None, forced_bos_token_id=None,
    forced_eos_token_id=None, guidance_scale=None, exponential_decay_length_penalty=None, renormalize_logits=False,
    remove_invalid_values=False, watermarking_config=None, penalty_alpha=None, dola_layers=None,
    prompt_lookup_num_tokens=None, max_time=None,
).items() if hasattr(GenerationConfig(), key)}


class CompletionStops(StoppingCriteria):
    """Ends a row once its completion's text holds a stop string. transformers' own stop_strings match the whole
    sequence, so a string begun in the prompt (a template's trailing newline, stop "\n\n") ended rows after their
    first token, which the static decoder and vLLM, reading the completion alone, do not. Each step decodes the
    last few tokens (a string of L characters ends within the last L), the whole completion only where they hold
    one; one missed there (a decode's cleanup at the window's start) costs steps, not tokens: _completion cuts."""

    def __init__(self, tokenizer, stop: Sequence[str], prompt_len: int):
        self.tokenizer, self.stop, self.prompt_len = tokenizer, list(stop), prompt_len
        self.window = max(map(len, self.stop)) + 2

    def _holds_stop(self, ids: torch.Tensor) -> bool:
        return any(s in self.tokenizer.decode(ids, skip_special_tokens=True) for s in self.stop)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        new = input_ids[:, self.prompt_len:]
        tails = self.tokenizer.batch_decode(new[:, -self.window:], skip_special_tokens=True)
        return torch.tensor([any(s in tail for s in self.stop) and self._holds_stop(row)
                             for tail, row in zip(tails, new)], device=input_ids.device)


class HFEngine(RolloutEngine):
    """Generates with the policy module itself, so in-place weight changes (ES) take effect at once."""

    def __init__(self, model, tokenizer, max_batch_size: int = 64, compile: str = "off", prompt_bucket: int = 64):
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.compile = compile
        self.prompt_bucket = prompt_bucket
        self.compile_log: list[tuple[tuple[int, int, int], float]] = []
        """((rows, padded prompt tokens, new tokens), seconds of the first call) of every static decoder made
        (its CUDA graph recording included on GPUs); a decoder made anew after a hook or weight change logs again."""
        self.max_shapes = 4
        self._decoders: dict[DecodeKey, StaticDecoder] = {}  # the recorded decode steps, least recently used first
        self.eos_token_ids = end_token_ids(model, tokenizer)

    def compile_times(self) -> list[tuple[tuple[int, int, int], float]]:
        return list(self.compile_log)

    @property
    def compiled(self) -> bool:
        """Whether generate takes the compiled static-cache path (decided where the policy is now: Lightning
        moves it to its device after the engine is built)."""
        return self.compile in ("on", "fused") or (self.compile == "auto" and self.model.device.type == "cuda")

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(shares_policy_weights=True, row_adapters=False, sleeps=False,
                                  static_shapes=self.compiled)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Prompt], *, max_new_tokens: int, greedy: bool = True,
                 temperature: float = 1.0, top_p: float = 1.0, stop: Sequence[str] = (),
                 num_return_sequences: int = 1, seed: int | None = None,
                 min_new_tokens: int | None = None) -> list[Completion]:
        ids = self._encoded(prompts, max_new_tokens)
        per_chunk = max(1, self.max_batch_size // num_return_sequences)
        out: list[Completion] = []
        if seed is not None:
            torch.manual_seed(seed)
        for start in range(0, len(ids), per_chunk):
            out.extend(self._generate_chunk(ids[start:start + per_chunk], max_new_tokens, greedy, temperature,
                                            top_p, list(stop), num_return_sequences, min_new_tokens))
        return out

    @torch.inference_mode()
    def generate_population(self, prompts: Sequence[Prompt], num_members: int, row_weights: RowWeights, *,
                            max_new_tokens: int, stop: Sequence[str] = (),
                            min_new_tokens: int | None = None) -> list[list[Completion]]:
        """RolloutEngine.generate_population: `row_weights` installs per-row forward hooks on the policy
        (e.g. esrl.es.modes.lowrank.PopulationPerturbation) while the one generate runs."""
        ids = self._encoded(prompts, max_new_tokens)
        n_prompts = len(ids)
        row_member = torch.arange(num_members).repeat_interleave(n_prompts)
        with row_weights(row_member):
            flat = self._generate_chunk(ids * num_members, max_new_tokens, True, 1.0, 1.0, list(stop), 1,
                                        min_new_tokens, members=num_members)
        return [flat[i * n_prompts:(i + 1) * n_prompts] for i in range(num_members)]

    def _encoded(self, prompts: Sequence[Prompt], max_new_tokens: int) -> list[list[int]]:
        """The prompts' token ids, each checked to leave room for max_new_tokens in the model's context."""
        ids = encode_prompts(self.tokenizer, prompts)
        check_context([len(row) for row in ids], max_new_tokens,
                      getattr(self.model.config, "max_position_embeddings", None), prompts)
        return ids

    def _decoder(self, rows: int, prompt_len: int, new_tokens: int, greedy: bool, top_p: float,
                 members: int) -> StaticDecoder:
        """The StaticDecoder of this shape and sampling kind, recorded anew if hooks or weight storage changed
        (a population's hooks act only inside generate_population, so its steps are recorded apart)."""
        recorded = self.compiled  # else eager steps: nothing baked in, one decoder (its cache) kept at a time
        context = module_context(self.model) if recorded else ("eager", self.model.device, self.model.dtype)
        key = DecodeKey(rows, prompt_len, new_tokens, not greedy, not greedy and top_p < 1.0,
                        members if recorded else 0, context)
        decoder = self._decoders.pop(key, None)
        if decoder is None:
            stale = [k for k in self._decoders if k.context != key.context]
            for k in stale:  # their graphs read hooks or weights that are gone
                del self._decoders[k]
            while len(self._decoders) >= (self.max_shapes if recorded else 1):
                del self._decoders[next(iter(self._decoders))]  # least recently used
            decoder = StaticDecoder(self.model, key, eos_token_ids=self.eos_token_ids,
                                    pad_token_id=self.tokenizer.pad_token_id,
                                    attention=rollout_attention, fuse=self.compile == "fused")
        self._decoders[key] = decoder
        return decoder

    def _generate_chunk(self, prompt_ids, max_new_tokens, greedy, temperature, top_p, stop, n,
                        min_new_tokens=None, members=0) -> list[Completion]:
        tok = self.tokenizer
        supported = supports_static_decode(self.model)
        compiled = self.compiled and supported
        # compile: auto off CUDA: greedy rows without stop strings still take the static step loop, eagerly (no
        # graph, no prompt bucket, no fixed chunk sizes): on a 2-core CPU 0.75x generate's time for ES's rows (no
        # DynamicCache concatenation, no repeat_kv copies, no logits processors; RESULTS.md session 7), the same
        # tokens. Sampled rows keep generate and its random stream; stop strings keep its early end.
        static = compiled or (supported and self.compile == "auto" and greedy and not stop)
        enc = left_padded(tok, prompt_ids, self.prompt_bucket if compiled else None).to(self.model.device)
        was_training = self.model.training
        self.model.eval()
        start = time.perf_counter()
        try:
            if static:
                ids, mask = enc["input_ids"], enc["attention_mask"]
                if n > 1:
                    ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
                shape = (ids.shape[0], ids.shape[1], max_new_tokens)
                decoder = self._decoder(*shape, greedy, top_p, members)
                first = decoder.calls == 0
                new = decoder.generate(ids, mask, temperature=temperature, top_p=top_p,
                                       min_new_tokens=min_new_tokens or 0).tolist()
                if first and compiled:
                    self.compile_log.append((shape, time.perf_counter() - start))
            else:
                new = self._hf_generate(enc, max_new_tokens, greedy, temperature, top_p, stop, n, min_new_tokens)
        finally:
            self.model.train(was_training)
        return [self._completion(ids, stop, max_new_tokens) for ids in new]

    def _hf_generate(self, enc, max_new_tokens, greedy, temperature, top_p, stop, n, min_new_tokens) -> list:
        tok = self.tokenizer
        kwargs = dict(NEUTRAL_GENERATION, max_new_tokens=max_new_tokens, num_return_sequences=n,
                      pad_token_id=tok.pad_token_id, eos_token_id=self.eos_token_ids)
        if min_new_tokens:
            kwargs["min_new_tokens"] = min_new_tokens
        if greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        if stop:
            kwargs["stopping_criteria"] = StoppingCriteriaList([CompletionStops(tok, stop, enc["input_ids"].shape[1])])
        with rollout_attention(self.model.device):
            seqs = self.model.generate(**enc, **kwargs)
        return seqs[:, enc["input_ids"].shape[1]:].tolist()

    def _completion(self, ids: list[int], stop: Sequence[str], max_new_tokens: int) -> Completion:
        """One row's completion, the same from both paths: generate pads a row after its stop string (with EOS
        when pad is EOS), the static decoder keeps decoding it, so a stop string before the first EOS wins."""
        tok = self.tokenizer
        end = next((i for i, t in enumerate(ids) if t in self.eos_token_ids), None)
        ended = end is not None
        if ended:
            ids = ids[:end + 1]
        elif tok.pad_token_id is not None and tok.pad_token_id in ids:  # generate ended it by a stop string
            ids = ids[: ids.index(tok.pad_token_id)]
        if stop:
            cut = first_stop_prefix(tok, ids[:-1] if ended else ids, stop)
            if any(s in tok.decode(cut, skip_special_tokens=True) for s in stop):
                ids, ended = cut, False
        text = tok.decode(ids, skip_special_tokens=True)
        text, stopped = cut_at_stop(text, stop)
        return Completion(text=text, token_ids=ids, truncated=not (ended or stopped) and len(ids) >= max_new_tokens)


def end_token_ids(model, tokenizer) -> list[int]:
    """The tokens that end a completion: the tokenizer's EOS and every one the model's generation config declares
    (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>), as TRL's GRPOTrainer and vLLM stop on."""
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    declared = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    return list(dict.fromkeys([tokenizer.eos_token_id, *declared]))


def first_stop_prefix(tokenizer, ids: list[int], stop: Sequence[str]) -> list[int]:
    """The shortest prefix of `ids` whose text holds a stop string (all of `ids` if none does): where
    CompletionStops ended generate's row. The static decoder keeps decoding such rows, so their ids are cut here."""
    def stops(k: int) -> bool:
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        return any(s in text for s in stop)

    if not ids or not stops(len(ids)):
        return ids
    lo, hi = 1, len(ids)  # stops(hi) holds; text only grows with k
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if stops(mid) else (mid + 1, hi)
    return ids[:hi]
