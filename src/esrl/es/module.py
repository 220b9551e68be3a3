"""ESModule: one training_step is one ES iteration. Thin glue over esrl.es's plain-torch math."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from esrl.errors import ConfigError, DataError
from esrl.es.config import ESConfig
from esrl.es.engines import es_backend
from esrl.es.fingerprint import weights_fingerprint
from esrl.es.member_scores import COST, FITNESS, RAW_REWARD, SAFE, completion_metrics, member_table, width
from esrl.es.modes import get_mode
from esrl.es.noise import drawn_once, noise_source, other_noise_source, population
from esrl.es.population_hooks import member_chunks
from esrl.es.seed_log import append_record, make_header, make_record, write_seed_log
from esrl.es.setup import build_optimizer, build_policy, build_selection
from esrl.es.shaping import shape_fitness
from esrl.es.update import es_step, weights_checksum
from esrl.models.loading import DTYPES
from esrl.policy import PolicyConfig, PolicyModule, precision_dtype, world_info
from esrl.rollout import AdapterSpec, Completion, RolloutConfig, engine_capabilities
from esrl.tasks.reward_values import check_bad_rewards, reward_name


class WeightDriftError(RuntimeError):
    pass


class ESModule(PolicyModule):
    """Evolution strategies on a causal LM: perturb, roll out greedily, score, restore; then update.

    The noise mode (esrl.es.modes) decides what is perturbed and how. Sequential modes (full) run member by
    member, weights perturbed in place. Batched modes (lowrank, lora) run the members in fixed chunks
    (rollout.max_batch_size // prompts members each), each chunk ONE batched generate with per-row weights; rank
    r evaluates chunks r, r+W, ..., so results do not depend on the number of processes. The engine backend
    (esrl.es.engines) follows the engine's capabilities.
    """

    def __init__(self, policy: PolicyConfig | None = None, rollout: RolloutConfig | None = None,
                 es: ESConfig | None = None):
        super().__init__(policy, rollout)
        self.es = es or ESConfig()
        self.es.validate()
        if self.rollout_config.vllm_sleep:  # accepted and ignored, it promised memory ES never frees
            raise ConfigError("model.rollout.vllm_sleep: GRPO's option (the engine sleeps through its backward); ES "
                              "has no backward and generates all step long: set it false")
        self.mode = get_mode(self.es.mode)
        self.save_configs(es=self.es)
        self.automatic_optimization = False
        self.selection = None
        self.backend = None  # esrl.es.engines: ES on this engine
        self.base_fingerprint: str | None = None  # esrl.es.fingerprint of the loaded base, for the seed log
        self.seed_log_records: list[dict[str, Any]] = []
        self._restored_device: str | None = None  # the device type of a resumed checkpoint's noise
        self._restored_source: str | None = None  # and its GPU model (esrl.es.noise.noise_source)
        self._bad_sources: set[str] = set()  # reward functions that gave non-finite values this iteration

    def configure_model(self) -> None:
        super().configure_model()
        if self.selection is None:
            # Of the weights as loaded, before any update or checkpoint restore: `esrl export` checks its --base.
            self.base_fingerprint = weights_fingerprint(self.policy)
            # lora: the policy becomes the PEFT model; the adapter is injected into the engine's model in place.
            self.policy = build_policy(self.policy, self.es, self.noise_seed)
            self.selection, self.noise_spec = build_selection(self.policy, self.es)
            self.backend = es_backend(self.engine, self.policy, self.selection, self.noise_spec, self.mode)

    def engine_adapters(self) -> AdapterSpec | None:
        """Batched modes on an engine with its own weights run members as LoRA adapters; what the mode cannot
        run that way fails here, in one line, before the engine starts."""
        if not self.mode.batched or engine_capabilities(self.rollout_config).shares_policy_weights:
            return None
        return self.mode.adapter_spec(self.es, self.policy)  # the policy is loaded, the engine not yet

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if "mixed" in str(self.trainer.precision):  # `esrl fit` maps these to 32-true (module_factory.MIXED)
            raise ConfigError(f"trainer.precision {self.trainer.precision}: ES takes no mixed precision (no backward "
                              "to autocast; fp16's grad scaler would rescale the ES gradient); set model.policy.dtype "
                              "and use 32-true or bf16-true")
        converted = precision_dtype(self.trainer)  # a true half precision converts the loaded weights
        if converted is None and str(self.trainer.precision) != "32-true":  # 64-true, transformer-engine...
            raise ConfigError(f"trainer.precision {self.trainer.precision}: ES runs 32-true (weights in "
                              "model.policy.dtype) or the true half precision of model.policy.dtype; `esrl export` "
                              "rebuilds the weights in model.policy.dtype")
        if converted is not None and self.es.mode == "lora":  # Lightning would convert PEFT's float32 adapter too
            raise ConfigError(f"trainer.precision {self.trainer.precision} with model.es.mode lora: the adapter ES "
                              "trains is float32 (PEFT's, as `esrl export` rebuilds it) and would be converted; set "
                              "model.policy.dtype bfloat16 (the base) and trainer.precision 32-true")
        if converted is not None and converted != DTYPES[self.policy_config.dtype]:  # bf16 is no torch attribute
            raise ConfigError(f"trainer.precision {self.trainer.precision} with model.policy.dtype "
                              f"{self.policy_config.dtype}: ES would perturb and update {converted} weights while "
                              f"its seed log says {self.policy_config.dtype}; set model.policy.dtype "
                              f"{str(converted).removeprefix('torch.')} (or trainer.precision 32-true)")
        world, prompts = self.trainer.world_size, getattr(self.trainer.datamodule, "prompts_per_step", 1)
        units = (-(-self.es.population_size // self.members_per_chunk(prompts)) if self.mode.batched
                 else self.es.population_size)  # members (sequential modes) or chunks (batched) to share out
        if stage == "fit" and world > units:
            kind = "chunks of members" if self.mode.batched else "members"
            rank_zero_warn(f"trainer.devices: {world} processes share {units} {kind} an iteration: {world - units} "
                           "of them idle (model.es.population_size, model.rollout.max_batch_size)")

    def configure_optimizers(self):
        return build_optimizer(self.selection.params, self.es)

    def members_per_chunk(self, n_prompts: int) -> int:
        """Members per batched generate: rollout.max_batch_size // prompts (at least 1); never the world size."""
        return max(1, self.rollout_config.max_batch_size // max(1, n_prompts))

    def member_scores(self, rows: list[dict[str, Any]], completions: list[Completion],
                      n_members: int) -> torch.Tensor:
        """esrl.es.member_scores' table: each member's fitness (mean task reward; with a cost, reward - lambda * cost,
        lambda fixed within the iteration), its cost columns and its completions' statistics. Completions are
        member-major, len(rows) per member."""
        with self.timed("reward"):
            rewards = self.task.rewards([r for _ in range(n_members) for r in rows], [c.text for c in completions],
                                        [c.token_ids for c in completions], **self.reward_context())
        self._bad_sources.update(self.task.last_bad)
        constraint = self.constraint
        return member_table(n_members, rewards, [len(c.token_ids) for c in completions],
                            [c.truncated for c in completions], self.task.last_per_function,
                            None if constraint is None else (constraint.last_rewards, constraint.last_costs))

    def chunk_fitness(self, rows: list[dict[str, Any]], chunk, stop: list[str]) -> torch.Tensor:
        """member_scores of every member of one chunk, all evaluated in one batched generation. On an engine with
        static shapes (compiled decoding) a short last chunk is padded with copies of its first member, whose
        completions are dropped, so every chunk reuses one compiled graph."""
        prompts = self.task.prompts(rows)
        real = len(chunk)
        if self.engine.capabilities.static_shapes:  # the size of a full chunk
            full = min(self.members_per_chunk(len(rows)), self.es.population_size)
            chunk = list(chunk) + [chunk[0]] * (full - real)
        with self.timed("rollout"):
            completions = self.engine.generate_population(prompts, len(chunk), self.backend.row_weights(chunk),
                                                          max_new_tokens=self.rollout_config.max_new_tokens,
                                                          stop=stop)[:real]
        return self.member_scores(rows, [c for cs in completions for c in cs], real)

    @property
    def noise_seed(self) -> int:
        """The configured seed, else the run's seed_everything value (Lightning exports it)."""
        return self.seed_or_global(self.es.seed)

    def member_fitness(self, rows: list[dict[str, Any]], member, stop: list[str]) -> torch.Tensor:
        """member_scores of one member on the iteration's prompts; weights are restored however it ends."""
        prompts = self.task.prompts(rows)
        try:  # a perturbation that fails part way (an OOM drawing a tensor's noise, an engine's load) is restored too
            with self.timed("noise"):
                self.backend.perturb(member)
            with self.timed("rollout"):
                completions = self.engine.generate(prompts, max_new_tokens=self.rollout_config.max_new_tokens,
                                                   greedy=True, stop=stop)
            scores = self.member_scores(rows, completions, 1)[0]
        finally:
            with self.timed("noise"):
                self.backend.restore()
        return scores

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        with drawn_once():  # a member's factors / adapter noise serve its chunk's generate and the update alike
            self._iteration(batch["rows"])

    def _iteration(self, rows: list[dict[str, Any]]) -> None:
        self._timings = {}
        self._bad_sources = set()
        start = time.perf_counter()
        iteration = self.global_step
        rank, world = world_info(self)
        members = population(self.noise_seed, iteration, self.es.population_size, self.es.antithetic)
        stop = self.stop_strings()
        functions = [reward_name(f) for f in self.task.reward_funcs]  # unique (Task), last_per_function's keys

        # Members r, r+W, ... (sequential modes) or chunks r, r+W, ... (batched) on rank r; every rank fills its own
        # entries, the sum gathers them exactly.
        local = torch.zeros(len(members), width(len(functions)), dtype=torch.float64)
        if self.mode.batched:
            for chunk in member_chunks(members, self.members_per_chunk(len(rows)))[rank::world]:
                for m, f in zip(chunk, self.chunk_fitness(rows, chunk, stop)):
                    local[m.index] = f
        else:
            for m in members[rank::world]:
                local[m.index] = self.member_fitness(rows, m, stop)
        with self.timed("sync"):
            scores = self.trainer.strategy.sum_across_ranks(local) if world > 1 else local
        fitness = scores[:, FITNESS]
        bad = int((~torch.isfinite(fitness)).sum())  # every rank sees the same gathered fitness: all stop or none
        check_bad_rewards(bad, len(members), step=iteration, unit="ES members", sources=self._bad_sources,
                          min_usable=2)
        shaped = shape_fitness(fitness, self.es.shaping)  # bad members get 0

        with self.timed("update"):
            opt = self.optimizers()
            self.backend.free()
            # grad = -g, then ONE step through Lightning's optimizer (its precision and strategy plugins see
            # it; SGD lr=alpha: theta += alpha g); the engine then sees the updated policy.
            alpha = opt.optimizer.param_groups[0]["lr"]  # model.es.alpha (ES takes no --lr_scheduler)
            es_step(opt.optimizer, self.selection, members, shaped, self.noise_spec, step=self._counted_step(opt),
                    iteration=iteration)
            if self.trainer.is_global_zero:  # recorded with the update itself: a checkpoint saved if anything after
                self._append_seed_log(iteration, members, shaped, alpha)  # fails holds one record per update
            extra = {"train/bad_rewards": bad}  # members left out of the update for a NaN/inf reward
            if self.constraint is not None:  # lambda moves with the update too (every rank holds all members' costs)
                extra.update(self.adapt_lambda(*(float(scores[:, c].sum()) for c in (COST, RAW_REWARD, SAFE)),
                                               len(members)))
            self.backend.after_update()
        if self.es.checksum_every and world > 1 and (iteration + 1) % self.es.checksum_every == 0:
            with self.timed("sync"):
                self.check_drift(iteration)

        extra.update(completion_metrics(scores, functions))
        self._log_iteration(fitness, shaped, alpha, time.perf_counter() - start, extra)

    def _counted_step(self, opt):
        """opt.step, marked in flight while it runs: one that fails part way (an OOM inside AdamW) has changed some
        weights and moments but counted no step, so no checkpoint may call that state the step's start."""
        def step():
            self.update_in_flight = True
            opt.step()
            self.update_in_flight = False
        return step

    def check_drift(self, iteration: int) -> None:
        """`iteration`: the seed log's number of the update just applied (global_step has counted it already)."""
        sums = self.trainer.strategy.gather_all(weights_checksum(self.selection.params))
        if not bool((sums == sums[0]).all()):
            raise WeightDriftError(f"ES weights differ across ranks at iteration {iteration}: "
                                   f"checksums {sums.tolist()}")

    def _log_iteration(self, fitness: torch.Tensor, shaped: torch.Tensor, alpha: float, total: float,
                       extra: dict[str, float]) -> None:
        f = fitness[torch.isfinite(fitness)].float()  # members with a bad reward are counted, not averaged
        metrics = {"train/reward_mean": f.mean(), "train/reward_std": f.std(unbiased=False),
                   "train/reward_min": f.min(), "train/reward_max": f.max(),
                   "train/shaped_abs_mean": shaped.abs().mean().float(), "train/alpha": alpha,
                   "train/sigma": self.es.sigma}
        metrics.update(extra)
        metrics.update({f"time/{k}": v for k, v in self._timings.items()})
        metrics["time/step"] = total  # the name GRPO logs its step's under
        metrics.update(self.reward_metrics(metrics))  # what reward functions logged (log_metric), every process's
        self.log_dict({k: float(v) for k, v in metrics.items()}, on_step=True, on_epoch=False, rank_zero_only=True)
        self.log("reward", float(f.mean()), prog_bar=True, on_step=True, on_epoch=False, logger=False,
                 rank_zero_only=True)

    def _append_seed_log(self, iteration: int, members, shaped: torch.Tensor, alpha: float) -> None:
        """Base model + this log reproduce the trained weights (see `esrl export`)."""
        record = make_record(iteration, shaped, alpha, self.es.sigma)
        self.seed_log_records.append(record)
        append_record(self.run_dir() / "seed_log.jsonl", record)

    def configure_callbacks(self):
        return [*super().configure_callbacks(), _ClosesBackend()]

    def write_model(self, out: Path) -> None:
        """The trained model as the mode saves it (lora: the adapter in PEFT format under out/adapter/ and the
        merged model in out/)."""
        self.mode.save_final(self.policy, self.tokenizer, out)

    def noise_device(self) -> str:
        """The device type whose generator draws the noise (seed_log.make_header)."""
        return self.selection.params[0].device.type

    def noise_chip(self) -> str:
        """The device model whose generator draws the noise (esrl.es.noise.noise_source: a GPU's name and SM count)."""
        return noise_source(self.selection.params[0].device)

    def on_fit_start(self) -> None:
        """A checkpoint resumes only where its noise was drawn (checked here: after the restore, on the run's device,
        before any evaluation)."""
        if self.seed_log_records and self._restored_device not in (None, self.noise_device()):
            raise DataError(f"--ckpt_path {self.trainer.ckpt_path}: its {len(self.seed_log_records)} ES updates drew "
                            f"their noise on {self._restored_device}; on {self.noise_device()} the same seeds draw "
                            "other noise, so the run would not be the one it continues and its seed log could not "
                            f"rebuild it: resume on {self._restored_device}")
        if self.seed_log_records and (why := other_noise_source(self._restored_source, self.noise_chip())):
            rank_zero_warn(f"--ckpt_path {self.trainer.ckpt_path}: {why}; the run goes on, but no single GPU model "
                           "can replay its whole seed log (`esrl export`)")
        # A resumed run rewrites the history restored from its checkpoint, so its log is complete: here, not at train
        # start, which a run resumed at (or past) its max_steps skips while its final/ is still written.
        if self.trainer.is_global_zero:
            write_seed_log(self.run_dir() / "seed_log.jsonl",
                           make_header(self.es, self.noise_seed, self.policy_config, self.base_fingerprint,
                                       self.noise_device(), self.noise_chip()),
                           self.seed_log_records)

    def prepare_rollouts(self) -> None:
        super().prepare_rollouts()
        if self.trainer.ckpt_path is not None:  # an engine with its own weights gets the resumed ones
            self.backend.sync()

    def mid_step(self) -> str | None:
        if self.backend is not None and self.backend.is_perturbed:
            return "a population member's noise is in the weights"
        return super().mid_step()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["esrl_es"] = {"noise_seed": self.noise_seed, "seed_log": self.seed_log_records,
                                 "device": self.noise_device(),
                                 "noise_source": self.noise_chip()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.seed_log_records = list(checkpoint.get("esrl_es", {}).get("seed_log", []))
        self._restored_device = checkpoint.get("esrl_es", {}).get("device")  # older checkpoints lack it
        self._restored_source = checkpoint.get("esrl_es", {}).get("noise_source")
        updates = checkpoint.get("global_step", len(self.seed_log_records))
        if len(self.seed_log_records) != updates:  # its seed log could not rebuild its weights (esrl export)
            raise DataError(f"--ckpt_path {self.trainer.ckpt_path}: {updates} ES updates but "
                            f"{len(self.seed_log_records)} seed-log records (saved mid-iteration): resume from an "
                            "earlier checkpoint")


class _ClosesBackend(L.Callback):
    """The ES backend's hooks (a static population's) come off the policy however the fit ends: a callback, since
    Lightning calls a module no hook after a failure."""

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if pl_module.backend is not None:
            pl_module.backend.close()
