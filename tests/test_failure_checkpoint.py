"""A fit that fails part way keeps the steps it finished: esrl's Interruption callback (on in every fit) saves
interrupted.ckpt when a step fails, also where a config has no ModelCheckpoint (the demos) or one that has not
saved for a while (es_pku.yaml: every 10 steps), and never a checkpoint that could not resume into the run that
never failed."""

from __future__ import annotations

import lightning as L
import torch

from conftest import FailAt, conciseness_data
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
        assert ckpt["global_step"] == 2 and ckpt["PromptDataModule"] == {"epoch": 0, "batches": 2}, algo
        resumed = _fit(tiny_model, tmp_path / algo / "failed", algo,
                       ckpt_path=str(tmp_path / algo / "failed" / "checkpoints" / "interrupted.ckpt"))
        assert not hasattr(resumed, "error"), algo
        after = dict(resumed.policy.named_parameters())
        assert all(torch.equal(p, after[n]) for n, p in whole.policy.named_parameters()), algo
        assert _saved(tmp_path / algo / "failed") is None  # spent by the fit that finished


def test_no_checkpoint_of_a_state_that_could_not_resume(tiny_model, tmp_path):
    """Not saved: GRPO's update applied but not yet counted by Lightning (the engine's sync after it failed: a resume
    would apply it twice), a non-finite update (its weights are the failure), and a fit that failed before finishing
    a step (nothing to keep). A step that failed after the first: saved."""
    cases = {"uncounted": ("grpo", FailAt(lambda m: m, "sync_engine", 1), None),
             "non_finite": ("es", FailAt(lambda m: m.task, "rewards", 1, error=NonFiniteUpdateError), None),
             "first_step": ("es", FailAt(lambda m: m.task, "rewards", 0), None),
             "second_step": ("grpo", FailAt(lambda m: m.task, "rewards", 1), 1)}
    for name, (algo, fail, saved_at) in cases.items():
        module = _fit(tiny_model, tmp_path / name, algo, callbacks=[fail])
        assert "failed (injected)" in str(module.error), name
        ckpt = _saved(tmp_path / name)
        assert (ckpt and ckpt["global_step"]) == saved_at, name
