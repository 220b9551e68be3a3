"""A GRPO optimizer step over several micro-batches (trainer.accumulate_grad_batches): its metrics, its batch-scaled
advantages and its unscorable completions, as TRL computes them over its whole generation batch."""

from __future__ import annotations

import csv
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from conftest import FIXTURES, conciseness_data
from esrl.grpo import group_advantages
from esrl.tasks.base import completion_text

pytestmark = pytest.mark.slow
G = 4


def _fit(tiny_model, root, reward, scale_rewards: str = "group", callbacks=(), evaluation=None, **grpo):
    """One optimizer step of 2 micro-batches of 1 prompt (the conciseness fixture's first two) x G completions,
    the task's reward replaced by `reward` (`callbacks` and model.grpo's `grpo` added); the module and its
    metrics.csv row. `evaluation`: the Evaluation callback (default: none before or after training)."""
    from esrl.callbacks import Evaluation
    from esrl.grpo.config import GRPOConfig
    from esrl.grpo.module import GRPOModule
    from esrl.policy import PolicyConfig
    from esrl.rollout import RolloutConfig

    class Reward(L.Callback):
        def on_fit_start(self, trainer, module):
            trainer.datamodule.task.reward_funcs = [reward]

    module = GRPOModule(PolicyConfig(name_or_path=tiny_model), RolloutConfig(max_new_tokens=6, temperature=1.0),
                        GRPOConfig(num_generations=G, seed=1, scale_rewards=scale_rewards, **grpo))
    data = conciseness_data(1)
    L.Trainer(accelerator="cpu", devices=1, max_steps=1, accumulate_grad_batches=2, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0, default_root_dir=root,
              logger=CSVLogger(root, name="", version=""), log_every_n_steps=1,
              callbacks=[Reward(), evaluation or Evaluation(before=False, after=False), *callbacks]
              ).fit(module, datamodule=data)
    with open(root / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    (step,) = {r["step"] for r in rows if r.get("train/reward_mean")}  # the step's rows: Lightning's, its samples'
    return module, {k: float(v) for r in rows if r["step"] == step for k, v in r.items() if v}


def _first_answer():
    import json

    return json.loads((FIXTURES / "conciseness_train3.jsonl").read_text().splitlines()[0])["answer"]


def test_step_metrics_cover_every_micro_batch_of_the_step(tiny_model, tmp_path):
    """Reward 1 on the first micro-batch's prompt, 0 on the second's: the step's mean is 0.5 (Lightning kept the
    last micro-batch's 0 before), its std TRL's over all 8 rewards, each group's std 0."""
    first = _first_answer()
    module, row = _fit(tiny_model, tmp_path, lambda prompts, completions, answer, **_: [
        float(a == first) for a in answer])
    rewards = torch.cat([r.rewards for r in module._rollouts])
    assert rewards.tolist() == [1.0] * G + [0.0] * G
    assert row["train/reward_mean"] == 0.5
    assert math.isclose(row["train/reward_std"], float(rewards.std()), rel_tol=1e-6)
    assert row["train/reward_group_std"] == 0.0 and row["train/frac_reward_zero_std"] == 1.0
    assert row["train/unscorable"] == 0 and row["train/bad_rewards"] == 0


def test_the_steps_time_covers_its_micro_batches_and_no_evaluation_runs_inside_it(tiny_model, tmp_path):
    """time/* were the last micro-batch's (its rollout 0 s: the window is sampled at the first), and an evaluation every
    step, not asked for before training, ran at step 0 between the two micro-batches."""
    from esrl.callbacks import Evaluation

    evaluation = Evaluation(every_n_steps=1, before=False, after=False)
    _, row = _fit(tiny_model, tmp_path, lambda completions, **_: [1.0] * len(completions), evaluation=evaluation)
    assert row["time/rollout"] > 0 and row["time/reward"] > 0  # the first micro-batch's, with the second's update
    assert [r["step"] for r in evaluation.history] == [1]


def test_frac_reward_zero_std_is_trls_share_of_rewards_scaled_by_a_zero_std(tiny_model, tmp_path):
    """TRL's frac_reward_zero_std counts the rewards whose scaling std is 0: with scale_rewards batch that is the
    whole batch's std (here 0.52: no reward), not the groups' (both 0, as reward_group_std shows)."""
    first = _first_answer()
    _, row = _fit(tiny_model, tmp_path, lambda prompts, completions, answer, **_: [
        float(a == first) for a in answer], "batch")
    assert row["train/reward_group_std"] == 0.0 and row["train/reward_std"] > 0
    assert row["train/frac_reward_zero_std"] == 0.0


def test_batch_scaled_advantages_take_the_std_of_the_whole_step(tiny_model, tmp_path):
    """scale_rewards batch, the two prompts' rewards on scales 1 and 10: each micro-batch's advantages are divided
    by the std of all 8 rewards, as TRL's over its generation batch, not by its own micro-batch's."""
    first = _first_answer()
    module, _ = _fit(tiny_model, tmp_path, lambda prompts, completions, answer, **_: [
        (1.0 if a == first else 10.0) * len(completion_text(c)) for a, c in zip(answer, completions)], "batch")
    rewards = torch.cat([r.rewards for r in module._rollouts])
    assert rewards[:G].std() > 0 and rewards[G:].std() > 0  # sampled completions of different lengths
    window = group_advantages(rewards, G, "batch")
    assert torch.allclose(torch.cat([r.advantages for r in module._rollouts]), window, atol=1e-6, rtol=0)
    assert not torch.allclose(module._rollouts[0].advantages, group_advantages(rewards[:G], G, "batch"))


def test_completions_no_reward_function_applies_to_are_left_out_without_stopping_the_run(tiny_model, tmp_path):
    """TRL's unscorable completions (every reward function returned None): NaN, out of their group's mean and
    std, advantage 0, counted apart from failed rewards. Half the step's samples here: as failures they would
    stop the run (more than the allowed share); as 0 they would get an advantage of their own."""
    first = _first_answer()
    module, row = _fit(tiny_model, tmp_path, lambda prompts, completions, answer, **_: [
        float(len(completion_text(c))) if a == first else None for a, c in zip(answer, completions)])
    second = module._rollouts[1]
    assert second.rewards.isnan().all() and (second.advantages == 0).all() and second.unscorable == G
    first_rollout = module._rollouts[0]
    assert torch.equal(first_rollout.advantages, group_advantages(first_rollout.rewards, G))
    assert row["train/unscorable"] == G and row["train/bad_rewards"] == 0
    assert row["train/reward_mean"] == float(first_rollout.rewards.mean())


def test_a_task_scores_an_unscorable_completion_0_unless_asked(tiny_model):
    """ES and evaluation keep TRL's None-as-nothing sum, 0 for a completion no function applies to; GRPO asks for
    NaN. Each function gets the completions' token ids and the caller's context (TRL's completion_ids, trainer_state)."""
    from esrl.tasks.base import Task

    seen = {}

    def half(prompts, completions, completion_ids, trainer_state, **_):
        seen.update(ids=completion_ids, step=trainer_state)
        return [None, 2.0, None]

    task = Task("t", [], [], reward_funcs=[half, lambda prompts, completions, **_: [None, None, 1.0]])
    rows = [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}]
    assert task.rewards(rows, ["x", "y", "z"], [[1], [2, 3], [4]], trainer_state=7) == [0.0, 2.0, 1.0]
    assert task.last_unscorable == 1 and seen == {"ids": [[1], [2, 3], [4]], "step": 7}
    got = task.rewards(rows, ["x", "y", "z"], [[1], [2, 3], [4]], unscorable=math.nan, trainer_state=7)
    assert math.isnan(got[0]) and got[1:] == [2.0, 1.0]


