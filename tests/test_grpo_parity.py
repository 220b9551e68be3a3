"""esrl's GRPO math against TRL 1.16's real GRPOTrainer, on a tiny random Llama with a local char tokenizer.

Both sides start from the same saved weights (perturbed the same way, so the policy differs from the
reference) and see the same prompts, completions and advantages; each computes its own log-probs (and
reference log-probs) and loss, then backprops. Loss and every gradient must agree to 1e-5. One process, CPU,
no hub.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from esrl.grpo import LOSS_TYPES, GRPOLoss, group_advantages  # noqa: E402
from esrl.grpo.loss import CLIPPED_LOSSES  # noqa: E402
from esrl.models.logps import per_token_logps  # noqa: E402

TOL = 1e-5
G = 4  # generations per prompt
T = 6  # completion width in the batch
MAX_COMPLETION_LENGTH = 8  # config value: dr_grpo divides by it, not by T
TEMPERATURE = 0.7  # != 1 so the temperature scaling is covered too
PROMPTS = ["what is 2+2?", "say hi"]
REWARDS = torch.tensor([1.0, 0.0, 0.5, 2.0, 3.0, 3.0, 1.0, 0.0])
COMPLETION_LENGTHS = [6, 3, 5, 1, 6, 4, 2, 6]  # 6 = truncated (no eos), else eos-terminated then right-padded


def _char_tokenizer() -> PreTrainedTokenizerFast:
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 .,?!+-=")
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *chars])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama (hidden 32) and its tokenizer, saved where TRL can load them offline."""
    out = tmp_path_factory.mktemp("tiny_llama")
    tok = _char_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _perturb(model: torch.nn.Module, seed: int = 1, scale: float = 0.02) -> None:
    """Move the policy away from the saved weights (= the reference), identically on both sides."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(scale * torch.randn(p.shape, generator=gen))


def _trainer(tiny_dir: Path, tmp_path: Path, reward_fn, **config) -> GRPOTrainer:
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                      per_device_train_batch_size=len(PROMPTS) * G, num_generations=G,
                      max_completion_length=MAX_COMPLETION_LENGTH, temperature=TEMPERATURE,
                      gradient_checkpointing=False, save_strategy="no", logging_strategy="no", seed=0,
                      **config)
    trainer = GRPOTrainer(model=str(tiny_dir), reward_funcs=reward_fn, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          processing_class=PreTrainedTokenizerFast.from_pretrained(tiny_dir))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop, which we do not run
    return trainer


def _batch(tiny_dir: Path) -> dict[str, torch.Tensor]:
    """Left-padded prompts (each repeated G times) and right-padded completions of mixed lengths."""
    tok = PreTrainedTokenizerFast.from_pretrained(tiny_dir)
    enc = tok(PROMPTS, padding=True, return_tensors="pt")
    gen = torch.Generator().manual_seed(2)
    completion_ids = torch.full((len(COMPLETION_LENGTHS), T), tok.pad_token_id)
    completion_mask = torch.zeros_like(completion_ids)
    for i, n in enumerate(COMPLETION_LENGTHS):
        completion_ids[i, :n] = torch.randint(3, len(tok), (n,), generator=gen)
        if n < T:
            completion_ids[i, n - 1] = tok.eos_token_id
        completion_mask[i, :n] = 1
    return {"prompt_ids": enc.input_ids.repeat_interleave(G, 0),
            "prompt_mask": enc.attention_mask.repeat_interleave(G, 0),
            "completion_ids": completion_ids, "completion_mask": completion_mask}


def _no_reward(completions, **kwargs) -> list[float]:
    return [0.0] * len(completions)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("off_policy", [False, True], ids=["on_policy", "off_policy"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_grads_match_trl(tiny_dir: Path, tmp_path: Path, loss_type: str, beta: float,
                                  off_policy: bool) -> None:
    trainer = _trainer(tiny_dir, tmp_path, _no_reward, loss_type=loss_type, beta=beta)
    assert (trainer.ref_model is not None) == (beta != 0.0)

    # esrl side: same saved weights, same perturbation; the reference is a frozen copy of the saved weights.
    policy = LlamaForCausalLM.from_pretrained(tiny_dir)
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    policy.train()
    _perturb(policy)
    _perturb(trainer.model)
    for (n, a), (_, b) in zip(sorted(policy.named_parameters()), sorted(trainer.model.named_parameters())):
        assert torch.equal(a, b), n

    batch = _batch(tiny_dir)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    advantages = group_advantages(REWARDS, G)
    # old log-probs = current + noise, which drives ratios past 1 +- epsilon on both sides
    noise = 0.3 * torch.randn(ids.shape[0], T, generator=torch.Generator().manual_seed(3))

    # TRL: the inputs its _generate_and_score_completions would hand to compute_loss.
    inputs = {**batch, "advantages": advantages, "num_items_in_batch": batch["completion_mask"].sum()}
    with torch.no_grad():
        if off_policy:
            current, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, T)
            inputs["old_per_token_logps"] = current + noise
        if beta != 0.0:
            inputs["ref_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.ref_model, ids, attn, T)
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    trl_loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    # esrl
    logps = per_token_logps(policy, ids, attn, T, temperature=TEMPERATURE)
    with torch.no_grad():
        old = logps.detach() + noise if off_policy else None
        ref_logps = per_token_logps(ref, ids, attn, T, temperature=TEMPERATURE) if beta != 0.0 else None
    loss_fn = GRPOLoss(beta=beta, loss_type=loss_type, max_completion_length=MAX_COMPLETION_LENGTH)
    loss, stats = loss_fn(logps, old, advantages, batch["completion_mask"], ref_per_token_logps=ref_logps)
    loss.backward()

    assert abs(loss.item() - trl_loss.item()) <= TOL, (loss.item(), trl_loss.item())
    ours, theirs = _grads(policy), _grads(trainer.model)
    assert ours.keys() == theirs.keys() and len(ours) > 0
    assert sum(g.abs().sum() for g in ours.values()) > 0  # a zero gradient would make the comparison vacuous
    for name, g in ours.items():
        diff = (g - theirs[name]).abs().max().item()
        assert diff <= TOL, f"{name}: max abs grad diff {diff:.2e}"

    for key, value in stats.items():  # TRL logs the same quantities (one process: global == local)
        assert metrics[key] == pytest.approx(value.item(), abs=TOL, nan_ok=True), key
    assert ("kl" in stats) == (beta != 0.0)
    if beta != 0.0:
        assert stats["kl"].item() > 0
    assert ("cispo_clip_ratio" in stats) == (loss_type == "cispo")
    assert ("vespo/phi_seq_mean" in stats) == (loss_type == "vespo")
    if loss_type not in CLIPPED_LOSSES:
        assert "clip_ratio/region_mean" not in stats
    elif off_policy:  # the clipped branch is exercised on both sides of the ratio
        assert stats["clip_ratio/low_mean"].item() > 0 and stats["clip_ratio/high_mean"].item() > 0
    else:
        assert stats["clip_ratio/region_mean"].item() == 0


def test_per_token_logps_match_trl(tiny_dir: Path, tmp_path: Path) -> None:
    """Values (0 at padded completion positions, like TRL's fused head) and gradients of per_token_logps."""
    trainer = _trainer(tiny_dir, tmp_path, _no_reward)
    policy = LlamaForCausalLM.from_pretrained(tiny_dir).train()
    batch = _batch(tiny_dir)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    weights = torch.randn(ids.shape[0], T, generator=torch.Generator().manual_seed(4))

    theirs, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, T)
    ours = per_token_logps(policy, ids, attn, T, temperature=TEMPERATURE)
    assert (ours - theirs).abs().max().item() <= TOL
    assert torch.all(ours[batch["completion_mask"] == 0] == 0)
    (theirs * weights).sum().backward()
    (ours * weights).sum().backward()
    theirs_grads = _grads(trainer.model)
    for name, g in _grads(policy).items():
        assert (g - theirs_grads[name]).abs().max().item() <= TOL, name


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_trl(tiny_dir: Path, tmp_path: Path, scale: str) -> None:
    """TRL's rollout path (generate, score, normalize) gives group_advantages' numbers for the same rewards.

    The second group is all-equal (zero std); one completion is unscorable (None -> NaN -> advantage 0).
    """
    rewards = [1.0, None, 0.5, 2.0, 3.0, 3.0, 3.0, 3.0]

    def fixed_rewards(completions, **kwargs) -> list[float | None]:
        return rewards

    trainer = _trainer(tiny_dir, tmp_path, fixed_rewards, scale_rewards=scale)
    out = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(G)])
    ours = group_advantages(torch.tensor([float("nan") if r is None else r for r in rewards]), G, scale)
    assert torch.allclose(ours, out["advantages"], atol=1e-6, rtol=0), (ours, out["advantages"])
    assert torch.isfinite(ours).all() and ours[1] == 0 and torch.all(ours[G:] == 0)


