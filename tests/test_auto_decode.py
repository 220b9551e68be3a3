"""`rollout.compile: auto` on a CPU: greedy calls without stop strings take the static decoder's step loop eagerly
(faster than generate there, benchmarks/RESULTS.md session 7), with generate's tokens, no prompt bucket, no fixed
chunk sizes and nothing logged as a compile; sampled calls and stop strings keep transformers' generate. lora
populations use the mode's static population (PEFT's adapter path off) on this engine too, with the eager hooks'
tokens. fp32 tiny Llama.
"""

from __future__ import annotations

import pytest
import torch

from esrl.rollout import HFEngine, render_prompts

pytestmark = pytest.mark.slow

PROMPTS = ["Hi", "Write a much longer sentence about the sea and the sky"]
NEW = 8


def _tokens(completions):
    return [c.token_ids for c in completions]


def test_auto_on_cpu_decodes_greedy_rows_statically_with_generates_tokens(tiny_model):
    from esrl.models import load_causal_lm, load_tokenizer

    tok, model = load_tokenizer(tiny_model), load_causal_lm(tiny_model)
    eager, auto = HFEngine(model, tok, compile="off"), HFEngine(model, tok, compile="auto")
    assert not auto.capabilities.static_shapes  # no chunk padding on a CPU
    want = _tokens(eager.generate(PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW))
    for rows in (PROMPTS, PROMPTS[:1]):  # a second shape replaces the first decoder (one kept off CUDA)
        assert _tokens(auto.generate(rows, max_new_tokens=NEW, min_new_tokens=NEW)) == want[:len(rows)]
    prompt = tok(render_prompts(tok, PROMPTS[:1]), add_special_tokens=False)["input_ids"][0]
    assert [k.prompt_len for k in auto._decoders] == [len(prompt)]  # not padded to a bucket
    assert auto.compile_times() == []
    calls = []
    auto._decoder = lambda *a, **k: calls.append(a)  # sampled rows and stop strings must not reach it
    auto.generate(PROMPTS, max_new_tokens=NEW, greedy=False, seed=0)
    auto.generate(PROMPTS, max_new_tokens=NEW, stop=["sea"])
    assert calls == []


def test_auto_lora_population_equals_eager_hooks(tiny_model):
    from esrl.es import get_mode, population
    from esrl.es.config import ESConfig
    from esrl.es.engines import InPlaceES
    from esrl.es.setup import build_policy, build_selection
    from esrl.models import load_causal_lm, load_tokenizer

    cfg = ESConfig(mode="lora", sigma=0.05, lora_rank=4, lora_alpha=8)
    tok, policy = load_tokenizer(tiny_model), build_policy(load_causal_lm(tiny_model), cfg, 0)
    with torch.no_grad():  # a trained-looking adapter (B = 0 would hide a dropped adapter term)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    selection, spec = build_selection(policy, cfg)
    mode, members = get_mode("lora"), population(2, 0, 5)
    eager, auto = HFEngine(policy, tok, compile="off"), HFEngine(policy, tok, compile="auto")
    backend = InPlaceES(auto, policy, selection, spec, mode)
    for chunk in (members[:3], members[3:]):  # chunk sizes differ: no padding on a CPU
        want = eager.generate_population(PROMPTS, len(chunk), lambda rows, c=chunk: mode.population(
            policy, selection, spec, c, rows), max_new_tokens=NEW, min_new_tokens=NEW)
        got = auto.generate_population(PROMPTS, len(chunk), backend.row_weights(chunk), max_new_tokens=NEW,
                                       min_new_tokens=NEW)
        assert [_tokens(m) for m in got] == [_tokens(m) for m in want]
    assert backend.static is not None
    base = _tokens(eager.generate(PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW))
    assert _tokens(auto.generate(PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW)) == base  # adapter back on
    backend.static.remove()
