"""esrl's GRPO against TRL 1.16's own code where one generation batch is split (gradient accumulation,
processes), with sequence-level importance sampling (GSPO), and with the vLLM importance-sampling correction.

Same tiny Llama, prompts and completions as test_grpo_parity. Several processes are simulated in one process:
the generation batch is cut into rank x micro-batch shards, TRL's `_compute_loss` runs on each shard with
`num_items_in_batch` as its `_generate_and_score_completions` gathers it (the whole generation batch, every
rank) and `accelerator.num_processes` patched to the simulated world size, and the gradients are summed over
shards and divided by the world size, as DDP's mean over ranks does. esrl's side is what GRPOModule does: the
whole window is rolled out first, so each micro-batch divides by the window's token count on every rank (each
micro-batch's count all-reduced, summed over the window), and Lightning divides the loss by accumulate_grad_batches;
nothing touches the gradients after the backwards.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
from test_grpo_parity import (G, MAX_COMPLETION_LENGTH, PROMPTS, REWARDS, T, TEMPERATURE,  # noqa: E402
                              TOL, _batch, _grads, _no_reward, _perturb, _trainer, tiny_dir)
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from esrl.errors import ConfigError  # noqa: E402
from esrl.grpo import LOSS_TYPES, GRPOConfig, GRPOLoss, group_advantages  # noqa: E402
from esrl.grpo.loss import GLOBAL_TOKEN_LOSSES  # noqa: E402
from esrl.grpo.importance import (  # noqa: E402
    engine_correction, importance_sampling_ratio, importance_sampling_values, sampling_stats)
from esrl.models.logps import per_token_logps  # noqa: E402
from esrl.rollout import EngineCapabilities  # noqa: E402

__all__ = ["tiny_dir"]  # the module-scoped fixture, shared with test_grpo_parity


def _models(tiny_dir: Path, trainer):
    """esrl's policy and frozen reference, equal to TRL's perturbed policy and its reference."""
    policy = LlamaForCausalLM.from_pretrained(tiny_dir)
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    policy.train()
    _perturb(policy)
    _perturb(trainer.model)
    return policy, ref


def _assert_same_grads(policy, trainer) -> None:
    ours, theirs = _grads(policy), _grads(trainer.model)
    assert ours.keys() == theirs.keys() and len(ours) > 0
    assert sum(g.abs().sum() for g in ours.values()) > 0
    for name, g in ours.items():
        diff = (g - theirs[name]).abs().max().item()
        assert diff <= TOL, f"{name}: max abs grad diff {diff:.2e}"


def _loss_fn(loss_type: str, beta: float, level: str = "token") -> GRPOLoss:
    return GRPOLoss(beta=beta, loss_type=loss_type, max_completion_length=MAX_COMPLETION_LENGTH,
                    importance_sampling_level=level)


def _trl_step(trainer, inputs: dict) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's loss on `inputs`, its backward done, and the metrics it recorded for them."""
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _logps(policy, ref, ids: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's per-token log-probs (with their graph) and the reference's."""
    logps = per_token_logps(policy, ids, attn, T, temperature=TEMPERATURE)
    with torch.no_grad():
        return logps, per_token_logps(ref, ids, attn, T, temperature=TEMPERATURE)


def _off_policy_inputs(tiny_dir: Path, trainer) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """The shared batch, off-policy: (batch, ids, attn, noise, TRL's inputs with old = current + noise and the
    reference log-probs, num_items_in_batch over the whole batch)."""
    batch = _batch(tiny_dir)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    noise = 0.3 * torch.randn(ids.shape[0], T, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        current, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, T)
        ref_logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, attn, T)
    inputs = {**batch, "advantages": group_advantages(REWARDS, G), "old_per_token_logps": current + noise,
              "ref_per_token_logps": ref_logps, "num_items_in_batch": batch["completion_mask"].sum()}
    return batch, ids, attn, noise, inputs


@pytest.mark.parametrize(("loss_type", "world", "micro_batches"), [
    *[(lt, 2, 2) for lt in LOSS_TYPES], ("dapo", 1, 2), ("dapo", 2, 1), ("bnpo", 1, 2)])
def test_split_generation_batch_matches_trl(tiny_dir: Path, tmp_path: Path, monkeypatch, loss_type: str,
                                            world: int, micro_batches: int) -> None:
    """8 rows cut into world x micro_batches shards of unequal token counts; off-policy, beta 0.04."""
    beta, P, A = 0.04, world, micro_batches
    trainer = _trainer(tiny_dir, tmp_path, _no_reward, loss_type=loss_type, beta=beta)
    trainer.current_gradient_accumulation_steps = A
    trainer.args.steps_per_generation = A  # TRL's default: one generation batch per optimizer step
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: P))
    policy, ref = _models(tiny_dir, trainer)

    batch, ids, attn, noise, full = _off_policy_inputs(tiny_dir, trainer)
    mask, advantages = batch["completion_mask"], full["advantages"]
    rows = ids.shape[0] // (P * A)
    shards = {(r, k): slice((r * A + k) * rows, (r * A + k + 1) * rows) for r in range(P) for k in range(A)}
    tokens = {rk: mask[s].sum() for rk, s in shards.items()}
    assert len(set(tokens.values())) > 1  # unequal shards, or the normalization would not matter

    trl_total = 0.0
    for s in shards.values():
        shard = {k: v if k == "num_items_in_batch" else v[s] for k, v in full.items()}
        loss = trainer.compute_loss(trainer.model, shard)
        (loss / P).backward()  # DDP: the mean of the ranks' gradients
        trl_total += loss.item() / P  # HF Trainer logs the window's summed losses, averaged over ranks

    loss_fn = _loss_fn(loss_type, beta)
    # GRPOModule.roll_out_window: each micro-batch's tokens all-reduced over ranks, summed over the window
    window_tokens = torch.stack([sum(tokens[r, k] for r in range(P)) for k in range(A)]).sum().float()
    num_items = window_tokens if loss_type in GLOBAL_TOKEN_LOSSES else None
    ours_total = 0.0
    for k in range(A):
        for r in range(P):
            s = shards[r, k]
            logps = per_token_logps(policy, ids[s], attn[s], T, temperature=TEMPERATURE)
            with torch.no_grad():
                ref_s = per_token_logps(ref, ids[s], attn[s], T, temperature=TEMPERATURE)
            loss, _ = loss_fn(logps, logps.detach() + noise[s], advantages[s], mask[s], ref_per_token_logps=ref_s,
                              num_items_in_batch=num_items, num_processes=P, accumulate_grad_batches=A)
            ours_total += loss.item() / A / P  # GRPOModule's train/loss (/ A), averaged over ranks
            (loss / A / P).backward()  # Lightning's / accumulate_grad_batches, then DDP's mean

    assert abs(ours_total - trl_total) <= TOL, (ours_total, trl_total)
    _assert_same_grads(policy, trainer)


@pytest.mark.parametrize("loss_type", ["grpo", "luspo", "dapo", "sapo"])
def test_sequence_level_importance_sampling_matches_trl(tiny_dir: Path, tmp_path: Path, loss_type: str) -> None:
    """GSPO (importance_sampling_level: sequence): off-policy, beta 0.04 (the KL takes the sequence weight)."""
    trainer = _trainer(tiny_dir, tmp_path, _no_reward, loss_type=loss_type, beta=0.04,
                       importance_sampling_level="sequence")
    policy, ref = _models(tiny_dir, trainer)
    batch, ids, attn, noise, inputs = _off_policy_inputs(tiny_dir, trainer)
    advantages = inputs["advantages"]
    trl_loss, metrics = _trl_step(trainer, inputs)
    logps, ref_ours = _logps(policy, ref, ids, attn)
    loss, stats = _loss_fn(loss_type, 0.04, "sequence")(logps, logps.detach() + noise, advantages,
                                                        batch["completion_mask"], ref_per_token_logps=ref_ours)
    loss.backward()
    assert abs(loss.item() - trl_loss.item()) <= TOL, (loss.item(), trl_loss.item())
    _assert_same_grads(policy, trainer)
    for key, value in stats.items():
        assert metrics[key] == pytest.approx(value.item(), abs=TOL, nan_ok=True), key


@pytest.mark.parametrize(("mode", "loss_type", "clip_min"), [
    ("token_truncate", "dapo", 0.5), ("token_mask", "vespo", None), ("sequence_truncate", "grpo", 0.5),
    ("sequence_mask", "dapo", None)])
def test_vllm_importance_sampling_matches_trl(tiny_dir: Path, tmp_path: Path, mode: str, loss_type: str,
                                              clip_min: float | None) -> None:
    """TRL's own rollout path (_generate_and_score_completions) with the engine's sampling log-probs given:
    vLLM cannot run here, so they come through TRL's `rollout_func` hook and `use_vllm` is switched on after
    construction (that flag alone gates TRL's correction). Ratio, sampling/* metrics, loss and gradients."""
    tok = PreTrainedTokenizerFast.from_pretrained(tiny_dir)
    batch = _batch(tiny_dir)
    lengths = batch["completion_mask"].sum(1).tolist()
    sampling_noise = torch.randn(len(lengths), T, generator=torch.Generator().manual_seed(5))
    given: dict[str, list[list[float]]] = {}

    def rollout_func(prompts, trainer):
        return {"prompt_ids": [tok(p)["input_ids"] for p in prompts],
                "completion_ids": [row[:n].tolist() for row, n in zip(batch["completion_ids"], lengths)],
                "logprobs": given["logprobs"]}

    def fixed_rewards(completions, **kwargs) -> list[float]:
        return REWARDS.tolist()

    from trl import GRPOConfig as TRLConfig, GRPOTrainer
    from datasets import Dataset
    args = TRLConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                     per_device_train_batch_size=len(PROMPTS) * G, num_generations=G,
                     max_completion_length=MAX_COMPLETION_LENGTH, temperature=TEMPERATURE, save_strategy="no",
                     logging_strategy="no", seed=0, loss_type=loss_type,
                     vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min)
    trainer = GRPOTrainer(model=str(tiny_dir), reward_funcs=fixed_rewards, args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), rollout_func=rollout_func)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.use_vllm = True
    trainer._last_loaded_step = trainer.state.global_step  # no weight sync: there is no vLLM to push to
    policy, _ = _models(tiny_dir, trainer)

    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        current, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, T)
    sampling = current + 0.8 * sampling_noise
    sampling[1, 0] = float("nan")  # a token the engine could not score: ratio 1, left out of the metrics
    given["logprobs"] = [[None if x != x else x for x in row[:n].tolist()] for row, n in zip(sampling, lengths)]
    out = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(G)])
    assert torch.equal(out["completion_ids"], batch["completion_ids"])
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    mask = batch["completion_mask"].float()
    ours_sampling = torch.where(mask.bool(), sampling, torch.zeros_like(sampling))  # GRPOModule pads with 0
    ratio = importance_sampling_ratio(out["old_per_token_logps"], ours_sampling, mask, mode, clip_min, 3.0)
    assert ratio.shape == out["importance_sampling_ratio"].shape
    assert torch.allclose(ratio, out["importance_sampling_ratio"], atol=1e-6, rtol=1e-5)
    raw = torch.exp(torch.nan_to_num((out["old_per_token_logps"] - ours_sampling) * mask, nan=0.0))
    if mode.startswith("sequence"):
        raw = raw.prod(-1, keepdim=True)
    assert not torch.allclose(ratio, raw)  # the truncation / mask changed some ratios
    stats = sampling_stats([importance_sampling_values(out["old_per_token_logps"], ours_sampling, mask, ratio, mode)])
    for key, value in stats.items():
        assert metrics[key] == pytest.approx(value.item(), abs=1e-5, rel=1e-5), key
    # esrl's window of two micro-batches, each corrected with its engine log-probs (NaN where none): sampling/* once
    # over both, as TRL over its one generation batch (not the mean of their means: other token counts)
    parts = [engine_correction(out["old_per_token_logps"][rows], [[math.nan if x is None else x for x in logprobs]
                                                                  for logprobs in given["logprobs"][rows]],
                               mask[rows], mode, clip_min, 3.0) for rows in (slice(0, G), slice(G, 2 * G))]
    assert torch.equal(torch.cat([part_ratio for part_ratio, _ in parts]), ratio)
    for key, value in sampling_stats([values for _, values in parts]).items():
        assert metrics[key] == pytest.approx(value.item(), abs=1e-5, rel=1e-5), key

    trl_loss = trainer.compute_loss(trainer.model, out)
    trl_loss.backward()
    logps = per_token_logps(policy, ids, attn, T, temperature=TEMPERATURE)
    loss, _ = _loss_fn(loss_type, 0.0)(logps, out["old_per_token_logps"], out["advantages"], mask,
                                       importance_sampling_ratio=ratio)
    loss.backward()
    assert abs(loss.item() - trl_loss.item()) <= TOL, (loss.item(), trl_loss.item())
    _assert_same_grads(policy, trainer)


