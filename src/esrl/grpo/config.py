"""GRPO hyperparameters (the `model.grpo` section); defaults are TRL 1.16's GRPOConfig ones where they apply.

Sampling settings (temperature, top_p, max_new_tokens = TRL's max_completion_length) live in `model.rollout`,
shared with ES and evaluation (max_new_tokens: 128, the ES paper's, not TRL's 512); prompts per step in
`data.prompts_per_step`; gradient accumulation and clipping in `trainer` (accumulate_grad_batches,
gradient_clip_val), as for any Lightning module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from esrl.errors import require, require_finite
from esrl.models.lora import GRPO_FIELDS, LoraOptions, validate_options
from esrl.grpo.importance import IMPORTANCE_SAMPLING_MODES
from esrl.grpo.objectives import IMPORTANCE_SAMPLING_LEVELS
from esrl.grpo.reductions import LOSS_TYPES
from esrl.rollout.base import EngineCapabilities

SCALE_REWARDS = ("group", "batch", "none")
LR_SCHEDULERS = ("linear", "constant", "constant_with_warmup")


@dataclass
class GRPOConfig:
    """Group Relative Policy Optimization settings (the `model.grpo` section of a config)."""

    num_generations: int = 8
    """G, completions sampled per prompt; advantages compare completions of one prompt (TRL: 8). Must be >=
    2."""
    beta: float = 0.0
    """Coefficient of the k3 KL penalty to the frozen reference model. TRL 1.16's default 0.0 skips the
    reference model (no second copy in memory, faster steps); the original GRPO and public baselines use 0.04
    or 0.01, DeepSeek-R1 0.001. A reference copy is loaded only when beta > 0."""
    epsilon_low: float = 0.2
    """Lower clipping bound of the ratio: 1 - epsilon_low (TRL's `epsilon`)."""
    epsilon_high: float | None = None
    """Upper clipping bound of the ratio: 1 + epsilon_high; None uses epsilon_low (DAPO recommends 0.28)."""
    delta: float | None = None
    """INTELLECT-2 two-sided clipping: caps the unclipped ratio at delta (None: off; use > 1 +
    epsilon_high)."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = "dapo"
    """Loss formulation, as TRL 1.16: `dapo` (TRL default; clipped, sum over the active tokens of the whole
    generation batch, every micro-batch of the optimizer step and every process, / their count), `bnpo` (clipped,
    / the active tokens of this micro-batch), `dr_grpo` (clipped, sum / (batch * rollout.max_new_tokens)),
    `grpo` (clipped, mean of per-sequence means, length-biased), `cispo` (MiniMax-M1: clips the detached
    importance weight at epsilon_high itself, times advantage and log-prob; normalized as dapo), `sapo` (a
    smooth temperature gate instead of the clip, see sapo_temperature_*; aggregated as grpo), `luspo` (clipped,
    each sequence's sum weighted by its length; meant with importance_sampling_level: sequence), `vespo`
    (a gamma weight of the sequence importance ratio, see vespo_*; normalized as dapo)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Importance ratios per `token` (TRL default) or one per `sequence`, the exp of the mean per-token
    log-ratio over its completion tokens (GSPO; use with loss_type grpo, or luspo)."""
    sapo_temperature_neg: float = 1.05
    """loss_type sapo: gate temperature for tokens with non-positive advantage (TRL default 1.05)."""
    sapo_temperature_pos: float = 1.0
    """loss_type sapo: gate temperature for tokens with positive advantage (TRL default 1.0)."""
    vespo_k_pos: float = 2.0
    """loss_type vespo: power exponent k for positive advantages: how hard low importance weights are
    down-weighted (TRL default 2.0)."""
    vespo_lambda_pos: float = 3.0
    """loss_type vespo: decay lambda for positive advantages: how hard high importance weights are
    down-weighted (TRL default 3.0)."""
    vespo_k_neg: float = 3.0
    """loss_type vespo: power exponent k for negative advantages (TRL default 3.0)."""
    vespo_lambda_neg: float = 2.0
    """loss_type vespo: decay lambda for negative advantages (TRL default 2.0)."""
    vllm_importance_sampling_correction: bool = True
    """rollout.engine vllm: reweight the loss by pi_trainer / pi_vllm, the ratio of the trainer's log-probs of
    the sampled tokens (computed once per rollout, before any update) to the engine's sampling log-probs, to
    correct their mismatch (TRL default True). Engines that sample with the policy itself (hf) need no
    correction and ignore it; an engine with its own weights that returns no log-probs is refused."""
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate",
                                           "sequence_mask"] = "sequence_mask"
    """How the correction is applied (TRL default sequence_mask): `token_truncate` (per-token ratios clipped
    to [clip_min, clip_max]), `token_mask` (per-token ratios outside it set to 0), `sequence_truncate` (one
    ratio per sequence, the product over its tokens, clipped), `sequence_mask` (sequences whose ratio is
    outside it left out). loss_type vespo takes token modes only."""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """Upper bound C_max of the importance ratio (TRL default 3.0; TRL's deprecated name for it:
    vllm_importance_sampling_cap); None: no upper bound."""
    vllm_importance_sampling_clip_min: float | None = None
    """Lower bound C_min of the importance ratio (TRL default None: no lower bound)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage scaling: (r - group mean) / (std + 1e-4) with the group's std, the batch's std, or `none`
    (Dr. GRPO)."""
    mask_truncated_completions: bool = False
    """Leave completions that hit rollout.max_new_tokens out of the loss (DAPO's recommendation)."""
    use_bias_correction_kl: bool = True
    """Multiply the k3 KL term by the importance ratio (TRL 1.16 default; changes the KL gradient when beta >
    0)."""
    num_iterations: int = 1
    """mu, optimizer steps on one rollout batch (TRL's num_iterations). Above 1 the old log-probs are computed
    once, before the first of them, and the clipped ratio matters. The batches the data loader hands over
    during the extra steps are not rolled out (their prompts are skipped this epoch)."""
    learning_rate: float = 1e-6
    """AdamW learning rate (TRL's GRPO default). Ignored when `--optimizer` is given on the command line."""
    weight_decay: float = 0.0
    """AdamW weight decay (TRL default)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon."""
    lr_scheduler: Literal["linear", "constant", "constant_with_warmup"] = "linear"
    """Learning-rate schedule of the default optimizer, transformers' of the same name: `linear` decay to 0 at the
    last step after warmup (TRL default), `constant` (no warmup), or `constant_with_warmup`. Ignored when
    `--optimizer` or `--lr_scheduler` is given (the CLI's schedule, or none, replaces it)."""
    warmup_ratio: float = 0.0
    """Fraction of the training steps with linear warmup from 0 (TRL's default 0, its `warmup_steps` below 1 since
    transformers 5), for `linear` and `constant_with_warmup`; `constant` takes none (refused, where transformers
    ignores it)."""
    max_grad_norm: float | None = 1.0
    """Gradient-norm clipping (TRL default 1.0), applied as `trainer.gradient_clip_val` when the trainer sets
    none; the trainer's value wins. With DeepSpeed set `trainer.gradient_clip_val` itself. None: no
    clipping."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory (TRL defaults to True; on CPU and for small
    models it only costs time)."""
    lora: LoraOptions | None = None
    """Train a PEFT LoRA adapter instead of every weight: {rank, alpha, target_modules, layers, init}, ES lora's
    options (model.es.lora_rank, ...). The base weights stay frozen and only the adapter's get the optimizer; the
    adapter starts as the identity (B = 0), seeded by `seed`. Saved in PEFT format under final/adapter/, with the
    merged model in final/. With beta > 0 the reference is the base itself, the policy with its adapter
    disabled (no second copy); on vLLM the engine keeps the base weights and gets the adapter after every step.
    Not under DeepSpeed ZeRO-3. None (default): full fine-tuning."""
    seed: int | None = None
    """Seed of the sampling; None takes the run's seed_everything value. Step t, micro-batch k and rank r
    sample with a seed derived from (seed, t, k, r), so a run repeats exactly on CPU."""

    def validate(self) -> None:
        """Called when the module is built, so a bad value is one line naming its field."""
        require_finite(self, "model.grpo")
        require(self.num_generations >= 2, "model.grpo.num_generations",
                f"must be >= 2 (advantages compare completions of one prompt), got {self.num_generations}")
        require(self.beta >= 0, "model.grpo.beta", f"must be >= 0, got {self.beta}")
        require(0 <= self.epsilon_low < 1, "model.grpo.epsilon_low",
                f"must be in [0, 1), got {self.epsilon_low}")
        require(self.epsilon_high is None or self.epsilon_high >= 0, "model.grpo.epsilon_high",
                f"must be >= 0 or null, got {self.epsilon_high}")
        require(self.delta is None or self.delta > 1, "model.grpo.delta",
                f"must be > 1 or null, got {self.delta}")
        require(self.loss_type in LOSS_TYPES, "model.grpo.loss_type",
                f"unknown {self.loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
        require(self.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS, "model.grpo.importance_sampling_level",
                f"unknown {self.importance_sampling_level!r}; choose one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}")
        require(self.sapo_temperature_neg > 0 and self.sapo_temperature_pos > 0, "model.grpo.sapo_temperature_*",
                f"must be > 0, got {self.sapo_temperature_neg} and {self.sapo_temperature_pos}")
        require(self.vllm_importance_sampling_mode in IMPORTANCE_SAMPLING_MODES,
                "model.grpo.vllm_importance_sampling_mode",
                f"unknown {self.vllm_importance_sampling_mode!r}; choose one of {', '.join(IMPORTANCE_SAMPLING_MODES)}")
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        require(lo is None or hi is None or lo < hi, "model.grpo.vllm_importance_sampling_clip_min",
                f"must be < vllm_importance_sampling_clip_max ({hi}), got {lo}")
        require(not (self.vllm_importance_sampling_correction and self.vllm_importance_sampling_mode.endswith(
            "_truncate") and lo is None and hi is None), "model.grpo.vllm_importance_sampling_clip_max",
            "a *_truncate vllm_importance_sampling_mode needs clip_max or clip_min")
        require(self.scale_rewards in SCALE_REWARDS, "model.grpo.scale_rewards",
                f"unknown {self.scale_rewards!r}; choose one of {', '.join(SCALE_REWARDS)}")
        require(self.num_iterations >= 1, "model.grpo.num_iterations",
                f"must be >= 1, got {self.num_iterations}")
        require(self.learning_rate > 0, "model.grpo.learning_rate", f"must be > 0, got {self.learning_rate}")
        require(self.weight_decay >= 0, "model.grpo.weight_decay", f"must be >= 0, got {self.weight_decay}")
        require(0 <= self.adam_beta1 < 1, "model.grpo.adam_beta1",
                f"must be in [0, 1), got {self.adam_beta1}")
        require(0 <= self.adam_beta2 < 1, "model.grpo.adam_beta2",
                f"must be in [0, 1), got {self.adam_beta2}")
        require(self.adam_epsilon > 0, "model.grpo.adam_epsilon", f"must be > 0, got {self.adam_epsilon}")
        require(self.lr_scheduler in LR_SCHEDULERS, "model.grpo.lr_scheduler",
                f"unknown {self.lr_scheduler!r}; choose one of {', '.join(LR_SCHEDULERS)}")
        require(0 <= self.warmup_ratio < 1, "model.grpo.warmup_ratio",
                f"must be in [0, 1), got {self.warmup_ratio}")
        require(self.lr_scheduler != "constant" or self.warmup_ratio == 0, "model.grpo.warmup_ratio",
                f"{self.warmup_ratio} with lr_scheduler constant, which has no warmup (transformers ignores it): "
                "use lr_scheduler constant_with_warmup")
        require(self.max_grad_norm is None or self.max_grad_norm > 0, "model.grpo.max_grad_norm",
                f"must be > 0 or null, got {self.max_grad_norm}")
        if self.lora is not None:
            validate_options(self.lora, GRPO_FIELDS)

    def trl_warnings(self) -> list[str]:
        """TRL 1.16's warnings for combinations it allows but advises against (GRPOTrainer.__init__)."""
        warnings = []
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            warnings.append("model.grpo.loss_type luspo: set importance_sampling_level: sequence to mirror the "
                            "paper's setup (TRL's warning)")
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            warnings.append("model.grpo.loss_type vespo computes sequence-level importance weights itself; "
                            "importance_sampling_level should be token (TRL's warning)")
        if self.importance_sampling_level == "sequence" and self.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            warnings.append(f"model.grpo.importance_sampling_level sequence with loss_type {self.loss_type} sums "
                            "per-token terms, which weights each sequence by its length; GSPO's setup is "
                            "loss_type grpo (TRL's warning)")
        return warnings

    def importance_sampling_applies(self, capabilities: EngineCapabilities) -> bool:
        """Whether the vLLM importance-sampling correction runs on this engine: only on one that samples with its
        own copy of the weights. Such an engine without sampling log-probs, or vespo with a sequence mode, is
        one line naming the field, before any model loads."""
        if not self.vllm_importance_sampling_correction or capabilities.shares_policy_weights:
            return False
        require(capabilities.sampling_logprobs, "model.grpo.vllm_importance_sampling_correction",
                "this rollout engine samples with its own weights but returns no sampling log-probs; set it false")
        require(self.loss_type != "vespo" or self.vllm_importance_sampling_mode.startswith("token_"),
                "model.grpo.vllm_importance_sampling_mode", "loss_type vespo needs token_truncate or token_mask "
                f"(as TRL), got {self.vllm_importance_sampling_mode}")
        return True
