"""A fit that fails part way keeps the steps it finished: esrl's Interruption callback (on in every fit) saves
interrupted.ckpt when a step fails, also where a config has no ModelCheckpoint (the demos) or one that has not
saved for a while (es_pku.yaml: every 10 steps), and never a checkpoint that could not resume into the run that
never failed."""

from __future__ import annotations

import csv
import json

import lightning as L
import pytest
import torch
import yaml

from conftest import (FIXTURES, FailAt, assert_same_tensors, conciseness_data, load_safetensors, run_esrl,
                      write_tiny_config)
from esrl.errors import NonFiniteUpdateError


def _fit(tiny_model, root, algo: str, steps: int = 3, callbacks=(), ckpt_path=None):
    """An in-process fit on the tiny model without ModelCheckpoint (ES: 4 members; GRPO: 2 completions, 1 prompt a
    step); the module, its error kept, however the fit ended."""
    from esrl.policy import PolicyConfig
    from esrl.rollout import RolloutConfig

    policy, rollout = PolicyConfig(name_or_path=tiny_model), RolloutConfig(max_new_tokens=4, temperature=1.0)
    if algo == "es":
        from esrl.es.config import ESConfig
        from esrl.es.module import ESModule

        module = ESModule(policy, rollout, ESConfig(population_size=4, sigma=0.05, alpha=0.01, seed=1, mode="full"))
    else:
        from esrl.grpo.config import GRPOConfig
        from esrl.grpo.module import GRPOModule

        module = GRPOModule(policy, rollout, GRPOConfig(num_generations=2, seed=1))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, enable_progress_bar=False,
                        enable_model_summary=False, logger=False, default_root_dir=root, limit_val_batches=0,
                        callbacks=list(callbacks), enable_checkpointing=False)
    try:
        trainer.fit(module, datamodule=conciseness_data(1), ckpt_path=ckpt_path)
    except Exception as e:  # noqa: BLE001 - the test reads it
        module.error = e
    return module


def _saved(root):
    path = root / "checkpoints" / "interrupted.ckpt"
    return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None


def test_a_failed_step_leaves_a_checkpoint_that_resumes_into_the_weights_of_a_run_never_stopped(tiny_model, tmp_path):
    """ES and GRPO, a reward function failing at step 2 (a scorer down after its retries): interrupted.ckpt at step
    2 with the data position of the prompts whose steps finished; resumed, the run ends in the weights of the run
    that never failed, bit for bit (the resumed fit logs no error)."""
    for algo in ("es", "grpo"):
        whole = _fit(tiny_model, tmp_path / algo / "whole", algo)
        failed = _fit(tiny_model, tmp_path / algo / "failed", algo, callbacks=[FailAt(lambda m: m.task, "rewards", 2)])
        assert "rewards failed" in str(failed.error)
        ckpt = _saved(tmp_path / algo / "failed")
        assert ckpt["global_step"] == 2, algo
        assert ckpt["PromptDataModule"] == {"epoch": 0, "batches": 2, "replicas": 1, "micro_batches": 1}, algo
        resumed = _fit(tiny_model, tmp_path / algo / "failed", algo,
                       ckpt_path=str(tmp_path / algo / "failed" / "checkpoints" / "interrupted.ckpt"))
        assert not hasattr(resumed, "error"), algo
        after = dict(resumed.policy.named_parameters())
        assert all(torch.equal(p, after[n]) for n, p in whole.policy.named_parameters()), algo
        assert _saved(tmp_path / algo / "failed") is None  # spent by the fit that finished


def test_no_checkpoint_of_a_state_that_could_not_resume(tiny_model, tmp_path):
    """Not saved: GRPO's update applied but not yet counted by Lightning (the engine's sync after it failed: a resume
    would apply it twice), an optimizer step that failed part way (ES and GRPO: AdamW's moments and decay, some
    tensors stepped: its weights are neither step's; before, both saved them as the step's start), a non-finite
    update (its weights are the failure), a failure in an epoch's end hooks (its loop counters resumed one batch off),
    and a fit that failed before finishing a step (nothing to keep). A step that failed after the first: saved."""
    optimizer = lambda m: m.trainer.optimizers[0]  # noqa: E731 - the torch optimizer Lightning's step calls
    cases = {"uncounted": ("grpo", FailAt(lambda m: m, "sync_engine", 1), None),
             "es_partial_step": ("es", FailAt(optimizer, "step", 1, after=True), None),
             "grpo_partial_step": ("grpo", FailAt(optimizer, "step", 1, after=True), None),
             "non_finite": ("es", FailAt(lambda m: m.task, "rewards", 1, error=NonFiniteUpdateError), None),
             "first_step": ("es", FailAt(lambda m: m.task, "rewards", 0), None),
             "epoch_end": ("es", FailAt(lambda m: m, "on_train_epoch_end", 1), None),
             "second_step": ("grpo", FailAt(lambda m: m.task, "rewards", 1), 1)}
    for name, (algo, fail, saved_at) in cases.items():
        module = _fit(tiny_model, tmp_path / name, algo, callbacks=[fail])
        assert "failed (injected)" in str(module.error), name
        ckpt = _saved(tmp_path / name)
        assert (ckpt and ckpt["global_step"]) == saved_at, name


