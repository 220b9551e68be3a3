"""W&B through Lightning's WandbLogger, offline: metrics, the shared evaluation and its sample table."""

from __future__ import annotations

import pytest
import yaml
from conftest import FIXTURES, run_esrl

pytestmark = pytest.mark.slow


def test_es_fit_logs_to_wandb_offline(tiny_model, tmp_path):
    pytest.importorskip("wandb")
    config = {
        "seed_everything": 0, "algo": "es",
        "model": {"policy": {"name_or_path": tiny_model}, "rollout": {"max_new_tokens": 4},
                  "es": {"population_size": 2, "sigma": 0.05, "alpha": 0.02}},
        "data": {"task": "conciseness", "prompts_per_step": 1,
                 "task_args": {"train_path": str(FIXTURES / "conciseness_train3.jsonl"),
                               "eval_path": str(FIXTURES / "conciseness_eval2.jsonl")}},
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 2, "enable_progress_bar": False,
                    "enable_checkpointing": False,
                    "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                                "init_args": {"save_dir": str(tmp_path)}},
                               {"class_path": "lightning.pytorch.loggers.WandbLogger",
                                "init_args": {"offline": True, "project": "esrl-test",
                                              "save_dir": str(tmp_path)}}]},
    }
    path = tmp_path / "wandb.yaml"
    path.write_text(yaml.safe_dump(config))
    out = run_esrl("fit", "--config", path, "--trainer.default_root_dir", tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(tmp_path.rglob("*"))[:50]
    assert list(runs[0].glob("*.wandb")), "no W&B run file written"
    # the shared evaluation logs its sample table at step 0 and at the end
    tables = list((runs[0] / "files" / "media" / "table" / "eval").glob("samples_*.table.json"))
    assert len(tables) == 2, tables
    assert "greedy" in tables[0].read_text()
    assert list(tmp_path.rglob("config.yaml"))  # the resolved config saved in the run directory


def test_wandb_online_without_an_api_key_is_one_line_naming_the_logger(tiny_model, tmp_path, monkeypatch):
    """W&B refuses to start online without a key (it raises its own UsageError): one line naming the logger and the
    offline way out, not W&B's traceback. The key and any netrc are kept out: no network is touched."""
    pytest.importorskip("wandb")
    from conftest import write_tiny_config

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_ANONYMOUS"):
        monkeypatch.delenv(name, raising=False)
    config = write_tiny_config(tmp_path / "c.yaml", tiny_model, trainer={"logger": [
        {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"project": "esrl-test"}}]})
    out = run_esrl("fit", "--config", config, "--trainer.default_root_dir", tmp_path / "runs")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == ("esrl: error: trainer.logger WandbLogger: No API key configured. "
                                                   "Use `wandb login` to log in. (or run offline: WANDB_MODE=offline)")
