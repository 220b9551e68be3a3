"""esrl.es.shared_inputs: which perturbed linears may take their member terms in one launch after the last of them.

The answer is checked on the model by a probe forward, not assumed per architecture, because deferring a term is
only exact where nothing reads the early outputs before the last linear runs. Real transformers models with random
weights: Llama, Qwen2 and Mistral (q, k and v read x, rotary follows all three: one run a layer), an MLP's gate and
up (act_fn reads gate before up_proj runs: refused, until gate_up_first reorders the two calls), Qwen3 (q_norm reads
q before k_proj runs: refused).
"""

from __future__ import annotations

import pytest
import torch


def _linears(model) -> list[tuple[str, torch.nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in name]


def _random(arch: str):
    import transformers

    config = getattr(transformers, f"{arch}Config")(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                    num_hidden_layers=2, num_attention_heads=4,
                                                    num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    return getattr(transformers, f"{arch}ForCausalLM")(config).eval()


ATTENTION = ("q_proj", "k_proj", "v_proj")


@pytest.mark.parametrize("arch,runs", [("Llama", [ATTENTION]), ("Qwen2", [ATTENTION]), ("Mistral", [ATTENTION]),
                                      ("Qwen3", [])])
def test_the_probe_keeps_q_k_v_where_nothing_reads_them_early(arch, runs):
    from esrl.es.shared_inputs import late_runs

    model = _random(arch)
    want = [tuple(f"model.layers.{i}.self_attn.{name}" for name in run) for i in range(2) for run in runs]
    assert late_runs(model, _linears(model), most=3) == want


def test_runs_are_cut_at_the_launch_size_and_checked_as_cut():
    """With at most two linears a launch, q and k form the run (v then reads the same x alone)."""
    from esrl.es.shared_inputs import late_runs

    model = _random("Llama")
    assert late_runs(model, _linears(model), most=2) == [
        (f"model.layers.{i}.self_attn.q_proj", f"model.layers.{i}.self_attn.k_proj") for i in range(2)]


def test_candidates_include_gate_and_up_which_the_check_refuses():
    """The recorded calls do pair gate_proj with up_proj (one input): only the late-terms check drops them."""
    from esrl.es.shared_inputs import _shared_input_runs

    model = _random("Llama")
    runs = _shared_input_runs(model, _linears(model), 3)
    assert ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj") in runs
    assert tuple(f"model.layers.0.self_attn.{name}" for name in ATTENTION) in runs


GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


@pytest.mark.parametrize("arch,runs", [("Llama", [ATTENTION, GATE_UP]), ("Qwen2", [ATTENTION, GATE_UP]),
                                      ("Qwen3", [GATE_UP])])
def test_gate_up_first_keeps_the_logits_and_lets_gate_and_up_share_a_launch(arch, runs):
    from esrl.es.shared_inputs import _probe_ids, gate_up_first, late_runs

    model = _random(arch)
    with torch.inference_mode():
        want = model(input_ids=_probe_ids(model)).logits
    restore = gate_up_first(model)
    mlps = [layer.mlp for layer in model.model.layers]
    assert all("forward" in vars(m) for m in mlps)
    with torch.inference_mode():
        assert torch.equal(model(input_ids=_probe_ids(model)).logits, want)
    expected = [tuple(f"model.layers.{i}.{name if '.' in name else 'self_attn.' + name}" for name in run)
                for i in range(2) for run in runs]
    assert sorted(late_runs(model, _linears(model), most=3)) == sorted(expected)
    restore()
    assert not any("forward" in vars(m) for m in mlps)
    assert sorted(late_runs(model, _linears(model), most=3)) == sorted(run for run in expected if "mlp" not in run[0])


def test_an_mlp_with_another_forward_keeps_it():
    """An MLP whose forward is not down(act(gate(x)) * up(x)) (here act on up, times gate) changes the probe's logits
    under gate_up_first's forward, so it keeps its own: no run of its linears is kept."""
    from esrl.es.shared_inputs import gate_up_first, late_runs

    model = _random("Llama")
    mlp_class = type(model.model.layers[0].mlp)

    class UpActivated(mlp_class):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    for layer in model.model.layers:
        layer.mlp.__class__ = UpActivated
    gate_up_first(model)
    assert not any("forward" in vars(layer.mlp) for layer in model.model.layers)
    assert all("mlp" not in run[0] for run in late_runs(model, _linears(model), most=3))


def test_a_reordered_model_deep_copies_and_pickles_with_its_own_mlps():
    """The reordered forward is an instance attribute: a copy's MLPs must call the copy's linears, not the original's."""
    import copy
    import pickle

    from esrl.es.shared_inputs import _probe_ids, gate_up_first

    model = _random("Llama")
    gate_up_first(model)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with torch.no_grad():
            for p in clone.model.layers[0].mlp.up_proj.parameters():
                p.zero_()
            want = model(input_ids=_probe_ids(model)).logits
            assert not torch.equal(clone(input_ids=_probe_ids(model)).logits, want)
            assert torch.equal(model(input_ids=_probe_ids(model)).logits, want)
