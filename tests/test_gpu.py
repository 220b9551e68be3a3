"""ES invariants on a CUDA GPU (`pytest -m gpu`; skipped without CUDA, so CI, which has none, skips them).

The model: a small random Qwen2 in bf16 with head_dim 128 (the 1.5B-7B models' head size), generating 140 tokens so
the KV length passes ~130, where cuDNN's attention stopped repeating on an H100 (benchmarks/gpu/NOTES_issue15.md).
Its tokenizer is the embedded SmolLM2 one, or the folder in ESRL_TOKENIZER (a GPU machine without the embedded
model's package: config and tokenizer files only).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from es_rank import fit_two_ranks, fit_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = ["Hi", "Write a much longer sentence about the sea and the sky"]
DEVICE = "cuda"


def _random_qwen(out, dtype: str = "bfloat16") -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from esrl.models import load_tokenizer

    if (out / "config.json").is_file():
        return str(out)
    tok = load_tokenizer(os.environ.get("ESRL_TOKENIZER", "smollm2-135m-instruct"))
    config = Qwen2Config(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, torch_dtype=dtype)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> str:
    return _random_qwen(tmp_path_factory.mktemp("qwen") / "bf16")


@pytest.mark.parametrize(("mode", "compile"), [
    ("full", "auto"), ("lowrank", "auto"), ("lora", "auto"), ("lowrank", "fused"), ("lora", "fused"),
    ("lowrank", "auto-overlap"), ("lora", "auto-overlap")])
def test_two_es_fits_give_identical_weights(qwen, tmp_path, mode, compile, monkeypatch):
    """compile "auto" is the recorded decode step on CUDA (the default); "fused" torch.compiles it first;
    "auto-overlap" records the decode step with the member terms beside the GEMMs (StaticPopulation.overlap)."""
    if mode == "lora":
        pytest.importorskip("peft")
    if compile.endswith("-overlap"):
        monkeypatch.setattr("esrl.es.static_population.StaticPopulation.overlap", True)
        compile = compile.removesuffix("-overlap")
    a, b = fit_weights(qwen, tmp_path / "a", mode, compile), fit_weights(qwen, tmp_path / "b", mode, compile)
    _assert_same(a, b)


@pytest.mark.parametrize("mode", ["full", "lowrank", "lora"])
def test_an_es_fit_on_cuda_exports_from_its_seed_log_to_its_final_weights(qwen, tmp_path, mode):
    """The seed log names the device whose generator drew the noise (a GPU's Philox, not the CPU's numbers):
    `esrl export` replays there, to final/'s weights bit for bit."""
    from conftest import assert_same_tensors, load_safetensors

    from esrl.export import export

    if mode == "lora":
        pytest.importorskip("peft")
    fit_weights(qwen, tmp_path / "fit", mode)
    (log,) = (tmp_path / "fit").rglob("seed_log.jsonl")
    (final,) = (tmp_path / "fit").rglob("final/model.safetensors")
    header = json.loads(log.read_text().splitlines()[0])
    assert header["device"] == "cuda" and header["noise_source"].startswith(f"cuda: {torch.cuda.get_device_name()}")
    out = export(str(log), str(tmp_path / "export"), qwen)
    assert_same_tensors(load_safetensors(final), load_safetensors(out / "model.safetensors"))


