"""ES populations on the static decoder (`rollout.compile: on`, run eagerly on the CPU): a chunk through the mode's
StaticPopulation (hooks installed once, buffers refilled per chunk; lora: PEFT's adapter path switched off and the
member adapter added on the base Linear, esrl.es.lowrank_kernel's torch path here; q, k and v add their terms in one
call after v_proj, gate and up after up_proj, as on a GPU) gives the eager engine's per-chunk hooks token for token,
members differ, and afterwards plain generation is the policy's own (adapter back on, the adapter's requires_grad
flags unchanged).
fp32 tiny Llama. On a GPU the same kernel runs as Triton: tests/test_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

PROMPTS = ["Hi", "Write a much longer sentence about the sea and the sky"]
NEW = 8


@pytest.mark.parametrize("variant", ["kernel", "inside", "overlap"])
@pytest.mark.parametrize("mode_name,fields", [("lowrank", dict(rank=1)), ("lowrank", dict(rank=2)),
                                              ("lora", dict(lora_rank=4, lora_alpha=8))])
def test_static_population_equals_eager_hooks(tiny_model, mode_name, fields, variant, monkeypatch):
    """inside: the MLPs' terms inside their GEMMs at each decode step (esrl.es.inside_terms; the prefill and a chunk
    of another size, the last here, on the hooks' path). overlap: a decode step's inputs marked by pre-hooks, the terms
    written after the run's last GEMM into buffers, one per kind of linear, place in its run and row count, shared by
    the layers, then added (esrl.es.side_terms; on a GPU on a side stream beside the GEMMs)."""
    from esrl.es import get_mode, population
    from esrl.es.config import ESConfig
    from esrl.es.engines import InPlaceES
    from esrl.es.setup import build_policy, build_selection
    from esrl.models import load_causal_lm, load_tokenizer
    from esrl.es.static_population import StaticPopulation
    from esrl.rollout import HFEngine

    monkeypatch.setattr(StaticPopulation, "share_launches", True)  # q, k and v in one call, as on a GPU
    inside = variant == "inside"
    monkeypatch.setattr(StaticPopulation, "terms_inside", inside)
    monkeypatch.setattr(StaticPopulation, "overlap", variant == "overlap")
    cfg = ESConfig(mode=mode_name, sigma=0.05, **fields)
    tok, policy = load_tokenizer(tiny_model), load_causal_lm(tiny_model)
    if mode_name == "lora":
        policy = build_policy(policy, cfg, 0)
        with torch.no_grad():  # a trained-looking adapter (B = 0 at init would hide a dropped adapter term)
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    selection, spec = build_selection(policy, cfg)
    grads = {n: p.requires_grad for n, p in policy.named_parameters()}
    mode = get_mode(mode_name)
    eager, static = HFEngine(policy, tok, compile="off"), HFEngine(policy, tok, compile="on", prompt_bucket=16)
    backend = InPlaceES(static, policy, selection, spec, mode)
    members = population(2, 0, 6)
    for i, chunk in enumerate((members[:3], members[3:], members[1:3])):
        hooks = lambda rows, c=chunk: mode.population(policy, selection, spec, c, rows)
        want = eager.generate_population(PROMPTS, len(chunk), hooks, max_new_tokens=NEW, min_new_tokens=NEW)
        got = static.generate_population(PROMPTS, len(chunk), backend.row_weights(chunk), max_new_tokens=NEW,
                                         min_new_tokens=NEW)
        assert [[c.token_ids for c in m] for m in got] == [[c.token_ids for c in m] for m in want]
        assert len({tuple(m[1].token_ids) for m in got}) > 1
        # inside: a decode step's buffers made (one token a row, 3 members x 2 prompts) and the short chunk left out
        assert [(list(x._inputs), x.members) for x in backend.static._inside] == (
            [([(6, True)], 3 if i < 2 else 0)] * policy.config.num_hidden_layers if inside else [])
        if variant == "overlap":  # q/k/v, o, gate/up, down: 7 buffers a row count (6 rows, then 4), none pending
            rows = sorted(slot[2] for slot in backend.static._side._terms)
            assert rows == ([6] * 7 if i < 2 else [4] * 7 + [6] * 7) and not backend.static._side._ready
        if i == 0:  # q, k and v of each layer take their terms in one call, after v_proj, and gate and up after
            # up_proj (its MLP's up_proj called before act_fn: esrl.es.shared_inputs)
            last = [run[-1].removesuffix(".weight").rsplit(".", 1)[-1] for run in backend.static.runs]
            assert sorted(last) == sorted(["v_proj", "up_proj"] * policy.config.num_hidden_layers)
            assert len(backend.static._inside) == (policy.config.num_hidden_layers if inside else 0)
            with torch.no_grad():  # the weights move between chunks (lowrank's update): the next load follows
                for name, p in policy.named_parameters():
                    if "mlp" in name and "lora" not in name:
                        p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)), alpha=0.05)
    base = [c.token_ids for c in eager.generate(PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW)]
    assert [c.token_ids for c in static.generate(PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW)] == base
    assert {n: p.requires_grad for n, p in policy.named_parameters()} == grads
    backend.static.remove()
    assert not any("forward" in vars(m) for m in policy.modules())  # the MLPs' own forward back


def test_zero3_partitioned_weights_decode_with_generate(tiny_model):
    """DeepSpeed ZeRO-3 marks its partitioned parameters (ds_id) and gathers them per forward: the static decoder
    cannot record that, so the engine falls back to transformers' generate (a stand-in attribute here: DeepSpeed
    itself needs a GPU)."""
    from esrl.models import load_causal_lm
    from esrl.rollout.static_decode import supports_static_decode

    model = load_causal_lm(tiny_model)
    assert supports_static_decode(model)
    next(model.parameters()).ds_id = 0
    assert not supports_static_decode(model)


def test_lora_buffers_refilled_in_place_hold_each_members_adapter(tiny_model):
    """StaticLora writes each member's adapter straight into its persistent buffers (esrl.es.modes.lora
    write_member_adapters): after a refill, same addresses, and every slot is the written-out member weight
    theta + sign * sigma * eps (selected factors) or theta (the others), lora_B times the scaling."""
    from esrl.es import get_mode, population
    from esrl.es.config import ESConfig
    from esrl.es.noise import gaussian
    from esrl.es.setup import build_policy, build_selection
    from esrl.models import load_causal_lm
    from esrl.models.lora import peft_lora_modules

    cfg = ESConfig(mode="lora", sigma=0.05, lora_rank=4, lora_alpha=12, include=[r"layers\.0\."], antithetic=True)
    policy = build_policy(load_causal_lm(tiny_model), cfg, 0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    selection, spec = build_selection(policy, cfg)
    index = {id(p): j for j, _, p in selection}
    static = get_mode("lora").static_population(policy, selection, spec)
    members = population(3, 1, 8, antithetic=True)
    static.load(members[:4])
    addresses = {k: [t.data_ptr() for t in ts] for k, ts in static._buffers.items()}
    static.load(members[4:])
    assert {k: [t.data_ptr() for t in ts] for k, ts in static._buffers.items()} == addresses

    def member(p, m):  # written out: theta + sign * sigma * eps for a selected factor, theta else
        return p + m.sign * 0.05 * gaussian(m.seed, index[id(p)], p.shape) if id(p) in index else p

    modules = peft_lora_modules(policy)
    for name, (a, b, scaling) in modules.items():
        assert scaling == 3.0
        b_t, a_slots = static._buffers[name]  # scaling * lora_B^T (M, r, out), lora_A (M, r, in)
        for i, m in enumerate(members[4:]):
            assert torch.allclose(a_slots[i], member(a, m), rtol=0, atol=1e-6)
            assert torch.allclose(b_t[i], (member(b, m) * scaling).T, rtol=0, atol=1e-6)
            if id(a) not in index:
                assert torch.equal(a_slots[i], a) and torch.equal(b_t[i], (b * scaling).T)
    assert 0 < len(selection) < 2 * len(modules)


@pytest.mark.parametrize("antithetic,scaling", [(False, "global"), (True, "global"), (False, "rms")])
def test_lowrank_buffers_hold_the_hooks_factors_bit_for_bit_in_bf16(tiny_model, antithetic, scaling):
    """StaticLowRank writes the scaled factors straight into its bf16 buffers, one group of same-shape matrices at a
    time (first load and refill alike); they must be the factors the eager hooks and the engines' adapters use
    (_member_factors: per matrix, scaled in fp32, then rounded once), transposed, bit for bit; with rms scaling each
    matrix of a group has its own scale."""
    from esrl.es import get_mode, population
    from esrl.es.config import ESConfig
    from esrl.es.modes.lowrank import _member_factors
    from esrl.es.noise import drawn_once
    from esrl.es.setup import build_selection
    from esrl.models import load_causal_lm

    cfg = ESConfig(mode="lowrank", sigma=0.05, rank=2, antithetic=antithetic, sigma_scaling=scaling)
    policy = load_causal_lm(tiny_model).to(torch.bfloat16)
    selection, spec = build_selection(policy, cfg)
    static = get_mode("lowrank").static_population(policy, selection, spec)
    members = population(4, 2, 8, antithetic=antithetic)
    for chunk in (members[:4], members[4:]):
        with drawn_once():
            static.load(chunk)
        for j, name, p in selection:
            a, b = _member_factors(chunk, j, p, spec, None)
            a_t, b_t = static._buffers[name]
            assert a_t.dtype == torch.bfloat16 and a_t.is_contiguous() and b_t.is_contiguous()
            assert torch.equal(a_t, a.transpose(1, 2)) and torch.equal(b_t, b.transpose(1, 2)), name
    static.remove()


def test_lora_buffers_of_a_bf16_model_hold_each_members_adapter_rounded_once(tiny_model):
    """On a bf16 model PEFT keeps its adapters in fp32; StaticLora's buffers take the model's bf16 (the kernel
    re-reads them per row), each value the fp32 member adapter (lora_adapters) rounded once: bit for bit, since the
    default scaling (lora_alpha = 2 r) is a power of two."""
    from esrl.es import get_mode, population
    from esrl.es.config import ESConfig
    from esrl.es.modes.lora import lora_adapters
    from esrl.es.setup import build_policy, build_selection
    from esrl.models import load_causal_lm

    cfg = ESConfig(mode="lora", sigma=0.05, lora_rank=4, lora_alpha=8)
    policy = build_policy(load_causal_lm(tiny_model).to(torch.bfloat16), cfg, 0)
    selection, spec = build_selection(policy, cfg)
    assert {p.dtype for p in selection.params} == {torch.float32}  # PEFT's autocast: the adapters stay fp32
    static = get_mode("lora").static_population(policy, selection, spec)
    members = population(5, 0, 4, antithetic=True)
    static.load(members)
    for i, adapters in enumerate(lora_adapters(policy, selection, spec, members)):
        for name, (a, scaled_b) in adapters.items():
            b_t, a_slots = static._buffers[name]
            assert b_t.dtype == a_slots.dtype == torch.bfloat16
            assert torch.equal(a_slots[i], a.bfloat16()) and torch.equal(b_t[i], scaled_b.T.bfloat16()), name
    static.remove()


def test_a_model_carries_one_static_population_at_a_time(tiny_model, monkeypatch):
    """A second population over a model that carries one is refused: its probe would run through the first's reordered
    MLPs, which the first's remove() takes away under it (gate's term dropped, no error). After remove() the model takes
    a new one, which gives the eager hooks' logits; remove() twice does nothing; a removed population refuses to load
    or decode (its hooks are gone: the base model's rows, silently); a failure while building (Ctrl+C in the probe)
    leaves no hook and no MLP forward behind."""
    from esrl.es import get_mode, population
    from esrl.es.config import ESConfig
    from esrl.es.setup import build_selection
    from esrl.es.static_population import StaticPopulation
    from esrl.models import load_causal_lm

    monkeypatch.setattr(StaticPopulation, "share_launches", True)  # gate and up reordered and shared, as on a GPU
    model = load_causal_lm(tiny_model).eval()
    selection, spec = build_selection(model, ESConfig(mode="lowrank", sigma=0.05, rank=2))
    mode, members = get_mode("lowrank"), population(2, 0, 3)
    ids, rows = torch.randint(5, 100, (3, 6), generator=torch.Generator().manual_seed(0)), torch.arange(3)
    with torch.inference_mode(), mode.population(model, selection, spec, members, rows):
        want = model(input_ids=ids).logits

    def hooks_and_forwards() -> tuple[int, int]:
        return (sum(len(m._forward_hooks) for m in model.modules()),
                sum("forward" in vars(m) for m in model.modules()))

    first = mode.static_population(model, selection, spec)
    assert any("up_proj" in run[-1] for run in first.runs)
    with pytest.raises(RuntimeError, match="already carries a StaticLowRank: call its remove"):
        mode.static_population(model, selection, spec)
    first.remove()
    first.remove()
    assert hooks_and_forwards() == (0, 0)
    with pytest.raises(RuntimeError, match="was removed"):
        first.load(members)
    second = mode.static_population(model, selection, spec)
    second.load(members)
    with torch.inference_mode(), second.population(rows):
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    second.remove()
    with pytest.raises(RuntimeError, match="was removed"), second.population(rows):
        pass

    def interrupted(*args):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr("esrl.es.static_population.late_runs", interrupted)
        with pytest.raises(KeyboardInterrupt):
            mode.static_population(model, selection, spec)
    assert hooks_and_forwards() == (0, 0)
    calls = []  # and within gate_up_first's own probe: the forward with its MLPs reordered is the second

    def second_call_interrupted(*args) -> None:
        calls.append(1)
        if len(calls) == 2:
            interrupted()

    handle = model.register_forward_pre_hook(second_call_interrupted)
    with pytest.raises(KeyboardInterrupt):
        mode.static_population(model, selection, spec)
    handle.remove()
    assert len(calls) == 2 and hooks_and_forwards() == (0, 0)
    mode.static_population(model, selection, spec).remove()  # nothing left carried
