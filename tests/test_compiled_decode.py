"""The compiled decode path (esrl.rollout.static_decode: a static KV cache and one decode step, recorded as a CUDA
graph on GPUs, run eagerly here on the CPU; `rollout.compile: on`): it must give the eager engine's tokens
(transformers' generate) for greedy decoding, min_new_tokens, early EOS and stop strings, repeat sampled draws for a
seed, reuse one decoder per shape, and carry an ES population's perturbation inside the recorded step.

fp32 tiny Llama, so both paths agree token for token; on the CPU a new shape costs no compile, only a fresh
StaticCache. On a GPU the recording itself is checked under `pytest -m gpu` (tests/test_gpu.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

from esrl.es import get_mode, population
from esrl.es.config import ESConfig
from esrl.es.setup import build_selection
from esrl.rollout import HFEngine
from esrl.rollout.hf import first_stop_prefix
from esrl.rollout.static_decode import grouped_decode_attention

pytestmark = pytest.mark.slow

PROMPTS = ["Hi", "Write a much longer sentence about the sea and the sky"]
NEW = 8


@pytest.fixture(scope="module")
def setup(tiny_model):
    from esrl.models import load_causal_lm, load_tokenizer

    tok, model = load_tokenizer(tiny_model), load_causal_lm(tiny_model)
    eager = HFEngine(model, tok, compile="off")
    compiled = HFEngine(model, tok, compile="on", prompt_bucket=16)
    return model, eager, compiled


def _tokens(completions):
    return [c.token_ids for c in completions]


def test_compiled_greedy_equals_eager_and_each_shape_is_made_once(setup):
    model, eager, compiled = setup
    assert compiled.capabilities.static_shapes and not eager.capabilities.static_shapes
    want = _tokens(eager.generate(PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW))
    for _ in range(2):
        assert _tokens(compiled.generate(PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW)) == want
    assert [shape for shape, _ in compiled.compile_times()] == [(2, 16, NEW)]  # padded to the 16-token bucket


def test_static_population_is_in_the_compiled_graph_and_refills_per_chunk(setup):
    """Two chunks through the compiled engine equal the eager per-chunk hooks token for token (the second chunk
    refills the same buffers); the members differ from each other; with the hooks off the base model returns."""
    from esrl.es.engines import InPlaceES

    model, eager, compiled = setup
    cfg = ESConfig(mode="lowrank", sigma=0.05, rank=2)
    selection, spec = build_selection(model, cfg)
    mode = get_mode("lowrank")
    backend = InPlaceES(compiled, model, selection, spec, mode)
    members = population(2, 0, 6)
    for chunk in (members[:3], members[3:]):
        want = eager.generate_population(
            PROMPTS, 3, lambda rm, c=chunk: mode.population(model, selection, spec, c, rm),
            max_new_tokens=NEW, min_new_tokens=NEW)
        got = compiled.generate_population(PROMPTS, 3, backend.row_weights(chunk), max_new_tokens=NEW,
                                           min_new_tokens=NEW)
        assert [_tokens(m) for m in got] == [_tokens(m) for m in want]
        assert len({tuple(m[-1].token_ids) for m in got}) > 1
    assert backend.static is not None and not backend.static.active
    base = _tokens(eager.generate(PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW))
    assert _tokens(compiled.generate(PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW)) == base
    with pytest.raises(ValueError, match="member-major"):
        with backend.row_weights(members[:3])(torch.tensor([0, 1, 2, 0, 1, 2])):
            pass
    backend.static.remove()
    assert all(p.grad is None for p in model.parameters()) and torch.is_grad_enabled()


def population_chunks_of_equal_rows(model, engine, device_eager=None):
    """4 members x 4 prompts, then 8 members x 2 prompts (an epoch's smaller last batch): 16 rows each, one shape.
    Each chunk's tokens from `engine` and from the eager per-chunk hooks, and the member counts of its decoders."""
    from esrl.es.engines import InPlaceES

    cfg = ESConfig(mode="lowrank", sigma=0.05, rank=2)
    selection, spec = build_selection(model, cfg)
    mode = get_mode("lowrank")
    backend = InPlaceES(engine, model, selection, spec, mode)
    eager = device_eager or HFEngine(model, engine.tokenizer, compile="off")
    prompts = ["Hi", "Tell me a story", "red dyes", "List prime numbers"]
    out = []
    for members, rows in ((population(2, 0, 4), prompts), (population(2, 1, 8), prompts[:2])):
        want = eager.generate_population(
            rows, len(members), lambda rm, c=members: mode.population(model, selection, spec, c, rm),
            max_new_tokens=NEW, min_new_tokens=NEW)
        got = engine.generate_population(rows, len(members), backend.row_weights(members), max_new_tokens=NEW,
                                         min_new_tokens=NEW)
        out.append(([_tokens(m) for m in got], [_tokens(m) for m in want]))
    backend.static.remove()
    return out, sorted(k.members for k in engine._decoders)


def test_chunks_of_other_member_counts_and_equal_rows_take_their_own_decoders(setup):
    """A recorded step reads the population's buffers made for its member count: one recorded for 4 members
    replayed for 8 applied the 4-member chunk's factors to other rows (on a GPU; eagerly, as here, nothing is
    recorded, so the decoders are counted)."""
    model, _, _ = setup
    chunks, counts = population_chunks_of_equal_rows(model, HFEngine(model, setup[1].tokenizer, compile="on",
                                                                     prompt_bucket=16))
    assert all(got == want for got, want in chunks) and counts == [4, 8]


# The tiny model repeats a prompt's last word; these prompts give rows whose tokens change at different steps:
# '?? dyes dyes ...', 'rlrlrl...', ' story story storyJDJD...', ' dyes dyes ...', ' numbers x4 then UNCT ...'.
MIXED = ["What is 2+2?", "Hi", "Tell me a story", "red dyes", "List prime numbers"]


def _pair(model, tok):
    return HFEngine(model, tok, compile="off"), HFEngine(model, tok, compile="on", prompt_bucket=16)


def test_min_new_tokens_and_rows_ending_at_different_steps_equal_eager(setup):
    """EOS is a token the eager run emits at different steps in different rows (never in some): rows end apart,
    later steps feed padding, and min_new_tokens holds EOS back, in both paths alike."""
    model, eager, _ = setup
    plain = _tokens(eager.generate(MIXED, max_new_tokens=NEW))
    first = {}
    for row in plain:
        for t in set(row):
            first.setdefault(t, set()).add(row.index(t))
    eos = next(t for t, steps in first.items() if len(steps) > 1)  # emitted first at two different steps
    tok = copy.deepcopy(eager.tokenizer)
    tok.eos_token_id = eos
    assert tok.eos_token_id == eos != tok.pad_token_id
    eager, static = _pair(model, tok)
    for min_new in (None, 3):
        want = eager.generate(MIXED, max_new_tokens=NEW, min_new_tokens=min_new)
        got = static.generate(MIXED, max_new_tokens=NEW, min_new_tokens=min_new)
        assert [(c.token_ids, c.truncated) for c in got] == [(c.token_ids, c.truncated) for c in want]
        ends = {len(c.token_ids) for c in want if c.token_ids[-1] == eos}
        assert ends and any(c.truncated for c in want)  # some rows end, some never do
        assert min(ends) > min_new if min_new else len(ends) > 1  # held back; else ended at different steps


@pytest.mark.parametrize("stop", ["JD", "UNC"])
def test_stop_strings_cut_where_generate_stops(setup, stop):
    """generate stops a row at its stop string and pads it with the pad token (EOS here); the static decoder decodes
    on and the engine cuts the ids: completions equal, and the stopped row is not marked ended or truncated."""
    _, eager, compiled = setup
    want = eager.generate(MIXED, max_new_tokens=NEW, stop=[stop])
    assert any(stop in c.text for c in want)
    got = compiled.generate(MIXED, max_new_tokens=NEW, stop=[stop])
    assert [(c.text, c.token_ids, c.truncated) for c in got] == [(c.text, c.token_ids, c.truncated) for c in want]
    stopped = [c for c in got if stop in c.text]
    assert stopped and all(c.text.endswith(stop) and not c.truncated for c in stopped)
    assert all(eager.tokenizer.eos_token_id not in c.token_ids for c in stopped)


def test_a_stop_string_begun_in_the_prompt_does_not_end_the_row(setup):
    """The tiny model answers 'Hello there, how' with ' how how ...': 'ow h' first spans the prompt's end and the
    first token. Both paths stop where the completion's own text holds it (transformers' stop_strings, which read
    the prompt too, ended generate's row after one token, marked neither stopped nor ended)."""
    _, eager, compiled = setup
    prompts, stop = ["Hello there, how", "Hi"], ["ow h"]
    want = eager.generate(prompts, max_new_tokens=NEW, stop=stop)
    assert want[0].text.endswith("ow h") and len(want[0].token_ids) > 1 and not want[0].truncated
    got = compiled.generate(prompts, max_new_tokens=NEW, stop=stop)
    assert [(c.text, c.token_ids, c.truncated) for c in got] == [(c.text, c.token_ids, c.truncated) for c in want]


def test_the_models_generation_config_changes_no_token(setup):
    """A checkpoint's repetition_penalty or no_repeat_ngram_size (Qwen2.5-Instruct ships one) would steer generate
    alone: the static decoder and vLLM apply none. The engine's generate calls set them neutral, min_new_tokens and
    stop_strings too (generate refused a checkpoint's stop_strings without a tokenizer)."""
    model, eager, compiled = setup
    plain = _tokens(compiled.generate(MIXED, max_new_tokens=NEW))
    config = model.generation_config
    saved = config.to_dict()
    try:
        config.repetition_penalty, config.no_repeat_ngram_size = 1.8, 2
        enc = eager.tokenizer(MIXED, return_tensors="pt", padding=True, add_special_tokens=False)
        steered = model.generate(**enc, max_new_tokens=NEW, do_sample=False)[:, enc["input_ids"].shape[1]:]
        assert [row[:len(p)] for row, p in zip(steered.tolist(), plain)] != plain  # generate alone would differ
        config.min_new_tokens, config.stop_strings = NEW, ["the"]
        assert _tokens(eager.generate(MIXED, max_new_tokens=NEW, stop=["\x00never"])) == plain
        assert _tokens(compiled.generate(MIXED, max_new_tokens=NEW)) == plain
    finally:
        config.update(**saved)


def test_sampled_return_sequences_repeat_for_a_seed(setup):
    _, eager, compiled = setup
    kw = dict(max_new_tokens=NEW, greedy=False, temperature=1.0, top_p=0.9, num_return_sequences=3)
    draws = [_tokens(compiled.generate(PROMPTS, seed=s, **kw)) for s in (5, 5, 6)]
    shape = [len(ids) for ids in _tokens(eager.generate(PROMPTS, seed=5, **kw))]
    assert len(draws[0]) == len(shape) == 6 and all(len(ids) == NEW for ids in draws[0])
    assert draws[0] == draws[1] and draws[0] != draws[2]
    assert len({tuple(ids) for ids in draws[0]}) > 1  # the three sequences of a prompt are separate draws


def test_first_stop_prefix(setup):
    tok = setup[1].tokenizer
    ids = tok(" story story storyJDJD end", add_special_tokens=False)["input_ids"]
    cut = first_stop_prefix(tok, ids, ["JD", "story"])
    assert tok.decode(cut).endswith("story") and tok.decode(cut[:-1]).find("story") < 0  # the shortest prefix
    assert len(cut) < len(ids) and ids[:len(cut)] == cut
    assert tok.decode(first_stop_prefix(tok, ids, ["JD"])) == " story story storyJD"
    assert first_stop_prefix(tok, ids, ["nowhere"]) == ids and first_stop_prefix(tok, [], ["JD"]) == []


class _Attention(torch.nn.Module):
    num_key_value_groups, is_causal, training = 3, True, False


def test_grouped_decode_attention_equals_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    rows, kv, groups, length, dim = 3, 2, 3, 7, 8
    key, value = torch.randn(rows, kv, length, dim), torch.randn(rows, kv, length, dim)
    mask = torch.ones(rows, 1, 1, length, dtype=torch.bool)
    mask[0, ..., :3] = False  # left padding
    mask[2, ..., 5:] = False  # static cache slots not written yet
    query = torch.randn(rows, kv * groups, 1, dim)
    module = _Attention()
    got, _ = grouped_decode_attention(module, query, key, value, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert got.shape == want.shape == (rows, 1, kv * groups, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    query = torch.randn(rows, kv * groups, 4, dim)  # prefill: several query tokens go to sdpa itself
    mask4 = mask.expand(rows, 1, 4, length).clone()
    got, _ = grouped_decode_attention(module, query, key, value, mask4, scaling=0.3)
    want, _ = sdpa_attention_forward(module, query, key, value, mask4, scaling=0.3)
    assert got.shape == (rows, 4, kv * groups, dim) and torch.equal(got, want)


def test_a_decoder_is_made_once_per_shape_and_anew_after_a_hook_change(setup):
    model, eager, _ = setup
    engine = HFEngine(model, eager.tokenizer, compile="on", prompt_bucket=16)
    want = _tokens(engine.generate(PROMPTS, max_new_tokens=NEW))
    assert _tokens(engine.generate(PROMPTS, max_new_tokens=NEW)) == want and len(engine._decoders) == 1
    engine.generate(["word " * 20], max_new_tokens=NEW)  # a longer prompt bucket: one more decoder
    assert [k.prompt_len for k in engine._decoders] == [16, 32]
    assert len(engine.compile_times()) == 2
    (before,) = {k.context for k in engine._decoders}
    handle = model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: None)
    try:
        assert _tokens(engine.generate(PROMPTS, max_new_tokens=NEW)) == want
        (key,) = engine._decoders  # the decoders recorded without the hook are dropped
        assert key.context != before and key.prompt_len == 16
    finally:
        handle.remove()
    engine.generate(PROMPTS, max_new_tokens=NEW)
    assert [k.context for k in engine._decoders] == [before] and len(engine.compile_times()) == 4


@pytest.mark.parametrize("inside", [False, True], ids=["kernel", "inside"])
def test_fused_step_gives_the_static_steps_tokens_with_and_without_a_population(setup, monkeypatch, inside):
    """compile: fused runs the same step through torch.compile (Inductor's C++ kernels here, Triton on a GPU): greedy
    tokens equal the unfused static path's, for the base model and for a lowrank population read from its buffers
    (q, k and v adding their terms in one call after v_proj, as on a GPU; the traced step takes the path an eager step
    takes, on a CPU the torch ops; inside: the static step adds the MLPs' terms inside their GEMMs, esrl.es.inside_terms,
    and the fused one the torch ops still); one compile per decoder, reused by the next call."""
    from esrl.es.engines import InPlaceES
    from esrl.es.static_population import StaticPopulation
    from esrl.rollout.hf import HFEngine as Engine

    monkeypatch.setattr(StaticPopulation, "share_launches", True)
    monkeypatch.setattr(StaticPopulation, "terms_inside", inside)

    model, _, compiled = setup
    fused = Engine(model, compiled.tokenizer, compile="fused", prompt_bucket=16)
    assert fused.capabilities.static_shapes
    # the base rows as many as the population's (2 prompts x 3 members) below: Dynamo keeps one cache per code
    # object, shared by every decoder, and once reused this shape's hookless step for the population
    want = _tokens(compiled.generate(PROMPTS * 3, max_new_tokens=NEW, min_new_tokens=NEW))
    for _ in range(2):
        assert _tokens(fused.generate(PROMPTS * 3, max_new_tokens=NEW, min_new_tokens=NEW)) == want
    cfg = ESConfig(mode="lowrank", sigma=0.05, rank=2)
    selection, spec = build_selection(model, cfg)
    mode, members = get_mode("lowrank"), population(4, 0, 3)
    results = []
    torch._dynamo.utils.counters.clear()
    for engine in (compiled, fused):
        backend = InPlaceES(engine, model, selection, spec, mode)
        results.append([_tokens(m) for m in engine.generate_population(
            PROMPTS, 3, backend.row_weights(members), max_new_tokens=NEW, min_new_tokens=NEW)])
        assert not torch._dynamo.utils.counters["graph_break"]  # the fused step is one graph, hooks and all
        assert len(backend.static.runs) == 2 * model.config.num_hidden_layers  # q/k/v and gate/up, a layer
        assert len(backend.static._inside) == (model.config.num_hidden_layers if inside else 0)
        backend.static.remove()
    assert results[0] == results[1] and len({tuple(m[-1]) for m in results[1]}) > 1
    assert len(fused.compile_times()) == 2  # the base shape once, the population's once


def test_prefill_head_is_one_gemm_when_the_weights_are_frozen(setup):
    """ES freezes the policy's weights (no grad). The prefill's lm_head then still gets a contiguous (rows, 1, hidden)
    input, which torch.matmul folds into one matrix product; a strided slice of the prompts' last positions it would
    run as a batched product over a per-row expansion of the head (7x slower on the 2-core CPU, RESULTS session 12).
    Same tokens as eager."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model, eager, _ = setup
    frozen = copy.deepcopy(model).requires_grad_(False)
    head = frozen.get_output_embeddings().weight
    inputs = []

    class HeadInputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.linear.default and args[1] is head:
                inputs.append(args[0])
            return func(*args, **(kwargs or {}))

    engine = HFEngine(frozen, eager.tokenizer, compile="auto")  # the static step loop, eagerly, on a CPU
    with HeadInputs():
        got = _tokens(engine.generate(PROMPTS * 3, max_new_tokens=NEW, min_new_tokens=NEW))
    assert got == _tokens(eager.generate(PROMPTS * 3, max_new_tokens=NEW, min_new_tokens=NEW))
    assert [(tuple(x.shape), x.is_contiguous()) for x in inputs] == [((6, 1, head.shape[1]), True)] * NEW
