"""The Evaluation callback samples alike whatever the run samples with, and estimates KL with dropout off."""

from __future__ import annotations

import json

import lightning as L
import pytest

from conftest import conciseness_data

pytestmark = pytest.mark.slow


def _evaluated(model, root, algo: str, top_p: float = 1.0, precision: str = "32-true", dtype: str = "float32",
              beta: float = 0.0, correct_metric: str | None = None) -> dict:
    """The step-0 evaluation (4 samples a prompt, KL on) of a one-step run of `algo` on `model`."""
    from esrl.callbacks import Evaluation
    from esrl.es.config import ESConfig
    from esrl.es.module import ESModule
    from esrl.grpo.config import GRPOConfig
    from esrl.grpo.module import GRPOModule
    from esrl.policy import PolicyConfig
    from esrl.rollout import RolloutConfig

    rollout = RolloutConfig(max_new_tokens=6, temperature=1.0, top_p=top_p)
    policy = PolicyConfig(name_or_path=model, dtype=dtype)
    module = (ESModule(policy, rollout, ESConfig(population_size=2, seed=1)) if algo == "es"
              else GRPOModule(policy, rollout, GRPOConfig(num_generations=2, seed=1, beta=beta)))
    data = conciseness_data(1)
    evaluation = Evaluation(before=True, after=False, num_samples=4, correct_metric=correct_metric)
    L.Trainer(accelerator="cpu", devices=1, max_steps=1, enable_progress_bar=False, enable_model_summary=False,
              precision=precision,
              enable_checkpointing=False, logger=False, limit_val_batches=0, default_root_dir=root,
              callbacks=[evaluation]).fit(module, datamodule=data)
    return evaluation.history[0]


def test_the_sampled_evaluation_ignores_the_runs_top_p(tiny_model, tmp_path):
    """A run that trains with rollout.top_p 0.3 is evaluated on the same samples as one with 1.0 (same weights at
    step 0): the sampled reward, pass@k and KL are the Evaluation's, comparable across runs and algorithms. They
    took the run's top_p before, and k3 on nucleus samples is no KL estimate."""
    nucleus = _evaluated(tiny_model, tmp_path / "a", "es", top_p=0.3)
    full = _evaluated(tiny_model, tmp_path / "b", "es")
    keys = [k for k in full if k.startswith(("sampled/", "pass@")) or k == "kl"]
    assert "kl" in keys and {k: nucleus[k] for k in keys} == {k: full[k] for k in keys}
    with pytest.raises(ValueError, match="Evaluation.top_p 0.9: .* 1 with kl"):
        from esrl.callbacks import Evaluation

        Evaluation(num_samples=2, top_p=0.9)


def test_grpos_kl_at_step_0_is_0_with_dropout(tmp_path):
    """GRPO trains in train mode; a model with dropout gave a nonzero KL between the policy and the reference at
    step 0, where ES gives 0, the same weights scored once with dropout and once without."""
    from transformers import AutoConfig

    from esrl.models import tiny_llama

    model = tiny_llama(tmp_path / "dropout")
    config = AutoConfig.from_pretrained(model)
    config.attention_dropout = 0.3
    config.save_pretrained(model)
    assert json.loads((tmp_path / "dropout" / "config.json").read_text())["attention_dropout"] == 0.3
    assert _evaluated(model, tmp_path / "grpo", "grpo")["kl"] == 0.0


def test_grpos_kl_at_step_0_is_0_under_a_true_half_precision(tiny_model, tmp_path):
    """bf16-true converts the policy after it loads; the evaluation's base (GRPO with beta 0 keeps no reference)
    stayed float32, and step 0's KL measured the rounding between them."""
    assert _evaluated(tiny_model, tmp_path / "grpo", "grpo", precision="bf16-true")["kl"] == 0.0


@pytest.mark.parametrize("algo, beta", [("grpo", 0.04), ("es", 0.0)])
@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_the_kl_at_step_0_is_0_for_a_bf16_policy(tiny_model, tmp_path, algo, beta, precision):
    """transformers keeps RoPE's inv_freq float32 in a bf16 model, and a true half precision casts the policy's to
    bf16: GRPO's reference (beta > 0) and the evaluation's base must hold it as the policy does, or their log-probs
    differ from the policy's at step 0 (a KL penalty toward a corrupted reference). Cast with .to(dtype), buffers
    and all, they differed under 32-true; cast only when the weights' dtype differed, under bf16-true."""
    assert _evaluated(tiny_model, tmp_path / algo, algo, dtype="bfloat16", beta=beta, precision=precision)["kl"] == 0


def test_a_correct_metric_the_task_lacks_is_one_line_naming_it(tiny_model, tmp_path):
    from esrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^Evaluation.correct_metric 'acc': the task \w+ gives .*reward"):
        _evaluated(tiny_model, tmp_path, "es", correct_metric="acc")


def test_an_eval_jsonl_whose_last_line_was_cut_off_still_reads(tmp_path):
    """A kill or a full disk mid-write leaves a torn last line in eval.jsonl: resuming the run, `esrl study --report`
    and `esrl sweep --summarize` all crashed on it (JSONDecodeError), the checkpoint unusable without editing the
    file. The torn line is left out with a warning; a broken line before the last is one error naming it."""
    from esrl.callbacks.evaluation import evaluation_records
    from esrl.errors import DataError

    path = tmp_path / "eval.jsonl"
    path.write_text('{"step": 0, "reward": -3.0}\n{"step": 1, "rew')
    with pytest.warns(UserWarning, match=r"eval.jsonl:2: its last line was cut off"):
        assert evaluation_records(path) == [{"step": 0, "reward": -3.0}]
    path.write_text('{"step": 0, "rew\n{"step": 1, "reward": -2.0}\n')
    with pytest.raises(DataError, match=r"eval.jsonl:1: not a JSON evaluation record"):
        evaluation_records(path)
