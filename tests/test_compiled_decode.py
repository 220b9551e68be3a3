"""The compiled decode path (static KV cache + torch.compile), run on the CPU (`rollout.compile: on`): it must give
the eager engine's greedy tokens, and ES populations must carry their perturbation inside the compiled graph.

fp32 tiny Llama, so compiled and eager agree token for token. Each new (rows, prompt bucket) shape costs a compile
(~40 s on 2 cores), so the module keeps to three shapes. On a GPU the same checks run under `pytest -m gpu`
(tests/test_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from esrl.es import get_mode, population
from esrl.es.config import ESConfig
from esrl.es.setup import build_selection
from esrl.rollout import HFEngine

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


def test_compiled_greedy_equals_eager_and_each_shape_compiles_once(setup):
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
