"""The study files the `esrl study` tests write: a tiny base config and a study over it (2 seeds x {ES, GRPO})."""

from __future__ import annotations

from pathlib import Path

import yaml
from conftest import FIXTURES


def base_config(tiny_model: str) -> dict:
    """One ES or GRPO step on the tiny model over the conciseness fixtures, with an evaluation of 2 samples."""
    return {
        "seed_everything": 0, "algo": "es",
        "model": {"policy": {"name_or_path": str(tiny_model)}, "rollout": {"max_new_tokens": 4},
                  "es": {"population_size": 2, "sigma": 0.05, "alpha": 0.02},
                  "grpo": {"num_generations": 2, "learning_rate": 1e-2}},
        "data": {"task": "conciseness", "prompts_per_step": 1,
                 "task_args": {"train_path": str(FIXTURES / "conciseness_train3.jsonl"),
                               "eval_path": str(FIXTURES / "conciseness_eval2.jsonl")}},
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 1, "enable_progress_bar": False,
                    "enable_model_summary": False, "enable_checkpointing": False,
                    "callbacks": [{"class_path": "esrl.callbacks.Evaluation",
                                   "init_args": {"num_samples": 2, "kl": True}}]},
    }


def write_study(folder: Path, tiny_model: str, **changes) -> Path:
    """folder/study.yaml over folder/base.yaml, out in folder/out; `changes` replace the study's own fields."""
    (folder / "base.yaml").write_text(yaml.safe_dump(base_config(tiny_model)))
    study = {"name": "tiny", "base_config": "base.yaml", "out": str(folder / "out"), "seeds": [0, 1],
             "algorithms": {"es": None, "grpo": {"algo": "grpo", "overrides": {"model.grpo.beta": 0.0}}},
             "checkpoint_every_n_steps": 1, "keep_checkpoints": True,
             "analysis": {"num_prompts": 2, "alphas": [0, 0.5, 1], "sigmas": [0, 0.05]}, **changes}
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    return path