def test_a_checkpoint_of_a_cuda_fit_is_refused_on_the_cpu(qwen, tmp_path):
    """The CPU draws other noise for the same seeds: a GPU run's checkpoint resumed there is refused in one line
    (the CPU suite checks the refusal with a checkpoint edited to name cuda: test_es_failures)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from esrl.errors import DataError

    fit_weights(qwen, tmp_path / "gpu", "lowrank",
                checkpoints=ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1))
    with pytest.raises(DataError, match=r"its 1 ES updates drew their noise on cuda; on cpu the same seeds"):
        fit_weights(qwen, tmp_path / "cpu", "lowrank", device="cpu",
                    ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=1.ckpt"))


@pytest.mark.parametrize("mode", ["full", "lowrank"])
def test_two_processes_on_one_gpu_give_the_weights_of_one(qwen, tmp_path, mode):
    """World-size invariance on CUDA, and ES's collectives (fitness, checksums) on a backend without a CPU side, as
    NCCL: two ranks share the one GPU through Gloo bound to CUDA (tests/es_rank.py says why)."""
    one = fit_weights(qwen, tmp_path / "one", mode)
    _assert_same(one, fit_two_ranks(qwen, tmp_path / "two", mode, "cuda", "cuda:gloo"))


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]


@pytest.mark.parametrize("scaling", ["global", "rms"])
def test_perturb_then_restore_is_bit_exact_in_bf16(qwen, scaling):
    from esrl.es import Perturber, population, select_params
    from esrl.es.noise import NoiseSpec
    from esrl.models import load_causal_lm

    model = load_causal_lm(qwen, "bfloat16").cuda()
    selection = select_params(model)
    before = [p.detach().clone() for p in selection.params]
    perturber = Perturber(selection, NoiseSpec(sigma=0.01, sigma_scaling=scaling))
    for member in population(1, 0, 3, antithetic=True):
        with perturber.perturbed(member):
            assert any(not torch.equal(p, b) for p, b in zip(selection.params, before))
    assert all(torch.equal(p, b) for p, b in zip(selection.params, before))


def test_batched_lowrank_equals_member_by_member_within_bf16(qwen):
    """The hooked bf16 batch is as close to the exact answer (each member's weights written into an fp32 copy of the
    model) as bf16 member-by-member is: writing W + dW in bf16 rounds it, the hooks add the term in bf16 instead.
    (A direct batched-vs-member bound failed at 1e-2 on an H100: both sides carry bf16 error.)"""
    from esrl.es import Perturber, get_mode, population
    from esrl.es.config import ESConfig
    from esrl.es.setup import build_selection
    from esrl.models import load_causal_lm, load_tokenizer

    cfg = ESConfig(mode="lowrank", sigma=0.05, rank=2)
    model, tok = load_causal_lm(qwen, "bfloat16").cuda(), load_tokenizer(qwen)
    exact_model = load_causal_lm(qwen, "float32").cuda()
    selection, spec = build_selection(model, cfg)
    exact_selection, _ = build_selection(exact_model, cfg)
    members = population(4, 0, 3)
    enc = tok(PROMPTS * len(members), return_tensors="pt", padding=True).to("cuda")
    rows = torch.arange(len(members)).repeat_interleave(len(PROMPTS))
    with torch.no_grad():
        base = exact_model(**enc).logits
        with get_mode("lowrank").population(model, selection, spec, members, rows):
            batched = model(**enc).logits.float()
        perturber, exact_perturber = Perturber(selection, spec), Perturber(exact_selection, spec)
        for i, m in enumerate(members):
            part = {k: v[i * 2:(i + 1) * 2] for k, v in enc.items()}
            with perturber.perturbed(m):
                single = model(**part).logits.float()
            with exact_perturber.perturbed(m):
                exact = exact_model(**part).logits
            real = part["attention_mask"].bool()  # padding positions attend to nothing: their logits mean nothing
            got, single, exact = batched[i * 2:(i + 1) * 2][real], single[real], exact[real]
            error, single_error = (got - exact).norm(), (single - exact).norm()
            effect = (exact - base[i * 2:(i + 1) * 2][real]).norm()
            assert error <= max(2 * single_error, 1e-2 * exact.norm()) and error <= 0.1 * effect, \
                (float(error), float(single_error), float(effect), float(exact.norm()))


def test_compiled_fused_and_eager_engines_give_the_same_greedy_tokens_in_fp32(tmp_path):
    from esrl.models import load_causal_lm, load_tokenizer
    from esrl.rollout import HFEngine

    path = _random_qwen(tmp_path / "fp32", dtype="float32")
    model, tok = load_causal_lm(path).cuda(), load_tokenizer(path)
    want = [c.token_ids for c in HFEngine(model, tok, compile="off").generate(PROMPTS, max_new_tokens=40,
                                                                                min_new_tokens=40)]
    for compile in ("auto", "fused"):  # recorded; torch.compile'd, then recorded
        compiled = HFEngine(model, tok, compile=compile)
        assert compiled.capabilities.static_shapes
        for _ in range(2):
            assert [c.token_ids for c in compiled.generate(PROMPTS, max_new_tokens=40, min_new_tokens=40)] == want


def _es_policy(path: str, mode: str, dtype: str):
    """(tokenizer, policy on DEVICE, selection, spec) for an ES `mode` on the model at `path`: lowrank rank 1, or
    lora rank 8 (PEFT's adapter wrapped around the model)."""
    from esrl.es.config import ESConfig
    from esrl.es.setup import build_policy, build_selection
    from esrl.models import load_causal_lm, load_tokenizer

    cfg = ESConfig(mode=mode, sigma=0.05, **(dict(rank=1) if mode == "lowrank" else dict(lora_rank=8, lora_alpha=16)))
    tok, policy = load_tokenizer(path), load_causal_lm(path, dtype).to(DEVICE)
    if mode == "lora":
        policy = build_policy(policy, cfg, 0)
    return (tok, policy, *build_selection(policy, cfg))


def _static_logits(qwen, mode: str, monkeypatch, decode: bool = False, **switches) -> dict:
    """Logits of a population of 3 members on the PROMPTS through the mode's static population on CUDA, once per
    setting of StaticPopulation's switches (`switches`: name -> values, two forwards each), and the base logits.
    decode: the prompts' last tokens alone, one a row (a decode step's shape)."""
    from esrl.es import get_mode, population
    from esrl.es.static_population import StaticPopulation
    from esrl.rollout.hf import rollout_attention

    tok, policy, selection, spec = _es_policy(qwen, mode, "bfloat16")
    members = population(4, 0, 3)
    enc = tok(PROMPTS * len(members), return_tensors="pt", padding=True).to(DEVICE)
    if decode:
        enc = {"input_ids": enc["input_ids"][:, -1:]}
    rows = torch.arange(len(members)).repeat_interleave(len(PROMPTS))
    with torch.no_grad(), rollout_attention(enc["input_ids"].device):
        out = {"base": policy(**enc).logits.float(), "layers": policy.config.num_hidden_layers}
        for name, values in switches.items():
            for value in values:
                monkeypatch.setattr(StaticPopulation, name, value)
                static = get_mode(mode).static_population(policy, selection, spec)
                static.load(members)
                with static.population(rows):
                    out[name, value] = [policy(**enc).logits.float() for _ in range(2)]
                out[name, value, "runs"] = sorted(run[-1].removesuffix(".weight").rsplit(".", 1)[-1]
                                                  for run in static.runs)
                out[name, value, "inside"] = sum(len(x._inputs) for x in static._inside)  # decode buffers made
                out[name, value, "side"] = len(static._side._terms) if static._side is not None else 0
                static.remove()
    return out


@pytest.mark.parametrize("mode", ["lowrank", "lora"])
def test_a_static_populations_shared_launches_give_the_logits_of_one_launch_each(qwen, mode, monkeypatch):
    """A static population on CUDA adds q/k/v's and gate/up's terms in one launch a run, after the run's last linear
    (up_proj run before act_fn: esrl.es.shared_inputs): the logits are those of one launch per linear, bit for bit,
    as the kernel's sums do not depend on the launch and nothing reads an output before its terms are added."""
    out = _static_logits(qwen, mode, monkeypatch, share_launches=[False, True])
    assert out["share_launches", True, "runs"] == sorted(["up_proj", "v_proj"] * out["layers"])
    assert out["share_launches", False, "runs"] == []
    assert torch.equal(out["share_launches", True][0], out["share_launches", False][0])


@pytest.mark.parametrize("mode", ["lowrank", "lora"])
def test_the_mlps_terms_inside_their_gemms_repeat_and_match_the_kernels_within_bf16(qwen, mode, monkeypatch):
    """terms_inside (esrl.es.inside_terms): each MLP's member terms as extra columns of its GEMMs, at a decode-shaped
    forward (one token a row), give the same logits twice, bit for bit, and differ from the kernel path's by bf16
    roundings only (c rounded before the product, each output rounded once): far less than the perturbation's own
    effect."""
    monkeypatch.setattr("esrl.es.static_population.StaticPopulation.share_launches", True)
    out = _static_logits(qwen, mode, monkeypatch, decode=True, terms_inside=[False, True])
    assert out["terms_inside", True, "inside"] == out["layers"] and out["terms_inside", False, "inside"] == 0
    (kernel, kernel_again), (inside, inside_again) = out["terms_inside", False], out["terms_inside", True]
    assert torch.equal(inside, inside_again) and torch.equal(kernel, kernel_again)
    effect = (kernel - out["base"]).norm()
    assert effect > 0 and (inside - kernel).norm() <= 0.1 * effect, (float((inside - kernel).norm()), float(effect))


@pytest.mark.parametrize("mode", ["lowrank", "lora"])
def test_a_decode_steps_terms_on_a_side_stream_give_the_in_place_kernels_logits_bit_for_bit(qwen, mode, monkeypatch):
    """overlap (esrl.es.side_terms): at a decode-shaped forward each run's terms run on a side stream beside its
    GEMMs, written alone in fp32 and added after them: the kernel's sums, one rounding, so the logits are the in-place
    kernel's bit for bit (7 buffers, one a kind of linear, shared by the layers)."""
    monkeypatch.setattr("esrl.es.static_population.StaticPopulation.share_launches", True)
    out = _static_logits(qwen, mode, monkeypatch, decode=True, overlap=[False, True])
    assert out["overlap", True, "side"] == 7 and out["overlap", False, "side"] == 0
    (kernel, kernel_again), (side, side_again) = out["overlap", False], out["overlap", True]
    assert torch.equal(side, side_again) and torch.equal(kernel, kernel_again) and torch.equal(side, kernel)
    assert not torch.equal(side, out["base"])


def test_a_chunk_replays_the_step_recorded_for_its_own_member_count(tmp_path):
    """8 members x 2 prompts after 4 x 4 (16 rows each, as an epoch's smaller last batch): the same tokens as the
    8-member chunk alone. The step recorded for 4 members, replayed for 8, read the 4-member chunk's buffers."""
    from esrl.es import get_mode, population
    from esrl.es.engines import InPlaceES
    from esrl.rollout import HFEngine

    tok, policy, selection, spec = _es_policy(_random_qwen(tmp_path / "bf16"), "lowrank", "bfloat16")
    prompts = ["Hi", "Tell me a story", "red dyes", "List prime numbers"]
    four, eight = (population(4, 0, 4), prompts), (population(4, 1, 8), prompts[:2])

    def tokens(chunks):
        engine = HFEngine(policy, tok, compile="on")
        backend = InPlaceES(engine, policy, selection, spec, get_mode("lowrank"))
        out = [[[c.token_ids for c in m] for m in engine.generate_population(
            rows, len(members), backend.row_weights(members), max_new_tokens=40, min_new_tokens=40)]
            for members, rows in chunks]
        assert len(engine._decoders) == len(chunks)
        backend.static.remove()
        return out

    assert tokens([four, eight])[1] == tokens([eight])[0]


@pytest.mark.parametrize("switch,dtype", [("terms_inside", "float32"), ("overlap", "bfloat16")])
@pytest.mark.parametrize("mode", ["lowrank", "lora"])
def test_a_recorded_decode_with_another_terms_path_gives_the_kernels_tokens(tmp_path, mode, switch, dtype,
                                                                            monkeypatch):
    """terms_inside and overlap where they are meant to run, the recorded (CUDA-graph) decode step: greedy tokens
    equal the kernel path's (terms_inside in an fp32 model, as it rounds c first; overlap in bf16, the same sums),
    the decode step's buffers were made (one token a row: 3 members x 2 prompts), members differ."""
    from esrl.es import get_mode, population
    from esrl.es.engines import InPlaceES
    from esrl.es.static_population import StaticPopulation
    from esrl.rollout import HFEngine

    tok, policy, selection, spec = _es_policy(_random_qwen(tmp_path / dtype, dtype=dtype), mode, dtype)
    members = population(4, 0, 3)
    monkeypatch.setattr(StaticPopulation, "share_launches", True)
    tokens = {}
    for on in (False, True):
        monkeypatch.setattr(StaticPopulation, switch, on)
        engine = HFEngine(policy, tok, compile="on")
        backend = InPlaceES(engine, policy, selection, spec, get_mode(mode))
        out = engine.generate_population(PROMPTS, len(members), backend.row_weights(members), max_new_tokens=40,
                                         min_new_tokens=40)
        tokens[on] = [[c.token_ids for c in m] for m in out]
        static = backend.static
        made = ([list(x._inputs) for x in static._inside] if switch == "terms_inside" else
                sorted({(slot[2], slot[4]) for slot in static._side._terms}) if static._side is not None else [])
        assert made == ([] if not on else [[(6, True)]] * policy.config.num_hidden_layers
                        if switch == "terms_inside" else [(6, True)]), made
        static.remove()
    assert tokens[True] == tokens[False] and len({tuple(m[1]) for m in tokens[True]}) > 1
