"""ES invariants that a change to the math or its guards must break, each found untested by mutating the code
(session 33's review): seeds and draws pinned to values (a seed log must replay on later versions), the seed
log's order and antithetic replay, the base model's fingerprint, the perturber's guard, member-major rows, the
lowrank hooks' bias terms, the rounding of eps to the weights' dtype, dtype-split groups, exclude patterns."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import written_out_update

from esrl.es import Perturber, get_mode, lowrank_selection, population, select_params
from esrl.es.noise import NoiseSpec, gaussian, member_seed, member_weight


def test_seeds_and_draws_are_pinned_values():
    """Checked only against esrl's own functions, a change to member_seed or derive_seed made everywhere at once
    passed every test, and seed logs written before it would replay to other weights with no error."""
    assert member_seed(0, 0, 0) == 4497770656674867055
    assert member_seed(1, 23, 4) != member_seed(12, 3, 4)
    torch.testing.assert_close(gaussian(member_seed(0, 0, 0), 1, (3,)),
                               torch.tensor([1.3867745399475098, -0.13473579287528992, -1.1236145496368408]))


def test_every_exclude_pattern_excludes(tiny_lm):
    sel = select_params(tiny_lm, exclude=["norm", "embed"])
    assert sel.names and not any("norm" in n or "embed" in n for n in sel.names)


def test_a_static_population_refuses_rows_not_member_major(tiny_lm):
    spec = NoiseSpec(mode="lowrank", sigma=0.05, rank=1)
    sel = lowrank_selection(tiny_lm, select_params(tiny_lm), spec)
    static = get_mode("lowrank").static_population(tiny_lm, sel, spec)
    try:
        static.load(population(0, 0, 2))
        with pytest.raises(ValueError, match="member-major"):
            with static.population(torch.tensor([0, 1, 0, 1])):
                pass
    finally:
        static.remove()


def test_lowrank_hooks_perturb_linear_biases_as_one_member_at_a_time():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    spec = NoiseSpec(mode="lowrank", sigma=0.5, rank=2, lowrank_vectors="full")
    sel = lowrank_selection(model, select_params(model), spec)
    assert any(n.endswith("bias") for n in sel.names)
    members = population(3, 0, 4, antithetic=True)
    x = torch.randn(4, 8)
    with torch.no_grad():
        with get_mode("lowrank").population(model, sel, spec, members, torch.arange(4)):
            batched = model(x)
        for i, m in enumerate(members):
            with Perturber(sel, spec).perturbed(m):
                torch.testing.assert_close(batched[i], model(x[i:i + 1])[0], atol=1e-5, rtol=0)


def test_seed_log_records_out_of_order_are_refused(tmp_path):
    from esrl.errors import DataError
    from esrl.es.seed_log import make_record, read_seed_log

    log = tmp_path / "log.jsonl"
    recs = [make_record(t, torch.zeros(2, dtype=torch.float64), 0.1, 0.1) for t in (0, 2, 1)]
    log.write_text("\n".join(json.dumps(x) for x in [_header(2), *recs]) + "\n")
    with pytest.raises(DataError, match="expected iteration 1, found 2"):
        read_seed_log(log)


def test_the_fingerprint_sees_swapped_tensors_and_every_chunk(monkeypatch):
    from esrl.es import fingerprint

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    before = fingerprint.weights_fingerprint(m)
    with torch.no_grad():
        a = m[0].weight.clone()
        m[0].weight.copy_(m[1].weight)
        m[1].weight.copy_(a)
    assert fingerprint.weights_fingerprint(m) != before
    monkeypatch.setattr(fingerprint, "_CHUNK", 4)
    before = fingerprint.weights_fingerprint(m)
    with torch.no_grad():
        m[1].weight.view(-1)[-1] += 1.0
    assert fingerprint.weights_fingerprint(m) != before


def test_the_replay_of_an_antithetic_run_is_the_written_out_update(tiny_model):
    from dataclasses import asdict

    from esrl.es.config import ESConfig
    from esrl.es.seed_log import make_record, replay
    from esrl.es.setup import build_selection
    from esrl.models import load_causal_lm
    from esrl.policy import PolicyConfig

    cfg = ESConfig(population_size=4, sigma=0.05, alpha=0.01, antithetic=True)
    header = {"format": "esrl-seed-log/1", "es": asdict(cfg), "noise_seed": 7, "policy": asdict(PolicyConfig())}
    z = torch.tensor([1.0, -0.5, 0.25, 2.0], dtype=torch.float64)
    ref = load_causal_lm(tiny_model)
    sel, spec = build_selection(ref, cfg)
    expected = written_out_update(sel, spec, population(7, 0, 4, antithetic=True), z, 0.01)
    model = replay(load_causal_lm(tiny_model), header, [make_record(0, z, 0.01, 0.05)])
    got = dict(model.named_parameters())
    for name, e in zip(sel.names, expected):
        torch.testing.assert_close(got[name], e, atol=1e-6, rtol=0)


def test_member_weight_rounds_eps_to_the_weights_dtype_first():
    w = member_weight(torch.zeros(1, dtype=torch.bfloat16), torch.tensor([1.0039]), 1.0, 3.0)
    assert w.item() == 3.0  # bf16(1.0039) = 1.0, times 3; not bf16(3.0117) = 3.0156


def test_perturbing_twice_is_refused_and_restore_is_exact():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    before = [p.detach().clone() for p in m.parameters()]
    perturber = Perturber(select_params(m))
    mem = population(0, 0, 2)
    perturber.perturb(mem[0], 0.1)
    with pytest.raises(RuntimeError, match="already perturbed"):
        perturber.perturb(mem[1], 0.1)
    perturber.restore()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))


def test_same_shape_groups_split_dtypes():
    from esrl.es.params import ParamSelection

    ps = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))]
    assert len(ParamSelection([0, 1], ["a", "b"], ps).same_shape_groups()) == 2


def test_an_antithetic_runs_export_is_bit_exact(tiny_model, tmp_path):
    """No export test used antithetic pairs: a replay that ignored them, or kept the shaped fitness in fp32 (the
    pair differences z_2k - z_2k+1 round otherwise in a third of pairs), rebuilt other weights."""
    from conftest import assert_same_tensors, fit_final, load_safetensors, run_esrl, write_tiny_config

    cfg = write_tiny_config(tmp_path / "c.yaml", tiny_model, max_steps=2,
                            es={"population_size": 4, "sigma": 0.05, "alpha": 0.02, "antithetic": True})
    final = fit_final(cfg, tmp_path / "run")
    log = next((tmp_path / "run").rglob("seed_log.jsonl"))
    out = run_esrl("export", "--seed-log", log, "--base", tiny_model, "--out", tmp_path / "rebuilt")
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_tensors(load_safetensors(final), load_safetensors(tmp_path / "rebuilt" / "model.safetensors"))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda h, r: (h, {**r, "z": "!!!"}), ":2: field 'z' is not 2 base64 float64 values"),
    (lambda h, r: (h, {**r, "z": "AAAA"}), ":2: field 'z' is not 2 base64 float64 values"),
    (lambda h, r: (h, {**r, "alpha": "0.1"}), ":2: field 'alpha' is not a number"),
    (lambda h, r: ({**h, "es": {**h["es"], "mode": "sparse"}}, r), ":1: the header's 'es' config does not rebuild"),
    (lambda h, r: ({k: v for k, v in h.items() if k != "policy"}, r), ":1: the header's 'policy' lacks"),
    (lambda h, r: ({**h, "policy": {**h["policy"], "dtype": "fp8"}}, r), ":1: the header's 'policy.dtype' 'fp8' is"),
    (lambda h, r: ({**h, "device": "gpu0"}, r), ":1: the header's 'device' 'gpu0' is not a torch device type"),
    (lambda h, r: ({**h, "device": "distributed"}, r), ":1: the header's 'device' 'distributed' is not a torch"),
    (lambda h, r: ({**h, "es": {**h["es"], "include": ["("]}}, r), ":1: the header's 'es' config does not rebuild"),
    (lambda h, r: ({**h, "policy": {**h["policy"], "name_or_path": 3}}, r), ":1: the header's 'policy.name_or_path' 3"),
])
def test_a_seed_log_with_edited_values_is_one_error_naming_the_line(tmp_path, edit, message):
    """Lines that parse as JSON but hold values no run wrote (a damaged copy, a hand edit) failed deep in the replay
    with a bare ValueError or KeyError (`esrl export` printed a traceback); each is a DataError naming its line."""
    from esrl.errors import DataError
    from esrl.es.seed_log import make_record, read_seed_log

    header = _header(2)
    record = make_record(0, torch.tensor([1.0, -1.0], dtype=torch.float64), 0.1, 0.1)
    log = tmp_path / "seed_log.jsonl"
    log.write_text("".join(json.dumps(x) + "\n" for x in (header, record)))
    assert len(read_seed_log(log)[1]) == 1
    log.write_text("".join(json.dumps(x) + "\n" for x in edit(header, record)))
    with pytest.raises(DataError, match=re.escape(f"{log}{message}")):
        read_seed_log(log)


def _header(members: int) -> dict:
    """A seed log's header as a run writes it (the policy and noise seed stand-ins: not replayed here)."""
    from dataclasses import asdict

    from esrl.es.config import ESConfig

    return {"format": "esrl-seed-log/1", "es": asdict(ESConfig(population_size=members)), "noise_seed": 1,
            "policy": {"name_or_path": "x", "dtype": "float32"}}
