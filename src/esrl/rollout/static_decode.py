"""Static-cache decoding with one recorded decode step: the compiled path of the HF engine.

transformers' generate runs its Python (model, ~15 calls per layer, logits processors, stopping criteria) for every
token and waits for the GPU after each one, so decoding a 1.5B model is launch-bound: the GPU idled ~75% of a
profiled ES rollout (issue 15). Here a generation shape (rows, padded prompt length, new tokens, sampling kind) gets
its own transformers StaticCache and state buffers. The prompt is prefilled by the model's own forward; one decode
step (forward of the last token, EOS and min-length masking, the next-token choice, position and mask advance) is
recorded once as a CUDA graph and then replayed per token: no Python per layer, no host sync except a finished-check
every `check_every` tokens. Forward hooks present when the step is recorded (an ES population reading persistent
buffers, esrl.es.static_population) are part of the graph; a change of hooks or parameter storage records anew.
Without CUDA the same step runs eagerly: the CPU tests check it token for token against transformers' generate.

With `fuse` (rollout.compile: fused) the step goes through torch.compile first: Inductor fuses the ~1,400 small
kernels a 1.5B model's step launches (norms, rotary, casts, the ES terms' torch ops) into fewer, and the recording
replays the fused ones. It costs one compile per decoder (shape), at its first call.
"""

from __future__ import annotations

import inspect
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DecodeKey:
    """What a recorded step depends on: shapes, sampling kind, and the identity of hooks and weights it read."""

    rows: int
    prompt_len: int
    new_tokens: int
    sampled: bool
    top_p: bool
    members: int
    """An ES population's member count (0: none): its hooks read buffers made per count (esrl.es.static_population),
    and a chunk of 4 members x 4 prompts has the rows of 8 x 2 (a smaller last batch of an epoch)."""
    context: tuple


def supports_static_decode(model) -> bool:
    """Full-attention sdpa decoder models only: the step passes one 4D boolean padding mask, which transformers
    hands to the attention as is (eager attention would add it as a float bias, flash attention rejects it).
    Not under DeepSpeed ZeRO-3: its hooks gather each layer's partitioned weights into fresh storage per forward,
    which a recorded graph cannot follow (generate then runs eagerly, as transformers does there)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types = getattr(config, "layer_types", None) or []
    zero3 = any(hasattr(p, "ds_id") for p in model.parameters())
    return (model.config._attn_implementation == "sdpa" and all(t == "full_attention" for t in types)
            and not getattr(config, "use_sliding_window", False) and not zero3)


def module_context(model) -> tuple:
    """Identity of what a recorded graph bakes in: every forward hook and every parameter's storage."""
    hooks = tuple((id(m), tuple(m._forward_hooks), tuple(m._forward_pre_hooks)) for m in model.modules()
                  if m._forward_hooks or m._forward_pre_hooks)
    return hooks, tuple(p.data_ptr() for p in model.parameters())


GROUPED_DECODE = "esrl_grouped_decode"