def test_entropies_are_trls_and_the_step_logs_trls_other_metrics(tiny_model, tmp_path):
    """Entropies of the logits that score the completions (temperature applied), as TRL's entropy_from_logits;
    the step logs their token mean as train/entropy, each reward function's mean and std as
    train/rewards/<name>/*, and the lengths of the completions that ended."""
    from trl.trainer.utils import entropy_from_logits

    from esrl.models import load_causal_lm
    from esrl.models.logps import per_token_logps

    model = load_causal_lm(tiny_model)
    ids = torch.randint(0, 1000, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0  # a padded completion end
    logps, entropies = per_token_logps(model, ids, mask, 5, 0.7, with_entropies=True)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -6:-1].float() / 0.7
    assert torch.equal(logps, per_token_logps(model, ids, mask, 5, 0.7))
    assert torch.allclose(entropies[mask[:, -5:] == 1], entropy_from_logits(logits)[mask[:, -5:] == 1], atol=1e-5)
    assert (entropies[0, -2:] == 0).all()

    def length(prompts, completions, **_):
        return [float(len(completion_text(c))) for c in completions]

    module, row = _fit(tiny_model, tmp_path, length)
    rewards = torch.cat([r.rewards for r in module._rollouts])
    assert math.isclose(row["train/rewards/length/mean"], float(rewards.mean()), rel_tol=1e-6)
    assert math.isclose(row["train/rewards/length/std"], float(rewards.std()), rel_tol=1e-5)
    assert 0 < row["train/entropy"] < math.log(len(module.tokenizer))
    lengths = torch.cat([r.lengths for r in module._rollouts]).float()
    ended = lengths[~torch.cat([r.truncated for r in module._rollouts])]
    assert row["train/terminated_length_mean"] == (float(ended.mean()) if ended.numel() else 0.0)


