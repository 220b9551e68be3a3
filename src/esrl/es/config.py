"""ES hyperparameters; defaults are the paper's (Qiu et al. 2025: N=30, sigma=0.001, alpha=5e-4)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from esrl.errors import require, require_finite
from esrl.es.modes import MODES, get_mode
from esrl.es.params import check_filter


@dataclass
class ESConfig:
    """Evolution strategies settings (the `model.es` section of a config)."""

    population_size: int = 30
    """N, members per iteration. Antithetic sampling needs an even N."""
    sigma: float = 0.001
    """Noise scale of the perturbations theta + sigma * eps."""
    alpha: float = 5e-4
    """Learning rate: theta += alpha * (1/N) sum z_i eps_i (the paper folds 1/sigma into alpha), with plain SGD and
    `sigma_scaling: global`; `rms` scales each tensor's step by its RMS as it scales the noise, and `momentum` or
    `optimizer: adam` take that estimate as their gradient."""
    antithetic: bool = False
    """Members (2k, 2k+1) share noise with opposite signs (mirrored sampling)."""
    shaping: Literal["zscore", "centered_rank", "raw"] = "zscore"
    """Fitness shaping: z-score as in the paper, tie-safe centered rank, or raw rewards (not centered: equal rewards
    r move the weights by alpha * r * mean(eps))."""
    mode: str = "full"
    """Noise mode, a name registered in esrl.es.modes.MODES: `full` Gaussian noise on whole tensors, member by member (the paper's algorithm); `lowrank`
    rank-r noise sigma A B^T / sqrt(r) on every perturbed nn.Linear weight (EGGROLL), the whole population in
    one batched generation (chunks of rollout.max_batch_size // prompts members); `lora` full Gaussian noise on
    the weights of a PEFT LoRA adapter only (ES in adapter space, base weights frozen), population-batched like
    lowrank; the adapter is saved in PEFT format under final/adapter/ and merged into final/."""
    rank: int = 1
    """lowrank: rank r of each member's noise A B^T on a matrix."""
    lowrank_vectors: Literal["frozen", "full"] = "frozen"
    """lowrank: 1-D tensors (norm weights, biases) stay `frozen` or get `full` Gaussian noise. Embeddings (and
    weights tied to them, e.g. SmolLM2's lm_head) are never perturbed in lowrank mode."""
    lora_rank: int = 8
    """lora: rank r of the adapter (A: r x in, B: out x r). 8 with lora_alpha 16 is MeZO's LoRA setting
    (zeroth-order fine-tuning, Malladi et al. 2023) and the common alpha = 2r choice."""
    lora_alpha: float = 16.0
    """lora: LoRA scaling numerator (W + lora_alpha / r * B A); not the ES learning rate `alpha`. With B
    perturbed by sigma * eps it scales the effective weight perturbation, so it trades off against sigma."""
    lora_target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """lora: names (or name suffixes) of the nn.Linear modules that get an adapter (PEFT's target_modules);
    the default is every attention and MLP projection of Llama/Qwen-style models. `layers` picks the layers."""
    lora_init: Literal["kaiming", "gaussian"] = "kaiming"
    """lora: initial A, kaiming-uniform U(+-1/sqrt(in)) (PEFT's default) or N(0, 1/r^2) (PEFT's gaussian);
    B starts at 0 either way, so the adapter starts as the identity and step 0 is the base model."""
    sigma_scaling: Literal["global", "rms"] = "global"
    """Noise scale of tensor j: one global sigma, or sigma * RMS(theta_j) (`rms`); full and lowrank (lora's B
    starts at 0, so rms would never perturb it)."""
    optimizer: Literal["sgd", "adam"] = "sgd"
    """Optimizer fed with the ES gradient (grad = -g): `sgd` (lr=alpha: the paper's update) or `adam`."""
    momentum: float = 0.0
    """SGD momentum (0: the paper's plain update)."""
    weight_decay: float = 0.0
    """Weight decay of the optimizer (decoupled, AdamW-style, for adam)."""
    include: list[str] = field(default_factory=list)
    """Regexes on parameter names to perturb (empty: all parameters); in lora mode they pick among the adapter's
    weights (PEFT names, e.g. 'lora_B' or 'self_attn')."""
    exclude: list[str] = field(default_factory=list)
    """Regexes on parameter names never to perturb."""
    layers: str | None = None
    """Transformer layer ranges to perturb, e.g. '0-5,20' (None: all layers and non-layer tensors); in lora mode
    the layers that get an adapter (None: every layer)."""
    seed: int | None = None
    """Seed of the noise; None takes the run's seed_everything value."""
    checksum_every: int = 10
    """Every K iterations the ranks compare a checksum of the weights and stop loudly on drift (0: never)."""

    def validate(self) -> None:
        """Called when the module is built, so a bad value is one line naming its field."""
        require_finite(self, "model.es")
        require(self.population_size >= 2, "model.es.population_size", f"must be >= 2, got {self.population_size}")
        require(self.sigma > 0, "model.es.sigma", f"must be > 0, got {self.sigma}")
        require(self.alpha > 0, "model.es.alpha", f"must be > 0, got {self.alpha}")
        require(not self.antithetic or self.population_size % 2 == 0, "model.es.population_size",
                f"antithetic sampling needs an even population, got {self.population_size}")
        require(self.checksum_every >= 0, "model.es.checksum_every", "must be >= 0")
        require(self.shaping in ("zscore", "centered_rank", "raw"), "model.es.shaping",
                f"choose zscore, centered_rank or raw, got {self.shaping!r}")
        require(self.mode in MODES, "model.es.mode", f"choose {', '.join(MODES)}, got {self.mode!r}")
        require(self.sigma_scaling in ("global", "rms"), "model.es.sigma_scaling",
                f"choose global or rms, got {self.sigma_scaling!r}")
        require(self.optimizer in ("sgd", "adam"), "model.es.optimizer", f"choose sgd or adam, got {self.optimizer!r}")
        require(0 <= self.momentum < 1, "model.es.momentum", f"must be in [0, 1) (1 and above diverge), "
                f"got {self.momentum}")
        require(self.optimizer == "sgd" or self.momentum == 0, "model.es.momentum",
                f"applies to optimizer sgd only (adam keeps its own moments), got {self.momentum} with adam")
        check_filter(self.include, self.exclude, self.layers)
        require(self.weight_decay >= 0, "model.es.weight_decay", "must be >= 0")
        get_mode(self.mode).validate(self)  # the mode's own fields (rank, lora_*) and combinations