def _files(root) -> tuple[dict, list[dict]]:
    """metrics.csv as {step: {name: value}} without the timings, and eval.jsonl without its seconds."""
    (version,) = (root / "lightning_logs").iterdir()
    rows: dict = {}
    with open(version / "metrics.csv") as f:
        for row in csv.DictReader(f):
            values = {k: v for k, v in row.items() if v and k != "step" and not k.startswith("time/")}
            rows.setdefault(int(row["step"]), {}).update(values)
    evals = [{k: v for k, v in json.loads(line).items() if "seconds" not in k}
             for line in (version / "eval.jsonl").read_text().splitlines()]
    return rows, evals


@pytest.mark.slow
@pytest.mark.parametrize("algo, every", [("es", 0), ("grpo", 1)], ids=["es-in_training", "grpo-in_evaluation"])
def test_a_fit_that_failed_resumes_into_the_files_and_weights_of_a_fit_never_stopped(tiny_model, tmp_path,
                                                                                     monkeypatch, algo, every):
    """`esrl fit` whose scorer goes down at step 2 (in a training step; in the evaluation after step 2): exit 2 with
    the error's one line and interrupted.ckpt; `--ckpt_path last` then ends in the weights, metrics.csv rows (each
    value at its step) and eval.jsonl of a fit never stopped. Lightning's own save_on_exception checkpoint resumed
    with every later metrics.csv row one step late, and without the evaluation that failed."""
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    config = write_tiny_config(tmp_path / "c.yaml", tiny_model, max_steps=4, es={"population_size": 4},
                               rollout={"temperature": 1.0}, grpo={"num_generations": 2, "learning_rate": 1e-3},
                               trainer={"callbacks": [{"class_path": "esrl.callbacks.Evaluation",
                                                       "init_args": {"every_n_steps": every}}]})
    data = yaml.safe_load(config.read_text())
    data["data"]["task"] = "jsonl"
    data["data"]["task_args"] = {"train_path": str(FIXTURES / "conciseness_train3.jsonl"), "prompt_field": "question",
                                 "eval_path": str(FIXTURES / "conciseness_eval2.jsonl"),
                                 "reward_funcs": ["outage:length"]}
    config.write_text(yaml.safe_dump(data))
    fit = ("fit", "--config", config, "--algo", algo)
    assert run_esrl(*fit, "--trainer.default_root_dir", tmp_path / "whole").returncode == 0
    monkeypatch.setenv("ESRL_TEST_OUTAGE_STEP", "2")
    failed = run_esrl(*fit, "--trainer.default_root_dir", tmp_path / "failed")
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert [line for line in failed.stderr.splitlines() if line.startswith("esrl: error:")] == [
        "esrl: error: reward function length raised ConnectionError: scorer down at step 2 (injected)"]
    (saved,) = (tmp_path / "failed").rglob("interrupted.ckpt")
    assert torch.load(saved, map_location="cpu", weights_only=False)["global_step"] == 2
    monkeypatch.delenv("ESRL_TEST_OUTAGE_STEP")
    resumed = run_esrl(*fit, "--trainer.default_root_dir", tmp_path / "failed", "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _files(tmp_path / "failed") == _files(tmp_path / "whole")
    (whole,), (after,) = (tmp_path / "whole").rglob("final"), (tmp_path / "failed").rglob("final")
    assert_same_tensors(load_safetensors(after / "model.safetensors"), load_safetensors(whole / "model.safetensors"))


class SaveDuringGenerate(L.Callback):
    """Asks for a checkpoint from inside a member's rollout at `step`, as a signal handler does (Lightning's SLURM
    auto-requeue saves from its SIGUSR1 handler wherever the step is)."""

    def __init__(self, path, step: int):
        self.path, self.step = path, step

    def on_train_start(self, trainer, module):
        generate = module.engine.generate

        def saving(*args, **kwargs):
            if trainer.global_step == self.step:
                trainer.save_checkpoint(self.path)
            return generate(*args, **kwargs)

        module.engine.generate = saving


def test_a_checkpoint_asked_for_while_a_member_is_in_the_weights_is_refused(tiny_model, tmp_path):
    """Full mode writes a member's noise into the weights: a save then (before: saved, and resumed as the step's
    start) is one error naming the cause; the member is restored and the failure checkpoint holds step 1's end."""
    mid = tmp_path / "mid.ckpt"
    module = _fit(tiny_model, tmp_path, "es", callbacks=[SaveDuringGenerate(mid, 1)])
    assert "while a population member's noise is in the weights" in str(module.error) and not mid.exists()
    ckpt = _saved(tmp_path)
    assert ckpt["global_step"] == 1
    assert all(torch.equal(ckpt["state_dict"][f"policy.{n}"], p) for n, p in module.policy.named_parameters())