def test_the_steps_completions_are_scored_in_one_call_as_trls_generation_batch(tiny_model, tmp_path):
    """TRL calls each reward function once per generation batch (the optimizer step's window): so does esrl, with
    the 2 micro-batches' 8 completions, each micro-batch's rewards then its own; log_metric's value (the call's
    total length) is logged as train/<name>."""
    calls = []

    def length(prompts, completions, log_metric, **_):
        values = [float(len(completion_text(c))) for c in completions]
        calls.append(len(completions))
        log_metric("chars", sum(values))
        return values

    module, row = _fit(tiny_model, tmp_path, length)
    assert calls == [2 * G]
    rewards = [r.rewards for r in module._rollouts]
    assert len(rewards) == 2 and all(len(r) == G for r in rewards)
    assert [r.rewards_per_function["length"].tolist() for r in module._rollouts] == [r.tolist() for r in rewards]
    assert math.isclose(row["train/chars"], float(torch.cat(rewards).sum()), rel_tol=1e-6)


def _fake_sampling_logps(rows: int, width: int) -> torch.Tensor:
    i, j = torch.arange(rows).unsqueeze(1), torch.arange(width).unsqueeze(0)
    return -0.5 - 0.3 * ((i + j) % 4)


def test_the_steps_sampling_and_clip_metrics_are_trls(tiny_model, tmp_path):
    """With an engine's sampling log-probs (vLLM's importance-sampling correction; faked on the HF engine here) TRL
    computes sampling/* once over its generation batch, not as the mean of micro-batch means; and its log() averages
    the micro-batches' clip_ratio/low_min and high_max, NaNs left out, where esrl took their min (max) and a NaN."""
    recorded, calls = [], []

    class EngineLogprobs(L.Callback):
        def on_fit_start(self, trainer, module):
            module.importance_sampling = True
            generate = module.engine.generate

            def with_logprobs(*args, **kwargs):
                completions = generate(*args, **kwargs)
                first = not recorded and not calls
                calls.append(len(completions))
                for i, c in enumerate(completions):
                    if first:  # the first micro-batch's completions shorter: other token counts than the second's
                        c.token_ids, c.truncated = c.token_ids[:1 + i % 3], False
                    c.logprobs = _fake_sampling_logps(i + 1, len(c.token_ids))[i].tolist()
                return completions

            def set_stats(loss_fn, args, output):  # clip_ratio/low_min: no token of the second micro-batch counted
                k = len(recorded)
                output[1].update({"clip_ratio/low_min": torch.tensor([0.25, math.nan][k]),
                                  "clip_ratio/high_max": torch.tensor([0.5, 0.75][k])})
                recorded.append(k)

            module.engine.generate = with_logprobs
            module.loss_fn.register_forward_hook(set_stats)

    module, row = _fit(tiny_model, tmp_path, lambda prompts, completions, **_: [float(len(c)) for c in completions],
                       callbacks=[EngineLogprobs()], vllm_importance_sampling_mode="token_truncate")
    assert recorded == [0, 1] and calls == [G, G]
    assert row["train/clip_ratio/low_min"] == 0.25 and row["train/clip_ratio/high_max"] == 0.625
    deltas, ratios = [], []
    for r in module._rollouts:
        sampling = _fake_sampling_logps(*r.old_logps.shape)
        keep = r.completion_mask.bool()
        assert torch.allclose(r.is_ratio[keep], torch.exp(r.old_logps - sampling)[keep].clamp(max=3.0))
        deltas.append((r.old_logps - sampling).abs()[keep])
        ratios.append(r.is_ratio[keep])
    assert len({len(d) for d in deltas}) == 2  # micro-batches of other token counts: their means' mean is not TRL's
    for key, values in (("sampling_logp_difference", deltas), ("importance_sampling_ratio", ratios)):
        whole = torch.cat(values)
        assert math.isclose(row[f"train/sampling/{key}/mean"], float(whole.mean()), rel_tol=1e-6), key
        assert not math.isclose(float(whole.mean()), float(torch.stack([v.mean() for v in values]).mean()),
                                rel_tol=1e-4)
        assert math.isclose(row[f"train/sampling/{key}/max"], float(whole.max()), rel_tol=1e-6), key
    assert math.isclose(row["train/sampling/importance_sampling_ratio/min"], float(torch.cat(ratios).min()),
                        rel_tol=1e-6)