def test_importance_sampling_needs_engine_logprobs() -> None:
    """An engine with its own weights and no sampling log-probs is refused naming the field; the HF engine
    (samples with the policy itself) needs no correction; vespo takes token modes only, as TRL."""
    caps = dict(shares_policy_weights=False, row_adapters=False, sleeps=False)
    with pytest.raises(ConfigError, match="model.grpo.vllm_importance_sampling_correction"):
        GRPOConfig().importance_sampling_applies(EngineCapabilities(**caps))
    assert GRPOConfig().importance_sampling_applies(EngineCapabilities(**caps, sampling_logprobs=True))
    assert not GRPOConfig(vllm_importance_sampling_correction=False).importance_sampling_applies(
        EngineCapabilities(**caps))
    assert not GRPOConfig().importance_sampling_applies(
        EngineCapabilities(shares_policy_weights=True, row_adapters=False, sleeps=False))
    with pytest.raises(ConfigError, match="model.grpo.vllm_importance_sampling_mode"):
        GRPOConfig(loss_type="vespo").importance_sampling_applies(EngineCapabilities(**caps, sampling_logprobs=True))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_trl_warnings_for_advised_against_combinations(loss_type: str, level: str) -> None:
    """TRL 1.16 warns (GRPOTrainer.__init__) for luspo at token level, vespo at sequence level, and sequence level
    with the token-summing bnpo, dr_grpo, dapo, cispo; esrl warns for exactly those."""
    expected = ((loss_type == "luspo" and level == "token") or (loss_type == "vespo" and level == "sequence")
                or (level == "sequence" and loss_type in ("bnpo", "dr_grpo", "dapo", "cispo")))
    warnings = GRPOConfig(loss_type=loss_type, importance_sampling_level=level).trl_warnings()
    assert len(warnings) == int(expected), warnings