def grouped_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                             **kwargs):
    """SDPA for one query token per row without copying K and V per query head: each KV group's query heads are
    folded into the query length. transformers' sdpa path repeats K and V per query head whenever a mask is given
    (repeat_kv): with a static cache that copy was 55% of a 1.5B model's decode step on an H100, and reading it back
    another 27%. A transformers AttentionInterface function; anything but a single-token query goes to sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows, heads, q_len, dim = query.shape
    groups = heads // key.shape[1]
    if q_len != 1 or groups == 1 or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    folded = query.reshape(rows, key.shape[1], groups, dim)  # one query "position" per head of the group
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(rows, 1, heads, dim), None


@contextmanager
def decode_attention(model) -> Iterator[None]:
    """The grouped decode attention while a StaticDecoder steps (prefill keeps the model's own); sdpa models only."""
    from transformers import AttentionInterface

    before = model.config._attn_implementation
    if before != "sdpa":
        yield
        return
    AttentionInterface.register(GROUPED_DECODE, grouped_decode_attention)
    model.set_attn_implementation(GROUPED_DECODE)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


class StaticDecoder:
    """Decodes batches of one shape: prefill with the model's forward, then a recorded step per token."""

    def __init__(self, model, key: DecodeKey, *, eos_token_ids: list[int], pad_token_id: int,
                 attention: Callable, check_every: int = 32, fuse: bool = False):
        from transformers import StaticCache

        self.model, self.key, self.attention, self.check_every = model, key, attention, check_every
        # dynamic=False: this decoder's shapes only (shared with other decoders' compiles: see generate)
        self.step = torch.compile(self._step, dynamic=False) if fuse else self._step
        device = model.device
        self.graphs = device.type == "cuda"
        length = key.prompt_len + key.new_tokens
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        self.pass_cache_position = "cache_position" in inspect.signature(model.forward).parameters
        long = dict(dtype=torch.long, device=device)
        self.eos = torch.tensor(eos_token_ids, **long)
        self.pad = pad_token_id
        self.mask = torch.zeros(key.rows, 1, 1, length, dtype=torch.bool, device=device)
        self.tokens = torch.full((key.rows, key.new_tokens), pad_token_id, **long)
        self.last = torch.zeros(key.rows, 1, **long)  # the token fed to the next step
        self.position = torch.zeros(key.rows, 1, **long)
        self.slot = torch.zeros(1, **long)  # cache slot of the token fed to the next step
        # the prompt's last position as an index tensor: transformers then gathers a contiguous (rows, 1, hidden) for
        # lm_head. `logits_to_keep=1` slices a strided view instead, which torch.matmul cannot fold into one GEMM
        # when the head's weight needs no grad (ES freezes it): it expands the weight per row (0.29 s vs 0.04 s per
        # prefill of 60 rows on the 2-core CPU, SmolLM2's 49k vocabulary; RESULTS, session 12)
        self.prompt_end = torch.tensor([key.prompt_len - 1], **long)
        self.step_index = torch.zeros(1, **long)  # which new token the next step chooses
        self.finished = torch.zeros(key.rows, dtype=torch.bool, device=device)
        self.min_new = torch.zeros((), **long)
        self.temperature = torch.ones((), dtype=torch.float32, device=device)
        self.top_p = torch.ones((), dtype=torch.float32, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.record_seconds: float | None = None
        self.calls = 0  # generates run so far: the engine logs the first call of each decoder

    # -- one token ----------------------------------------------------------------------------------------------
    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token from fp32 logits, as transformers' greedy/sampling with min_new_tokens and top_p."""
        eos_logits = logits.index_select(1, self.eos)
        blocked = (self.step_index < self.min_new).expand_as(eos_logits)
        logits = logits.index_copy(1, self.eos, torch.where(blocked, float("-inf"), eos_logits))
        if not self.key.sampled:
            return logits.argmax(-1)
        scores = logits / self.temperature
        if self.key.top_p:  # transformers' TopPLogitsWarper: drop the low tail holding 1 - top_p, keep >= 1 token
            ordered, order = scores.sort(descending=False)
            tail = ordered.softmax(-1).cumsum(-1) <= (1 - self.top_p)
            tail[:, -1] = False
            scores = scores.masked_fill(tail.scatter(1, order, tail), float("-inf"))
        probs = scores.softmax(-1)
        return (probs / torch.empty_like(probs).exponential_()).argmax(-1)  # a draw from probs, graph-safe

    def _forward(self, **inputs) -> torch.Tensor:
        if self.pass_cache_position:
            inputs["cache_position"] = self.slot
        return self.model(**inputs, past_key_values=self.cache, use_cache=True).logits[:, -1, :].float()

    def _advance(self, logits: torch.Tensor) -> None:
        token = torch.where(self.finished, self.pad, self._choose(logits))
        self.tokens.index_copy_(1, self.step_index, token[:, None])
        self.finished |= torch.isin(token, self.eos)
        self.last.copy_(token[:, None])
        self.step_index += 1

    def _step(self) -> None:
        self.mask.index_fill_(3, self.slot, True)
        logits = self._forward(input_ids=self.last, position_ids=self.position, attention_mask=self.mask)
        self._advance(logits)
        self.position += 1
        self.slot += 1

    # -- one batch ----------------------------------------------------------------------------------------------
    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        self.cache.reset()
        p = self.key.prompt_len
        position = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position)
        if self.pass_cache_position:
            inputs["cache_position"] = torch.arange(p, device=input_ids.device)
        logits = self.model(**inputs, past_key_values=self.cache, use_cache=True,
                            logits_to_keep=self.prompt_end).logits
        self.mask.zero_()
        self.mask[:, 0, 0, :p] = attention_mask.bool()
        self.tokens.fill_(self.pad)
        self.finished.zero_()
        self.step_index.zero_()
        self._advance(logits[:, -1, :].float())
        self.position.copy_(position[:, -1:] + 1)
        self.slot.fill_(p)

    def _record(self) -> None:
        """Run one step eagerly on a side stream (warm-up: handles, workspaces), then record the next one."""
        start = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step()
        self.graph = graph
        self.record_seconds = time.perf_counter() - start

    @torch.inference_mode()
    # fused: Dynamo keeps one cache per code object, so every decoder's compiled `_step` is a candidate for every
    # other's call, told apart by guards: one compile per decoder of the run (not 8 at most), and guards on the
    # model's hooks too (off by default), or a population decode would reuse a hookless step of its shape
    @torch._dynamo.config.patch(recompile_limit=64, skip_nnmodule_hook_guards=False)
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float = 1.0,
                 top_p: float = 1.0, min_new_tokens: int = 0) -> torch.Tensor:
        """(rows, new_tokens) token ids, pad after EOS; a fresh generation on the same buffers every call."""
        self.temperature.fill_(temperature)
        self.top_p.fill_(top_p)
        self.min_new.fill_(min_new_tokens)
        self.calls += 1
        with self.attention(self.model.device):
            self._prefill(input_ids, attention_mask)  # the model's own attention and mask preparation
            done = 1
            with decode_attention(self.model):  # read when a step is recorded or run eagerly
                if self.graphs and self.graph is None and done < self.key.new_tokens:
                    self._record()  # its warm-up step is a real step
                    done += 1
                step = self.step if self.graph is None else self.graph.replay
                while done < self.key.new_tokens:
                    step()
                    done += 1
                    if done % self.check_every == 0 and bool(self.finished.all()):
                        break
        return self.tokens.clone()