@pytest.mark.parametrize("empty_second", [False, True], ids=["tokens", "no_tokens"])
def test_a_steps_loss_metrics_are_trls_log_over_its_micro_batches(tiny_dir: Path, tmp_path: Path,
                                                                  empty_second: bool) -> None:
    """An optimizer step of two micro-batches: TRL records each loss metric once a micro-batch and its own log()
    averages them, NaNs left out. esrl's loss_metrics logs those numbers: clip_ratio/low_min and high_max are not the
    min / max over micro-batches, and a micro-batch without loss tokens (every completion masked: NaN there) does not
    make them NaN."""
    from esrl.grpo.step_metrics import loss_metrics

    trainer = _trainer(tiny_dir, tmp_path, _no_reward, loss_type="dapo", beta=0.04)
    trainer.current_gradient_accumulation_steps = 2
    policy = LlamaForCausalLM.from_pretrained(tiny_dir).train()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    batch = _batch(tiny_dir)
    if empty_second:  # e.g. mask_truncated_completions with every completion of the second micro-batch truncated
        batch["completion_mask"][len(REWARDS) // 2:] = 0
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    advantages = group_advantages(REWARDS, G)
    noise = 0.5 * torch.randn(ids.shape[0], T, generator=torch.Generator().manual_seed(3))
    stats = []
    for rows in (slice(0, G), slice(G, 2 * G)):  # one prompt's G completions a micro-batch
        part = {k: v[rows] for k, v in batch.items()}
        with torch.no_grad():
            current, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids[rows], attn[rows], T)
            ref_trl, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids[rows], attn[rows], T)
        trainer.compute_loss(trainer.model, {**part, "advantages": advantages[rows], "ref_per_token_logps": ref_trl,
                                             "old_per_token_logps": current + noise[rows],
                                             "num_items_in_batch": batch["completion_mask"].sum()})
        logps, entropies = per_token_logps(policy, ids[rows], attn[rows], T, TEMPERATURE, True)
        with torch.no_grad():
            ref_ours = per_token_logps(ref, ids[rows], attn[rows], T, temperature=TEMPERATURE)
        _, mb_stats = GRPOLoss(beta=0.04, loss_type="dapo")(logps, logps.detach() + noise[rows], advantages[rows],
                                                             part["completion_mask"], ref_per_token_logps=ref_ours,
                                                             entropies=entropies)
        stats.append(mb_stats)
    recorded = {k: list(v) for k, v in trainer._metrics["train"].items()}
    trainer.log({})  # TRL's own reduction of the step's recorded values
    logged = trainer.state.log_history[-1]

    ours = loss_metrics(stats)
    assert {"clip_ratio/low_min", "clip_ratio/high_max", "entropy", "kl"} <= stats[0].keys()
    for key in stats[0]:
        assert ours[f"train/{key}"] == pytest.approx(logged[key], abs=TOL), (key, recorded[key])
    if empty_second:
        assert math.isnan(recorded["clip_ratio/high_max"][1])
    else:  # the two micro-batches differ, so the min / max over them would not be TRL's number
        assert recorded["clip_ratio/high_max"][0] != recorded["clip_ratio/high_max"][1]


