"""LightningCLI's --optimizer / --lr_scheduler reach GRPO as callables, built over the policy configure_model made."""

from __future__ import annotations

import pytest
import torch
from conftest import ROOT

from esrl.cli import EsrlCLI
from esrl.data import PromptDataModule
from esrl.errors import ConfigError
from esrl.module_factory import build_module


def cli(tiny_model, tmp_path, algo: str, *flags: str) -> EsrlCLI:
    return EsrlCLI(build_module, PromptDataModule, run=False, args=[
        "--config", str(ROOT / "configs/demo/es_conciseness.yaml"), "--algo", algo,
        "--model.policy.name_or_path", tiny_model, "--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.max_steps", "4", "--trainer.default_root_dir", str(tmp_path), *flags])


def optimizers(c: EsrlCLI):
    c.model.trainer = c.trainer
    c.model.configure_model()
    return c.model.configure_optimizers()


def test_optimizer_and_scheduler_flags_build_over_the_trainable_parameters(tiny_model, tmp_path):
    c = cli(tiny_model, tmp_path, "grpo", "--optimizer", "torch.optim.SGD", "--optimizer.lr", "0.1",
            "--lr_scheduler", "torch.optim.lr_scheduler.StepLR", "--lr_scheduler.step_size", "2")
    config = optimizers(c)
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert config["lr_scheduler"]["interval"] == "step"  # as TRL's, not LightningCLI's once an epoch
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.param_groups[0]["lr"] == 0.1
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR) and scheduler.step_size == 2
    trainable = [p for p in c.model.policy.parameters() if p.requires_grad]
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in trainable]


def test_scheduler_flag_alone_schedules_the_default_adamw(tiny_model, tmp_path):
    c = cli(tiny_model, tmp_path, "grpo", "--lr_scheduler", "torch.optim.lr_scheduler.StepLR",
            "--lr_scheduler.step_size", "3")
    config = optimizers(c)
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert isinstance(optimizer, torch.optim.AdamW) and [g["weight_decay"] for g in optimizer.param_groups][1] == 0
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)


def test_without_flags_grpo_keeps_trl_defaults(tiny_model, tmp_path):
    config = optimizers(cli(tiny_model, tmp_path, "grpo"))
    assert isinstance(config["optimizer"], torch.optim.AdamW)
    assert config["lr_scheduler"]["interval"] == "step"


def test_es_refuses_the_optimizer_flag_naming_it(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="^--optimizer: .*model.es.optimizer"):
        cli(tiny_model, tmp_path, "es", "--optimizer", "torch.optim.SGD", "--optimizer.lr", "0.1")


@pytest.mark.parametrize("flags, message", [
    (["--optimizer", "torch.optim.SGD", "--optimizer.lr=-1"], "--optimizer: Invalid learning rate: -1.0"),
    (["--lr_scheduler", "torch.optim.lr_scheduler.ReduceLROnPlateau"],
     "--lr_scheduler ReduceLROnPlateau: steps on a monitored metric"),
])
def test_what_torch_or_lightning_refuse_in_the_flags_is_one_config_error_naming_the_flag(tiny_model, tmp_path,
                                                                                        flags, message):
    """torch checks an optimizer's arguments, Lightning a plateau schedule's monitor, only once they are built
    (after the model loads): a ConfigError naming the flag, not their tracebacks."""
    with pytest.raises(ConfigError) as err:
        optimizers(cli(tiny_model, tmp_path, "grpo", *flags))
    assert str(err.value).startswith(message)


def test_a_schedule_missing_an_argument_names_it_and_no_other_base_class(tmp_path):
    """jsonargparse lists each base class a schedule failed to be: LRScheduler alone (ReduceLROnPlateau is one)."""
    from conftest import run_esrl

    out = run_esrl("fit", "--config", ROOT / "configs/demo/es_conciseness.yaml", "--algo", "grpo",
                   "--lr_scheduler", "torch.optim.lr_scheduler.StepLR", "--trainer.default_root_dir", tmp_path)
    assert out.returncode == 2
    line = next(line for line in out.stderr.splitlines() if line.startswith("esrl: error:"))
    assert "the following arguments are required: step_size" in line and "ReduceLROnPlateau" not in line, line
