"""Every YAML in configs/ parses and builds (model swapped for the tiny one, on CPU) for BOTH algorithms: one
flag (--algo) swaps ES and GRPO on every shipped config, each with its own explicitly chosen learning rate."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from esrl.cli import EsrlCLI
from esrl.data import PromptDataModule
from esrl.module_factory import build_module
from esrl.policy import PolicyModule

# `esrl fit` configs (other YAML under configs/, e.g. a study's plan, has neither a model nor a trainer).
CONFIGS = sorted(c for c in (ROOT / "configs").rglob("*.yaml")
                 if {"model", "trainer"} & set(yaml.safe_load(c.read_text()) or {}))


ALGOS = ("es", "grpo")
LR_FIELD = {"es": "alpha", "grpo": "learning_rate"}  # ES's step size is its learning rate


def sections(config: Path) -> dict:
    return yaml.safe_load(config.read_text()).get("model", {})


def offline_data(config: Path) -> list[str]:
    """Overrides pointing a hub data set at the project's fixture (no network in tests)."""
    data = yaml.safe_load(config.read_text()).get("data", {})
    if data.get("task") == "pku_saferlhf" and "/" in str(data.get("task_args", {}).get("path", "")):
        return ["--data.task_args.path", str(ROOT / "configs/demo/data/pku_train16.jsonl"),
                "--data.task_args.num_train", "4",
                "--data.task_args.num_eval", "4", "--data.prompts_per_step", "4"]  # no more than the fixture has
    if data.get("task") == "math" and "/" in str(data.get("task_args", {}).get("path", "")):
        return ["--data.task_args.path", str(ROOT / "tests/fixtures/math_small.jsonl"),
                "--data.task_args.num_train", "6", "--data.task_args.num_eval", "4",
                "--data.prompts_per_step", "4"]
    return []


@pytest.mark.parametrize("config", CONFIGS, ids=lambda v: str(v.relative_to(ROOT)))
def test_every_config_has_both_sections_with_explicit_learning_rates(config):
    model = sections(config)
    for algo in ALGOS:
        section = model.get(algo) or {}
        assert LR_FIELD[algo] in section, f"{config.name}: model.{algo}.{LR_FIELD[algo]} not set"
        assert float(section[LR_FIELD[algo]]) > 0


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.parent == ROOT / "configs"], ids=lambda v: v.name)
def test_gpu_configs_grpo_rates_are_constant_as_the_papers(config):
    """The README's promise: GPU configs take the ES paper's GRPO baselines' (and DeepSeekMath's) rates, constant;
    GRPOConfig's default schedule (TRL's linear decay) would halve the mean rate of a paper's run."""
    assert sections(config)["grpo"].get("lr_scheduler") == "constant", config.name


@pytest.mark.parametrize("config,algo", [(c, a) for c in CONFIGS for a in ALGOS],
                         ids=lambda v: str(v.relative_to(ROOT)) if isinstance(v, Path) else v)
def test_config_builds(config, algo, tiny_model, tmp_path):
    cli = EsrlCLI(build_module, PromptDataModule, run=False, args=[
        "--config", str(config), "--algo", algo, "--model.policy.name_or_path", tiny_model,
        "--model.policy.dtype", "float32", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.strategy", "auto", "--trainer.default_root_dir", str(tmp_path), *offline_data(config)])
    assert isinstance(cli.model, PolicyModule)
    assert type(cli.model).__name__ == {"es": "ESModule", "grpo": "GRPOModule"}[algo]
    assert len(cli.datamodule.task.train_rows) > 0
    expected_strategy = "ESStrategy" if algo == "es" else "SingleDeviceStrategy"
    assert type(cli.trainer.strategy).__name__ == expected_strategy
    # The config's own learning rate reached the module (not a library default).
    settings = cli.model.es if algo == "es" else cli.model.grpo
    assert getattr(settings, LR_FIELD[algo]) == pytest.approx(float(sections(config)[algo][LR_FIELD[algo]]))
    if algo == "es":  # a GRPO config's gradient settings are dropped: Lightning refuses them under ES
        assert cli.trainer.gradient_clip_val is None and cli.trainer.accumulate_grad_batches == 1


def test_es_on_a_grpo_config_drops_its_gradient_settings(tiny_model, tmp_path, capsys):
    """configs/grpo_conciseness.yaml (DeepSpeed ZeRO-2, bf16-mixed, gradient clipping) under --algo es: the es
    strategy, 32-true, no clipping, and one line telling the user so (its strategy and precision are left as
    written: no override here)."""
    cli = EsrlCLI(build_module, PromptDataModule, run=False, args=[
        "--config", str(ROOT / "configs/grpo_conciseness.yaml"), "--algo", "es",
        "--model.policy.name_or_path", tiny_model, "--model.policy.dtype", "float32",
        "--model.rollout.vllm_sleep", "true",  # GRPO's too: ES refuses it, --algo es drops it
        "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.default_root_dir", str(tmp_path)])
    assert type(cli.trainer.strategy).__name__ == "ESStrategy" and cli.trainer.gradient_clip_val is None
    assert cli.trainer.precision == "32-true"  # its bf16-mixed: ES has no backward to autocast
    assert cli.model.rollout_config.vllm_sleep is False
    err = capsys.readouterr().err
    assert "trainer.strategy deepspeed_stage_2 -> es" in err and "trainer.gradient_clip_val 1.0 dropped" in err
    assert "trainer.precision bf16-mixed -> 32-true" in err and "model.rollout.vllm_sleep dropped" in err


@pytest.mark.parametrize("strategy", ["fsdp", "ddp_find_unused_parameters_true", "single_device"])
def test_es_replaces_other_data_parallel_and_sharding_strategies_with_a_note(strategy, tiny_model, tmp_path, capsys):
    """ES has no gradients to reduce or shard: another DDP launcher's or a sharding strategy becomes `es` (with 2
    devices DDP's own would lack ES's collectives; FSDP's shards could not be perturbed in place), and says so."""
    cli = EsrlCLI(build_module, PromptDataModule, run=False, args=[
        "--config", str(ROOT / "configs/demo/es_conciseness.yaml"), "--model.policy.name_or_path", tiny_model,
        "--trainer.strategy", strategy, "--trainer.default_root_dir", str(tmp_path)])
    assert type(cli.trainer.strategy).__name__ == "ESStrategy"
    assert f"trainer.strategy {strategy} -> es" in capsys.readouterr().err


def test_there_are_configs():
    names = {str(c.relative_to(ROOT / "configs")) for c in CONFIGS}
    assert {"es_conciseness.yaml", "es_countdown.yaml", "es_pku.yaml", "demo/es_conciseness.yaml",
            "demo/es_pku.yaml"} <= names


def test_an_es_module_refuses_vllm_sleep_it_would_ignore():
    """Built in code (the CLI drops it under --algo es): rollout.vllm_sleep promised memory ES never frees."""
    from esrl.errors import ConfigError
    from esrl.es.module import ESModule
    from esrl.rollout import RolloutConfig

    with pytest.raises(ConfigError, match="^model.rollout.vllm_sleep: GRPO's option"):
        ESModule(rollout=RolloutConfig(engine="vllm", vllm_sleep=True))