def test_a_steps_min_max_metrics_take_each_micro_batch_over_processes_first() -> None:
    """With several processes TRL takes each micro-batch's min of mins (max of maxes, NaNs left out: trl's nanmin,
    nanmax) over processes, then averages the micro-batches: loss_metrics does, given every process's values."""
    from trl.trainer.utils import nanmax, nanmin

    from esrl.grpo.step_metrics import loss_metrics

    nan = float("nan")
    low = torch.tensor([[0.1, nan, 0.5], [0.3, nan, 0.2]])  # [process, micro-batch]
    high = torch.tensor([[0.9, 0.4, nan], [0.6, nan, nan]])
    per_process = [[{"clip_ratio/low_min": low[p, k], "clip_ratio/high_max": high[p, k]} for k in range(3)]
                   for p in range(2)]
    sent = []  # what process 1 hands to the gather
    loss_metrics(per_process[1], lambda local: sent.append(local) or local.unsqueeze(0))
    ours = loss_metrics(per_process[0], lambda local: torch.stack([local, sent[0]]))

    def trl_log(values: list[float]) -> float:
        valid = [v for v in values if not math.isnan(v)]
        return sum(valid) / len(valid)

    assert ours["train/clip_ratio/low_min"] == pytest.approx(trl_log([nanmin(low[:, k]).item() for k in range(3)]))
    assert ours["train/clip_ratio/high_max"] == pytest.approx(trl_log([nanmax(high[:, k]).item() for k in range(3)]))


