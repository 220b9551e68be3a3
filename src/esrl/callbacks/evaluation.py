"""Evaluation shared by ES and GRPO: before training (step 0), every K steps, and at the end.

The same metric names for both algorithms, so their curves overlay: greedy reward and task metrics,
sampled reward and pass@k, KL(fine-tuned || base) by the k3 estimator on sampled completions, and
reward-hacking indicators; a table of sample completions per evaluation.
"""

from __future__ import annotations

import csv
import json
import math
import warnings
from pathlib import Path
from statistics import fmean
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from esrl.atomic_files import write_text, write_with
from esrl.callbacks.interruption import final_phase
from esrl.errors import ConfigError, DataError, RewardError
from esrl.metrics import hacking_indicators, k3_kl, pass_at_k, special_token_share
from esrl.rollout.hf import end_token_ids
from esrl.tasks.base import prompt_text
from esrl.tasks.reward_logs import refuse_clashes


def evaluation_records(path: Path) -> list[dict[str, Any]]:
    """The evaluations of an eval.jsonl. A last line a kill or a full disk cut off mid-write is left out with a
    warning (the run resumes, and redoes that evaluation); a broken line before it is a DataError naming it."""
    lines = [(n, line) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
    records = []
    for k, (n, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if k < len(lines) - 1:
                raise DataError(f"{path}:{n}: not a JSON evaluation record ({e.msg}); esrl writes one a line") from None
            warnings.warn(f"{path}:{n}: its last line was cut off mid-write (a kill?): left out", stacklevel=2)
    return records


class Evaluation(L.Callback):
    """Evaluates the current weights on the task's eval split and logs `eval/<metric>` at the global step."""

    def __init__(self, every_n_steps: int = 0, before: bool = True, after: bool = True, num_samples: int = 0,
                 temperature: float = 1.0, top_p: float = 1.0, pass_k: list[int] | None = None, kl: bool = True,
                 correct_metric: str | None = None, table_rows: int = 8, seed: int = 1234):
        """
        Args:
            every_n_steps: evaluate every K training steps (0: only before and after).
            before: evaluate the starting weights (step 0 of a new run).
            after: evaluate the final weights when fit ends.
            num_samples: sampled completions per prompt (0: greedy only); sampled reward, pass@k and KL use them.
            temperature: sampling temperature of those completions.
            top_p: their nucleus; the run's own rollout.top_p is not used, so runs that sample differently in
                training (ES and GRPO) are evaluated alike. KL needs the full distribution (1.0).
            pass_k: the k of pass@k (each <= num_samples); default [1, num_samples].
            kl: KL(fine-tuned || base), k3 per token on the sampled completions (loads the base model once).
            correct_metric: task metric that marks a sample correct for pass@k (default: `accuracy`, else
                `exact`, else reward > 0).
            table_rows: prompts whose completions go to the sample table (`samples.csv`, W&B when on).
            seed: sampling seed, fixed so evaluations differ only by the weights.
        """
        if every_n_steps < 0 or table_rows < 0 or num_samples < 0:  # step % -1 == 0: every step, silently
            raise ValueError(f"Evaluation.every_n_steps {every_n_steps}, table_rows {table_rows} and num_samples "
                             f"{num_samples}: must be >= 0 (0: never)")
        if temperature <= 0:  # sampling at 0 divides the logits by 0 (and the KL's log-probs with them)
            raise ValueError(f"Evaluation.temperature {temperature}: must be > 0")
        self.every_n_steps = every_n_steps
        self.before = before
        self.after = after
        self.num_samples = num_samples
        self.temperature = temperature
        if not 0 < top_p <= 1 or (kl and num_samples and top_p < 1):
            raise ValueError(f"Evaluation.top_p {top_p}: must be in (0, 1], and 1 with kl (k3 on nucleus samples "
                             "estimates no KL): set kl: false to sample a nucleus")
        self.top_p = top_p
        self.pass_k = (pass_k or sorted({1, num_samples})) if num_samples else []
        if any(not 1 <= k <= num_samples for k in self.pass_k):
            raise ValueError(f"Evaluation.pass_k {self.pass_k}: each k must be in [1, num_samples ({num_samples})]")
        self.kl = kl
        self.correct_metric = correct_metric
        self.table_rows = table_rows
        self.seed = seed
        self.history: list[dict[str, float]] = []
        self._last_step = -1
        self._base = None
        self._trained = False  # this fit ran its train hooks (a run resumed at its last step does not)

    # -- hooks ---------------------------------------------------------------------------------------
    def on_fit_start(self, trainer, module) -> None:
        self._trained = False

    def on_train_start(self, trainer, module) -> None:
        self._trained = True

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        """Evaluations at a step's start, of the weights after the steps before it (the last one's: on_train_end).

        The one before training here rather than on_train_start: after every on_train_start (the module's restored
        state, the Interruption callback's signal handlers), so a signal during it stops the run after step 1 with a
        checkpoint (tests/test_resume.py -k during_the_evaluation). The ones every_n_steps here rather than at the
        step before's end: Lightning logs that step's metrics after on_train_batch_end, so an evaluation failing there
        (its scorer down) lost them, and a resume skipped it (esrl.callbacks.failure); here a failed or interrupted
        run that stopped before an evaluation runs it on resume, before the step's rollouts (and once per window:
        GRPO's micro-batches after the first find it done)."""
        if self.before and trainer.global_step == 0:
            self._run(trainer, module, "before")
        elif self._due(trainer.global_step):
            self._run(trainer, module, "during")

    def _due(self, step: int) -> bool:
        """An evaluation every_n_steps (step 0 is `before`'s)."""
        return bool(self.every_n_steps and step and step % self.every_n_steps == 0)

    def on_load_checkpoint(self, trainer, module, checkpoint: dict[str, Any]) -> None:
        """Resuming: eval.jsonl and samples.csv keep the evaluations up to the checkpoint's step (later ones are
        redone), and the history continues from them."""
        step = int(checkpoint.get("global_step", 0))
        path = module.run_dir() / "eval.jsonl"
        if path.is_file():
            rows = evaluation_records(path)
            self.history = [r for r in rows if r.get("step", 0) <= step]
            self._last_step = step if any(r.get("step") == step for r in self.history) else -1
            if trainer.is_global_zero:
                write_text(path, "".join(json.dumps(r) + "\n" for r in self.history))
                _trim_table(module.run_dir() / "samples.csv", step)

    def on_train_end(self, trainer, module) -> None:
        if self.after or self._due(trainer.global_step):  # the last step's own, due or asked for
            with final_phase():  # a signal stops it at once, with a checkpoint (esrl.callbacks.interruption)
                self._run(trainer, module, "after" if self.after else "during")
        if trainer.is_global_zero and len(self.history) >= 2:
            first, last = self.history[0], self.history[-1]
            rank_zero_info(f"[eval] reward {first['reward']:.4g} (step {first['step']}) -> "
                           f"{last['reward']:.4g} (step {last['step']})")

    def on_fit_end(self, trainer, module) -> None:
        """A run resumed from its last step trains nothing (Lightning skips on_train_end): the final evaluation
        the interrupted run did not finish (a scorer outage) runs here, before final/ is written."""
        if (self.after or self._due(trainer.global_step)) and trainer.global_step != self._last_step:
            if not self._trained:  # the module's on_train_start did not run: lambda and an engine's weights
                module.prepare_rollouts()
            with final_phase():
                self._run(trainer, module, "after" if self.after else "during")

    # -- evaluation ----------------------------------------------------------------------------------
    def evaluate(self, module) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """All metrics of the current weights, and the sample table's rows."""
        rows = [r for batch in module.trainer.datamodule.eval_dataloader() for r in batch["rows"]]
        greedy = module.rollout_eval(rows)
        values = module.score_rows(rows, greedy)
        metrics = finite_means(values, module, "reward")
        texts = [c.text for c in greedy]
        indicators = hacking_indicators(texts, [c.truncated for c in greedy])
        indicators["special_tokens"] = max(indicators["special_tokens"], special_token_share(
            [c.token_ids for c in greedy], module.tokenizer.all_special_ids,
            end_token_ids(module.policy, module.tokenizer)))
        own = {f"hacking/{k}": v for k, v in indicators.items()}
        table = [{"prompt": prompt_text(p), "greedy": t, "reward": r} for p, t, r in
                 zip(module.task.prompts(rows), texts, values["reward"])][: self.table_rows]
        if self.num_samples:
            own.update(self._sampled(module, rows, table))
        refuse_clashes(metrics, own)  # a name a reward function logged (log_metric) among the evaluation's own
        return {**metrics, **own}, table

    def _sampled(self, module, rows, table) -> dict[str, float]:
        n = self.num_samples
        samples = module.rollout_eval(rows, greedy=False, n=n, temperature=self.temperature, top_p=self.top_p,
                                      seed=self.seed)
        repeated = [r for r in rows for _ in range(n)]
        values = module.score_rows(repeated, samples)
        out = {f"sampled/{k}": v for k, v in finite_means({"reward": values["reward"]}, module, "sampled reward").items()}
        key = self.correct_metric or next((k for k in ("accuracy", "exact") if k in values), None)
        if key is not None and key not in values:
            raise ConfigError(f"Evaluation.correct_metric {key!r}: the task {type(module.task).__name__} gives "
                              f"{', '.join(sorted(values))}")
        correct = [v >= 1.0 for v in values[key]] if key else [r > 0 for r in values["reward"]]
        for k in self.pass_k:
            out[f"pass@{k}"] = fmean(pass_at_k(n, sum(correct[i * n:(i + 1) * n]), k) for i in range(len(rows)))
        for i, row in enumerate(table):
            row["sample"] = samples[i * n].text
        if self.kl:
            out["kl"] = self._kl(module, repeated, samples)
        return out

    @torch.no_grad()
    def _kl(self, module, rows, samples) -> float:
        from esrl.models import load_causal_lm
        from esrl.models.loading import like_policy
        from esrl.models.lora import is_peft
        from esrl.rollout.text import encode_prompts

        base = module.frozen_base()  # GRPO's reference: no second copy of the model on the device
        if base is None and is_peft(module.policy):  # a LoRA run: its base weights never train, so the policy with
            base = _AdapterOff(module.policy)  # its adapter off IS the base (a 7B copy kept for the run, before)
        if base is None:
            if self._base is None:
                # in the policy's dtype as it runs (a true half precision converted it after loading): step 0's
                # KL is then 0, not the rounding between the two
                self._base = like_policy(load_causal_lm(module.model_path, module.policy_config.dtype),
                                         module.policy, module.device)
            base = self._base
        prompts = encode_prompts(module.tokenizer, module.task.prompts(rows))
        training = module.policy.training  # GRPO trains in train mode: dropout off for the estimate, as the base's
        module.policy.eval()
        try:
            total, tokens = self._k3_sums(module, base, prompts, samples)
        finally:
            module.policy.train(training)
        return total / max(tokens, 1)

    def _k3_sums(self, module, base, prompts, samples) -> tuple[float, int]:
        """The k3 terms summed over the samples' completion tokens, and how many tokens."""
        from esrl.models.logps import packed, per_token_logps

        tok = module.tokenizer
        total, tokens = 0.0, 0
        for start in range(0, len(prompts), 16):
            chunk = slice(start, start + 16)
            ids, mask, present = packed(tok, prompts[chunk], [c.token_ids for c in samples[chunk]])
            ids, mask, width = ids.to(module.device), mask.to(module.device), present.shape[1]
            lp = per_token_logps(module.policy, ids, mask, width, self.temperature)
            lr = per_token_logps(base, ids, mask, width, self.temperature)
            m = mask[:, -width:]
            total += float(k3_kl(lp, lr, m)) * int(m.sum())
            tokens += int(m.sum())
        return total, tokens

    def _run(self, trainer, module, label: str) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return
        self._last_step = step
        metrics, table = self.evaluate(module)
        self.history.append({"step": step, **metrics})
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics({f"eval/{k}": v for k, v in metrics.items()}, step=step)
        run_dir = module.run_dir()
        run_dir.mkdir(parents=True, exist_ok=True)
        with (run_dir / "eval.jsonl").open("a") as f:
            f.write(json.dumps(self.history[-1]) + "\n")
        self._write_table(trainer, run_dir, step, table)
        main = {k: v for k, v in metrics.items() if not k.startswith("hacking/")}
        rank_zero_info(f"[eval {label}] step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in main.items()))

    def _write_table(self, trainer, run_dir, step: int, table: list[dict[str, Any]]) -> None:
        path = run_dir / "samples.csv"
        fields = ["step", "prompt", "greedy", "reward", "sample"]
        new = not path.exists()
        with path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerows({"step": step, **row} for row in table)
        for logger in trainer.loggers:
            if type(logger).__name__ == "WandbLogger":
                logger.log_table(key="eval/samples", columns=fields,
                                 data=[[step, *(row.get(k, "") for k in fields[1:])] for row in table])


def finite_means(values: dict[str, list[float]], module, what: str) -> dict[str, float]:
    """Means over the finite values (esrl/finite.py's policy, as in training): non-finite rewards are left out and
    counted in `bad_rewards`; more than half of them stops the run in one line naming the reward function."""
    rewards = values["reward"]
    bad = sum(not math.isfinite(v) for v in rewards)
    if bad * 2 > len(rewards):
        names = ", ".join(sorted(getattr(module.task, "last_bad", {}) or {})) or "of the task"
        raise RewardError(f"evaluation at step {module.trainer.global_step}: reward function {names} gave non-finite "
                          f"{what}s (NaN/inf) to {bad} of {len(rewards)} samples, more than the 50% allowed")
    out = {k: fmean([x for x in v if math.isfinite(x)] or [math.nan]) for k, v in values.items()}
    if bad:
        out["bad_rewards"] = float(bad)
    return out


def _trim_table(path, step: int) -> None:
    if not path.is_file():
        return
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        fields, rows = reader.fieldnames, [r for r in reader if int(r["step"]) <= step]

    def write(tmp: Path) -> None:
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)

    write_with(path, write)


class _AdapterOff:
    """A PEFT policy called with its adapter disabled (PEFT's disable_adapter), as GRPOModule.reference_logps reads
    its LoRA reference: the base model's log-probs without a second copy of it."""

    def __init__(self, policy: torch.nn.Module):
        self.policy = policy

    def __call__(self, *args, **kwargs):
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)
