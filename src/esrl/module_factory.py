"""One config describes both algorithms; `algo` picks which module trains."""

from __future__ import annotations

from typing import Any, Literal

from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from esrl.errors import ConfigError
from esrl.es.config import ESConfig
from esrl.grpo.config import GRPOConfig
from esrl.policy import PolicyConfig, PolicyModule
from esrl.rollout import RolloutConfig


GRPO_STRATEGIES = ("auto", "ddp", "ddp_spawn", None)
"""Strategies ES replaces with its own silently: Lightning's default and data-parallel ones."""
MIXED = ("16-mixed", "bf16-mixed", "16", "bf16")
"""Mixed precisions (with their short names), which a GRPO config takes for fp32 master weights under bf16 compute:
ES has no backward to autocast, and fp16's loss scaling would rescale its gradient, so ES computes in the weights'
own dtype (model.policy.dtype) instead."""
ES_REPLACES = ("ddp", "deepspeed", "fsdp", "single_device")
"""Prefixes of the strategy names ES replaces with a note: other DDP launchers, and the sharding ones of a GRPO
config (ES has no gradients or optimizer states to shard, and sharded weights could not be perturbed in place)."""


def strategy_name(strategy: Any) -> str | None:
    """A trainer.strategy as written: its name, or the class path of a `class_path` form."""
    if strategy is None or isinstance(strategy, str):
        return strategy
    return str(getattr(strategy, "class_path", strategy))


def fit_trainer_to_algo(algo: str, trainer: Any) -> list[str]:
    """Adapt the `trainer` section (a namespace) to `algo`, so that one config runs both algorithms with `--algo`.

    ES runs on its own strategy (no gradient all-reduce, unsharded prompts): Lightning's default, DDP's, DeepSpeed's
    and FSDP's (a GRPO config's) become `es`; any other strategy is refused in one line. ES has no gradient to clip
    or accumulate, so a GRPO config's `gradient_clip_val` and `accumulate_grad_batches` are dropped (Lightning
    refuses both under ES's manual optimization), and its mixed precision becomes 32-true (MIXED). GRPO runs on
    Lightning's strategies: `es` becomes `auto`; FSDP is refused (esrl reads the policy's weights whole outside its
    forward: generate, the engine sync, the final save).
    Returns one note per setting that a config had to lose, for the user to see.
    """
    notes: list[str] = []
    name = strategy_name(trainer.strategy)
    accumulate = trainer.accumulate_grad_batches
    if isinstance(accumulate, int) and accumulate < 1:  # else ES would drop it with a note, as if it were valid
        raise ConfigError(f"trainer.accumulate_grad_batches: must be >= 1, got {accumulate}")
    if algo == "es":
        if name in GRPO_STRATEGIES:
            trainer.strategy = "es"
        elif isinstance(trainer.strategy, str) and name.startswith(ES_REPLACES):
            notes.append(f"trainer.strategy {name} -> es")
            trainer.strategy = "es"
        elif name != "es" and not name.endswith(".ESStrategy"):
            raise ConfigError(f"trainer.strategy {name}: ES runs on esrl's own strategy `es` (DDP's processes, no "
                              "gradient all-reduce); leave trainer.strategy out, or set it to auto, ddp or es")
        if str(trainer.precision) in MIXED:
            notes.append(f"trainer.precision {trainer.precision} -> 32-true (ES runs in model.policy.dtype)")
            trainer.precision = "32-true"
        if trainer.gradient_clip_val is not None:
            notes.append(f"trainer.gradient_clip_val {trainer.gradient_clip_val} dropped")
            trainer.gradient_clip_val = None
        if trainer.accumulate_grad_batches not in (None, 1):
            notes.append(f"trainer.accumulate_grad_batches {trainer.accumulate_grad_batches} -> 1")
            trainer.accumulate_grad_batches = 1
    elif algo == "grpo" and name == "es":
        trainer.strategy = "auto"
    elif algo == "grpo" and name is not None and name.startswith("ddp_spawn"):  # its child unpickles the module
        raise ConfigError(f"trainer.strategy {name}: GRPO cannot start spawned processes (they would need to "
                          "unpickle the module class the CLI builds); use ddp, which launches one process a "
                          "device, as torchrun and srun do")
    elif algo == "grpo" and name is not None and ("fsdp" in name.lower()):
        raise ConfigError(f"trainer.strategy {name}: GRPO under FSDP is not supported yet (esrl reads the policy's "
                          "weights whole for generate, the vLLM sync and the final save); use ddp, or "
                          "deepspeed_stage_2 to shard optimizer states and gradients")
    return notes


def build_module(algo: Literal["es", "grpo"] = "es", policy: PolicyConfig | None = None,
                 rollout: RolloutConfig | None = None, es: ESConfig | None = None,
                 grpo: GRPOConfig | None = None, optimizer: OptimizerCallable | None = None,
                 lr_scheduler: LRSchedulerCallable | None = None) -> PolicyModule:
    """The LightningModule for `algo`, with the shared policy and rollout settings.

    Args:
        algo: es or grpo (set it with the top-level `--algo`).
        policy: the model being trained.
        rollout: generation settings shared by both algorithms and by evaluation.
        es: ES hyperparameters (used when algo is es).
        grpo: GRPO hyperparameters (used when algo is grpo).
        optimizer: GRPO's optimizer instead of the default AdamW (set it with the top-level `--optimizer`).
        lr_scheduler: GRPO's LR schedule instead of the default (set it with the top-level `--lr_scheduler`).
    """
    if algo == "es" and (optimizer is not None or lr_scheduler is not None):
        flag = "--optimizer" if optimizer is not None else "--lr_scheduler"
        raise ConfigError(f"{flag}: applies to --algo grpo; ES steps with model.es.optimizer at lr model.es.alpha")
    if algo == "es":
        from esrl.es.module import ESModule

        return ESModule(policy=policy, rollout=rollout, es=es)
    if algo == "grpo":
        from esrl.grpo.module import GRPOModule

        return GRPOModule(policy=policy, rollout=rollout, grpo=grpo, optimizer=optimizer, lr_scheduler=lr_scheduler)
    raise ValueError(f"algo {algo!r}: choose es or grpo")