@pytest.mark.parametrize("delta", [None, 1.1], ids=["no_delta", "delta"])
def test_token_mean_metrics_pool_every_process_tokens_as_trl(tiny_dir: Path, tmp_path: Path, delta) -> None:
    """Two processes with 10 and 23 loss tokens: TRL's token means (kl, entropy, clip ratios) sum each process's
    numerator and count before dividing (global_masked_mean), so a token weighs the same on either; a mean of the
    two processes' means does not. TRL's compute_loss runs as rank 0 with its accelerator's reduce and gather
    answering rank 1's recorded values. With delta (two-sided clipping) at or below 1 + epsilon_high, TRL counts high
    clipping on the capped ratio (none)."""
    from esrl.grpo.step_metrics import loss_metrics

    trainer = _trainer(tiny_dir, tmp_path, _no_reward, loss_type="dapo", beta=0.04, delta=delta)
    policy = LlamaForCausalLM.from_pretrained(tiny_dir)
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    _perturb(policy)
    _perturb(trainer.model)
    batch = _batch(tiny_dir)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    advantages = group_advantages(REWARDS, G)
    noise = 0.3 * torch.randn(ids.shape[0], T, generator=torch.Generator().manual_seed(3))
    shards = [torch.tensor([1, 3, 5, 6]), torch.tensor([0, 2, 4, 7])]  # rank 0, rank 1
    assert [int(batch["completion_mask"][s].sum()) for s in shards] == [10, 23]

    def trl_inputs(rows):
        with torch.no_grad():
            current, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids[rows], attn[rows], T)
            ref_trl, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids[rows], attn[rows], T)
        return {**{k: v[rows] for k, v in batch.items()}, "advantages": advantages[rows],
                "old_per_token_logps": current + noise[rows], "ref_per_token_logps": ref_trl,
                "num_items_in_batch": batch["completion_mask"].sum()}

    accelerator, reduced, gathered = trainer.accelerator, [], []
    accelerator.reduce = lambda t, reduction="sum": reduced.append(t.detach().clone()) or t
    accelerator.gather = lambda t: gathered.append(t.detach().clone()) or t
    with torch.no_grad():
        trainer.compute_loss(trainer.model, trl_inputs(shards[1]))  # rank 1: what it hands to the collectives
    trainer._metrics["train"].clear()
    from_rank_1, gathered_1 = iter(reduced), iter(gathered)
    accelerator.reduce = lambda t, reduction="sum": t + next(from_rank_1)
    accelerator.gather = lambda t: torch.cat([t, next(gathered_1)])
    with torch.no_grad():
        trainer.compute_loss(trainer.model, trl_inputs(shards[0]))
    theirs = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    stats = []
    for rows in shards:
        logps, entropies = per_token_logps(policy, ids[rows], attn[rows], T, TEMPERATURE, True)
        with torch.no_grad():
            ref_ours = per_token_logps(ref, ids[rows], attn[rows], T, temperature=TEMPERATURE)
            stats.append(GRPOLoss(beta=0.04, loss_type="dapo", delta=delta)(
                logps, logps.detach() + noise[rows], advantages[rows], batch["completion_mask"][rows],
                ref_per_token_logps=ref_ours, entropies=entropies)[1])
    sent = []
    loss_metrics([stats[1]], lambda local: sent.append(local) or local.unsqueeze(0))
    ours = loss_metrics([stats[0]], lambda local: torch.stack([local, sent[0]]))
    assert {"kl", "entropy", "clip_ratio/high_mean", "clip_ratio/low_mean"} <= stats[0].keys()
    for key in stats[0]:
        assert ours[f"train/{key}"] == pytest.approx(theirs[key], abs=TOL), key
    means = [s["clip_ratio/region_mean"].item() for s in stats]
    assert ours["train/clip_ratio/region_mean"] != pytest.approx(sum(means) / 2, abs=1e-3)  # the counts matter here
    if delta is not None:
        assert ours["train/clip_ratio/high_mean"] == 0 and ours["train/clip_ratio/high_max"] == 0