EQUAL_GROUP = torch.tensor([1.0, 0.0, 0.5, 2.0, 3.0, 3.0, 3.0, 3.0])  # second group all equal: advantages 0


@pytest.mark.parametrize(("loss_type", "config", "rewards"), [
    ("dapo", dict(epsilon_high=0.28), REWARDS),
    ("grpo", dict(epsilon=0.1, epsilon_high=0.3), REWARDS),
    ("dapo", dict(delta=1.5), REWARDS),
    ("cispo", dict(epsilon_high=5.0), REWARDS),
    ("vespo", dict(), EQUAL_GROUP),
], ids=["dapo-eps_high", "grpo-eps_asym", "dapo-delta", "cispo-eps5", "vespo-zero_adv"])
def test_non_default_hyperparameters_match_trl(tiny_dir, tmp_path, loss_type, config, rewards):
    """Loss, gradients and metrics at the settings the other parity tests leave at their defaults: DAPO's clip
    higher, asymmetric bounds, delta's cap, CISPO's recommended cap (its ratio then reaches the gradient unless
    detached) and VESPO with zero-advantage rows (TRL gives them the positive side's weight). A mutation of each
    passed the suite before (session 33's review)."""
    beta = 0.04
    trainer = _trainer(tiny_dir, tmp_path, _no_reward, loss_type=loss_type, beta=beta, **config)
    policy, ref = _models(tiny_dir, trainer)
    batch, ids, attn, noise, inputs = _off_policy_inputs(tiny_dir, trainer)
    inputs["advantages"] = advantages = group_advantages(rewards, G)
    trl_loss, metrics = _trl_step(trainer, inputs)
    logps, ref_ours = _logps(policy, ref, ids, attn)
    grpo = GRPOConfig(loss_type=loss_type, beta=beta, epsilon_low=config.get("epsilon", 0.2),
                      epsilon_high=config.get("epsilon_high"), delta=config.get("delta"))
    loss_fn = GRPOLoss.from_config(grpo, MAX_COMPLETION_LENGTH)  # the config's path to the loss, as a fit takes it
    loss, stats = loss_fn(logps, logps.detach() + noise, advantages, batch["completion_mask"],
                          ref_per_token_logps=ref_ours)
    loss.backward()
    assert abs(loss.item() - trl_loss.item()) <= TOL, (loss.item(), trl_loss.item())
    _assert_same_grads(policy, trainer)
    for key, value in stats.items():
        assert metrics[key] == pytest.approx(value.item(), abs=TOL, nan_ok=True), key
